"""Command line: ``python -m inductor_ext {report,bench,doctor,mismatch}`` (also the ``glm53-inductor`` script)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from inductor_ext import backends
from inductor_ext.bench import BENCHES, format_benches, run_benches
from inductor_ext.bench.inputs import MODEL_PRESETS
from inductor_ext.bench.invariance import PARTS as INVARIANCE_PARTS
from inductor_ext.bench.layer import KINDS, PRECISIONS
from inductor_ext.cli_args import check_output_path, nonempty_path, positive_float, positive_int, seed
from inductor_ext.report import MismatchSettings, cp_check, default_arms, format_table, run_mismatch, run_report
from inductor_ext.report.report import write_mismatch

__all__ = ["main"]

_LAYER_OPTIONS = ("kinds", "attn_impl", "precision", "timing_only")  # `bench layer`'s own flags, as argparse names them
# MismatchSettings field -> its option
_MISMATCH_OPTIONS = {"seed": "--seed", "num_seqs": "--seqs", "prompt_len": "--prompt-len", "new_tokens": "--new-tokens",
                     "target_entropy": "--entropy"}
# what each command writes under --out (checked, with --out itself, before the command starts)
_ARTIFACTS = {"report": ("report.json", "report.md", "report.png"), "bench": ("bench.json", "bench.md"),
              "mismatch": ("mismatch.json", "mismatch.md", "mismatch.png")}


def _progress():
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda msg: print(f"... {msg}", file=sys.stderr, flush=True)
    return lambda msg: tqdm.write(f"... {msg}", file=sys.stderr)


def _device(arg: str | None, hint: str) -> str:
    if arg is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if arg == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"no CUDA device is visible; {hint}")
    return arg


def _doctor() -> dict:
    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for name in backends.PACKAGES:
        info[name] = {"usable": backends.available(name), "version": backends.version(name)}
    cuda = torch.cuda.is_available()
    fla = cuda and backends.available("fla")
    info["kernels"] = {
        "kda_chunk[bf16]": "flash-linear-attention chunk_kda kernels" if fla else "plain-torch reference",
        "kda_chunk[fp32]": ("own FP32-grade Triton kernels (head dims <= 128; wider: flash-linear-attention, "
                            "TF32 dots)" if cuda else "plain-torch reference"),
    }
    info["kernels"]["kda_recurrent"] = "plain-torch FP32 recurrence"
    return info


def main(argv=None) -> int:
    """Parse ``argv`` and run the command; a usage or availability error prints one line, exit 2."""
    try:
        return _run(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m inductor_ext", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="accuracy, compile and (CUDA) timing report")
    rep.add_argument("--out", type=nonempty_path, default=pathlib.Path("report_out"))
    rep.add_argument("--device", choices=("cpu", "cuda"))
    rep.add_argument("--tokens", type=positive_int, nargs="+",
                     help="token counts of the CUDA timing: KDA at each, the other benches at the first "
                          "(default: KDA at 129 2048 16384, each other bench its own)")
    ben = sub.add_parser("bench", help="CUDA-graph replay timing",
                         description="CUDA-graph replay timing (CUDA only): " + "; ".join(
                             f"{name}: {b.title}" for name, b in BENCHES.items()) + "; all: each in that order. "
                         "Writes bench.json and bench.md under --out after each benchmark (and each layer kind).")
    ben.add_argument("what", choices=(*BENCHES, "all"))
    ben.add_argument("--out", type=nonempty_path, default=pathlib.Path("bench_out"))
    ben.add_argument("--tokens", type=positive_int, nargs="+",
                     help="KDA at each token count, the other benches at the first (default: KDA at 129 2048 "
                          "16384, each other bench its own)")
    ben.add_argument("--samples", type=positive_int, help="replays per timing (default: 50; layer 20)")
    lay = ben.add_argument_group("bench layer (also under all)")
    lay.add_argument("--kinds", nargs="+", choices=KINDS, help="layer kinds, one after the other (default: kda dsa)")
    lay.add_argument("--attn-impl", choices=("flex", "eager"),
                     help="the DSA layer's sparse attention: flex (FlexAttention, default) or eager (dense masked)")
    lay.add_argument("--precision", choices=PRECISIONS, help="PrecisionConfig preset (default serving_aligned)")
    lay.add_argument("--timing-only", action="store_const", const=True,
                     help="compile, capture and time only: no eager reference, sensitivity or warm compile "
                          "(for lengths whose eager layer does not fit or takes too long)")
    inv = ben.add_argument_group("bench invariance (also under all)")
    inv.add_argument("--parts", nargs="+", choices=INVARIANCE_PARTS,
                     help=f"pieces, in this order, each under both configs (default: {' '.join(INVARIANCE_PARTS)})")
    sub.add_parser("doctor", help="versions, usable back-ends, which kernel each op takes")
    cp_check.add_arguments(sub.add_parser(
        "cp-check", help="context parallel on N processes (gloo on CPU, NCCL on GPUs) against one rank"))
    mis = sub.add_parser("mismatch", help="fixed-token train/serve mismatch-KL ablation over PrecisionConfig arms")
    mis.add_argument("--out", type=nonempty_path, default=pathlib.Path("mismatch_out"))
    mis.add_argument("--seed", type=seed, default=0)
    mis.add_argument("--seqs", type=positive_int, default=8, help="sampled sequences (default 8)")
    mis.add_argument("--prompt-len", type=positive_int, default=16)
    mis.add_argument("--new-tokens", type=positive_int, default=32, help="response tokens per sequence (default 32)")
    mis.add_argument("--entropy", type=positive_float, default=2.0,
                     help="calibration target, nats, below ln(vocab_size) (default 2.0)")
    mis.add_argument("--compile", choices=("aot_eager", "inductor", "eager", "none"), default="inductor",
                     help="torch.compile backend of the training model (default inductor, with the plugin "
                          "enabled; none = eager)")
    mis.add_argument("--arms", nargs="+", help="subset of arms (default: reference, every path, serving_aligned)")
    mis.add_argument("--preset", choices=tuple(MODEL_PRESETS), default="tiny",
                     help="model: tiny (CPU, default) or h200_stack (3 KDA + 1 DSA at h200 widths, 32 experts; CUDA)")
    mis.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    mis.add_argument("--batch-invariant", action="store_true",
                     help="true on-policy: every arm's config and the serving precision with batch_invariant=True "
                          "(and mla=absorbed, which it needs; the mla arm then equals reference and is left out), "
                          "the vocabulary log-softmax through glm53::bi_log_softmax")
    args = parser.parse_args(argv)
    if args.command in _ARTIFACTS:  # cp-check checks its --json in cp_check.run, before it spawns
        check_output_path(args.out, "--out", files=_ARTIFACTS[args.command])

    if args.command == "doctor":
        print(json.dumps(_doctor(), indent=2))
        return 0
    if args.command == "cp-check":
        return cp_check.run(args)
    progress = _progress()
    if args.command == "mismatch":
        arms = default_arms()
        if args.arms:
            bad = [a for a in args.arms if a not in arms]
            if bad:
                raise ValueError(f"--arms: unknown arm(s) {bad}; choose from {list(arms)}")
            arms = {a: arms[a] for a in args.arms}
        try:
            settings = MismatchSettings(preset=args.preset, device=args.device, seed=args.seed, num_seqs=args.seqs,
                                        prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                        target_entropy=args.entropy, compile=args.compile,
                                        batch_invariant=args.batch_invariant)
        except ValueError as exc:  # name the option of the field too
            options = [opt for field, opt in _MISMATCH_OPTIONS.items() if field in str(exc)]
            raise ValueError(f"{exc} ({', '.join(options)})" if options else str(exc)) from None
        result = run_mismatch(settings, arms=arms, progress=progress)
        print(format_table(result))
        print("wrote " + ", ".join(str(p) for p in write_mismatch(result, args.out)))
        return 0
    if args.command == "report":
        run_report(args.out, _device(args.device, "use --device cpu"), bench_tokens=args.tokens, progress=progress)
        print((args.out / "report.md").read_text())
        print(f"wrote {args.out}/report.json, report.md, report.png")
        return 0
    return _bench(args, progress)


def _bench(args, progress) -> int:
    """``bench``: run the benchmarks, rewriting ``bench.json`` / ``bench.md`` after each (and after
    each layer kind and each piece of ``invariance``: a run cut short keeps what finished)."""
    names = tuple(BENCHES) if args.what == "all" else (args.what,)
    layer = {k: getattr(args, k) for k in _LAYER_OPTIONS if getattr(args, k) is not None}
    if layer and "layer" not in names:
        raise ValueError("--kinds, --attn-impl, --precision and --timing-only are options of `bench layer`, "
                         f"not `bench {args.what}`")
    if args.parts is not None and "invariance" not in names:
        raise ValueError(f"--parts is an option of `bench invariance`, not `bench {args.what}`")
    parts = {} if args.parts is None else {"parts": tuple(args.parts)}
    _device("cuda", "bench times CUDA-graph replays; run it on a GPU machine, or `report` on this one")
    results = {}

    def save(name, result):
        results[name] = result
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench.json").write_text(json.dumps(results, indent=2))
        (args.out / "bench.md").write_text(format_benches(results) + "\n")

    def done(name, result):
        save(name, result)
        print(format_benches({name: result}))

    run_benches(names, args.tokens, args.samples, progress, on_result=done,
                options={"layer": {**layer, "on_partial": lambda result: save("layer", result)},
                         "invariance": {**parts, "on_partial": lambda result: save("invariance", result)}})
    print(f"wrote {args.out}/bench.json, bench.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
