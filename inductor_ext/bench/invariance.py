"""``python -m inductor_ext bench invariance``: the price of ``PrecisionConfig.batch_invariant``.

In one process, under ``serving_aligned()`` and under the same config with ``batch_invariant=True``:

- the ``h200`` KDA and DSA decoder layers, forward and forward + backward, compiled and replayed
  as CUDA graphs (:func:`inductor_ext.bench.layer.bench_layer` with ``timing_only``: its rows,
  p50 / max per replay; ``bench layer`` is where the compiled layers are checked against eager);
- one serving decode step of the ``h200_stack`` model (:func:`inductor_ext.bench.inputs.build_model`;
  ``decode_seqs`` sequences after a ``decode_prompt``-token prefill, eager as the decoder runs:
  CUDA events around each :meth:`graphs.decode.ServingDecoder.step`, ``decode_steps`` steps after
  two warm-up steps).

Returns ``{"layer": {config: bench_layer result (rows of both kinds)}, "decode": {config: {p50_us,
max_us, samples}}, "ratios": [...]}``; a ratio is batch-invariant p50 over plain p50 (the targets:
forward + backward ≤ 1.15, a decode step ≤ 1.5).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inductor_ext.bench import layer as layer_bench
from inductor_ext.bench import timing
from inductor_ext.bench.progress import Progress

__all__ = ["bench_invariance", "format_invariance", "CONFIG_NAMES", "PARTS"]

CONFIG_NAMES = ("serving_aligned", "batch_invariant")  # keys of inductor_ext.bench.layer.CONFIGS
PARTS = ("decode", *layer_bench.KINDS)  # the pieces, in their default order


def bench_invariance(tokens: int = 8192, samples: int = 20, progress=None, *, decode_seqs: int = 64,
                     decode_prompt: int = 128, decode_steps: int = 10, parts: tuple[str, ...] = PARTS,
                     on_partial: Callable[[dict], object] | None = None) -> dict:
    """See the module docstring. ``parts`` (of :data:`PARTS`, run in the given order): the decode
    steps (eager: no compile) and the layer kinds, each under both configs; ``on_partial`` is called
    with the result so far after each piece (a run cut short keeps what finished). Raises
    ``ValueError`` without CUDA or on bad arguments."""
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts or len(set(parts)) != len(parts):
        raise ValueError(f"bench invariance: parts must be distinct names of {PARTS}, got {tuple(parts)}")
    if not torch.cuda.is_available():
        raise ValueError("bench invariance needs a CUDA device")
    for name, value in (("decode_seqs", decode_seqs), ("decode_prompt", decode_prompt),
                        ("decode_steps", decode_steps)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"bench invariance: {name} must be an int >= 1, got {value!r}")
    layers, decode = {}, {}

    def result():
        return {"tokens": tokens, "samples": samples, "layer": layers, "decode": decode,
                "decode_shape": {"seqs": decode_seqs, "prompt": decode_prompt, "steps": decode_steps},
                "ratios": _ratios(layers, decode)}

    def piece_done():
        if on_partial is not None:
            on_partial(result())

    for kind in parts:
        if kind == "decode":
            with Progress(progress, total=len(CONFIG_NAMES), desc="bench invariance: decode") as prog:
                for name in CONFIG_NAMES:
                    prog.step(f"decode step, {name}")
                    decode[name] = _decode_step(layer_bench.CONFIGS[name], decode_seqs, decode_prompt, decode_steps)
                    torch.cuda.empty_cache()
                    piece_done()
            continue
        for name in CONFIG_NAMES:
            part = layer_bench.bench_layer(tokens, kinds=(kind,), samples=samples, progress=progress,
                                           precision=name, timing_only=True)
            if name in layers:
                layers[name]["rows"] += part["rows"]
            else:
                layers[name] = part
            piece_done()
    return result()


@torch.no_grad()
def _decode_step(config, seqs: int, prompt: int, steps: int) -> dict:
    from graphs.decode import ServingDecoder
    from graphs.serving import ServingForward
    from inductor_ext.bench.inputs import build_model, make_prompts

    model = build_model(0, "h200_stack", "cuda")
    decoder = ServingDecoder(ServingForward(model, config))
    logits, cache = decoder.prefill(make_prompts(model.config.vocab_size, seqs, prompt, 0, "cuda"))
    step, times = decoder.step, []
    for i in range(steps + 2):
        tokens = logits.argmax(-1)
        (logits, _), us = timing.timed(lambda tokens=tokens: step(tokens, cache))  # cache: updated in place
        if i >= 2:
            times.append(us)
    return timing.summarize(times)


def _ratios(layers: dict, decode: dict) -> list[dict]:
    """Batch-invariant over plain p50 for each (kind, variant) and the decode step measured under
    both configs so far."""
    plain, invariant = ({(r["kind"], r["variant"]): r for r in layers.get(n, {}).get("rows", [])}
                        for n in CONFIG_NAMES)
    pairs = [(f"{k} {v}", plain[k, v], invariant[k, v]) for k, v in plain if (k, v) in invariant]
    if all(n in decode for n in CONFIG_NAMES):
        pairs.append(("decode step", *(decode[n] for n in CONFIG_NAMES)))
    return [{"what": what, "plain_p50_us": a["p50_us"], "batch_invariant_p50_us": b["p50_us"],
             "ratio": b["p50_us"] / a["p50_us"]}
            for what, a, b in pairs if "p50_us" in a and "p50_us" in b]


def format_invariance(result: dict) -> str:
    """Markdown: one row per layer variant and the decode step (p50 µs plain, batch-invariant, ratio)."""
    lines = ["| what | plain p50 (µs) | batch-invariant p50 (µs) | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['plain_p50_us']:.1f} | {r['batch_invariant_p50_us']:.1f} | {r['ratio']:.3f} |"
              for r in result["ratios"]]
    return "\n".join(lines)
