"""Fixed-token training/serving mismatch-KL ablation over :class:`PrecisionConfig` arms.

Protocol (reduced model from ``graphs/``, :func:`inductor_ext.bench.inputs.build_model`: ``tiny`` on
the CPU, ``h200_stack`` on CUDA):

1. Build the model (random weights, seeded) in BF16 and *calibrate* it: random weights give nearly
   uniform next-token distributions, which hide mismatch, so the lm_head weight is scaled until the
   mean next-token entropy of the serving forward on the prompts hits ``target_entropy`` nats
   (a trained model's 1–3 nats).
2. Roll out: sample ``new_tokens`` response tokens per prompt from the serving-numerics forward
   (:class:`graphs.serving.ServingForward`: recurrent FP32 KDA, FP8 indexer, FP32 mHC post, serving
   SwiGLU, FP8 ue8m0 MoE activations, FP32 indexer head projection), seeded, temperature 1, decoded
   incrementally with caches (:class:`graphs.decode.ServingDecoder`, one token per sequence per
   step; on CPU bitwise the logits of a full re-forward of the packed sequences). The serving
   log-probabilities are the ones each sampling step saw.
3. Teacher-force the same tokens through the compiled training model (``torch.compile``,
   ``fullgraph=True``; backend ``inductor`` with ``inductor_ext.enable()`` by default, the backend users
   run) under each arm's config, one sequence
   per call (one compile per arm: every sequence has the same length). Per arm, over all
   response tokens: ``k3 = mean(exp(r) − 1 − r)`` with ``r = log p_train(y) − log p_serve(y)`` of the
   sampled token y (an unbiased estimator of KL(serve ‖ train)), ``mean |r|``, and the max (and mean)
   exact per-token KL(serve ‖ train) over the vocabulary.

Floor: the serving forward itself, re-run over each whole sequence (as teacher forcing runs the
training model) and scored like an arm against the decode's log-probabilities (``serving_reforward``).
On the CPU the decode is bitwise the re-forward, so it is 0; on a GPU, GEMMs pick kernels by batch
shape, so one decode row and the same row inside a full-sequence forward differ in the last bits, and a
calibrated model turns that into a measurable k3: mismatch no precision setting of the training
model can remove.

Arms: ``reference``, one per precision path whose :meth:`PrecisionConfig.serving_aligned` value
differs from :meth:`PrecisionConfig.reference` (that single path switched), and ``serving_aligned``.
Same seed → bitwise the same numbers.

Metrics (:func:`logratio_metrics`; the keys of every ``arms[name]`` entry and of ``serving_reforward``),
in float64 from the per-token ``r`` over all ``num_response_tokens`` response tokens:

- ``k3``: ``mean(expm1(r) − r)``.
- ``mean_abs_logratio``, ``median_abs_logratio``, ``p99_abs_logratio``, ``max_abs_logratio``: mean,
  median, 99th percentile and max of ``|r|``; percentiles interpolate linearly between the closest
  ranks (position ``q·(n − 1)`` of the ascending ``|r|``: numpy's and ``torch.quantile``'s default).
- ``frac_abs_logratio_gt_ln2``: the fraction of tokens with ``|r| > ln 2`` (probability ratio
  outside [½, 2]: the tail that dominates k3).
- ``num_nonzero_logratio``: the number of tokens with ``r != 0`` exactly (int; true on-policy:
  each of them needs an explanation).
- ``max_token_kl``, ``mean_token_kl``: the exact per-token KL(serve ‖ train) over the vocabulary
  (FP32 per token; the mean accumulated in float64).

Arm entries add ``precision`` (the arm's :class:`PrecisionConfig` fields) and, when a ``reference``
arm ran, ``k3_reduction_vs_reference`` = ``(k3_ref − k3) / k3_ref``.

Batch-invariant mode (``MismatchSettings.batch_invariant``, ``--batch-invariant``; "true on-policy",
``docs/DESIGN.md`` §9): every arm's config and the serving precision get ``batch_invariant=True``
(:func:`batch_invariant_config`), and the vocabulary log-softmax, both in the rollout's sampling
step and in :func:`score`'s teacher-forced log-probs, is ``glm53::bi_log_softmax`` (FP32, a
batch-invariant row kernel) instead of ``torch.log_softmax`` (:func:`log_probs`). ``batch_invariant``
needs ``mla="absorbed"`` (:class:`PrecisionConfig` refuses the decompressed form), so every arm
takes the absorbed form (:data:`BATCH_INVARIANT_OVERRIDES`); an arm that thereby equals an earlier
one (``mla`` equals ``reference``) is left out, its name recorded in ``arms_left_out``.

``mismatch.json`` top level: ``settings`` (:class:`MismatchSettings` fields, ``batch_invariant``
among them), ``log_softmax`` (``"torch.log_softmax"`` or ``"glm53::bi_log_softmax"``),
``batch_invariant_overrides`` (the fields set on every config besides ``batch_invariant``; ``{}``
without it), ``arms_left_out`` (left-out arm → the arm it equals; ``{}`` without it),
``serving_precision``, ``serving_kda``, ``lm_head_scale``, ``entropy`` (``prompt_mean_nats``,
``response_mean_nats``), ``num_response_tokens``, ``serving_reforward`` (the floor's metrics),
``arms``. The CLI writes ``mismatch.json``, ``mismatch.md`` (:func:`format_markdown`) and
``mismatch.png`` (needs matplotlib, the ``report`` extra) under ``--out``
(:func:`inductor_ext.report.report.write_mismatch`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import torch

import inductor_ext
from graphs.decode import ServingDecoder
from graphs.serving import SERVING_PRECISION, ServingForward
from inductor_ext import ops
from inductor_ext import validation as v
from inductor_ext.bench.inputs import MODEL_PRESETS, build_model, make_prompts
from inductor_ext.config import PrecisionConfig, precision

__all__ = ["MismatchSettings", "BATCH_INVARIANT_OVERRIDES", "path_fields", "default_arms", "batch_invariant_config",
           "calibrate", "log_probs", "rollout", "logratio_metrics", "score", "run_mismatch", "format_title",
           "format_table", "format_markdown", "write_json"]

LN2 = math.log(2.0)
# the fields batch_invariant=True needs (PrecisionConfig refuses mla="decompressed" with it)
BATCH_INVARIANT_OVERRIDES = {"mla": "absorbed"}

COMPILE_BACKENDS = ("aot_eager", "inductor", "eager", "none")
DEVICES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class MismatchSettings:
    """Knobs of one ablation run (the defaults are the CLI's)."""

    preset: str = "tiny"
    device: str = "cpu"
    seed: int = 0
    num_seqs: int = 4
    prompt_len: int = 16
    new_tokens: int = 32
    target_entropy: float = 2.0  # nats, mean next-token entropy of the serving forward on the prompts
    compile: str = "inductor"  # training-model torch.compile backend (with the plugin enabled); "none" = eager
    batch_invariant: bool = False  # every config batch_invariant=True, glm53::bi_log_softmax (module doc)

    def __post_init__(self) -> None:
        v.check_fields(self, "mismatch: ", _SETTINGS_RULES)
        if self.preset == "h200_stack" and self.device != "cuda":
            raise ValueError("mismatch: the h200_stack preset needs --device cuda (a GPU machine); use tiny on CPU")
        # an entropy over V tokens is below ln V (uniform): a larger target cannot be calibrated to
        top = math.log(MODEL_PRESETS[self.preset]().vocab_size)
        if not self.target_entropy < top:
            raise ValueError(f"mismatch: target_entropy must be < ln(vocab_size) = {top:.4g} nats for the "
                             f"{self.preset} preset, got {self.target_entropy}")


# every MismatchSettings field's rule (inductor_ext.validation); the seed: non-negative, seed + 2 (the
# rollout's generator) inside torch.manual_seed's range
_SETTINGS_RULES = {"preset": v.one_of(MODEL_PRESETS), "device": v.one_of(DEVICES), "seed": v.integer(0, 2**64 - 3),
                   "num_seqs": v.integer(1), "prompt_len": v.integer(1), "new_tokens": v.integer(1),
                   "target_entropy": v.real(gt=0), "compile": v.one_of(COMPILE_BACKENDS),
                   "batch_invariant": v.boolean()}


def path_fields() -> tuple[str, ...]:
    """The PrecisionConfig fields whose serving-aligned value differs from the reference one."""
    ref, srv = PrecisionConfig.reference(), PrecisionConfig.serving_aligned()
    return tuple(f.name for f in dataclasses.fields(PrecisionConfig) if getattr(ref, f.name) != getattr(srv, f.name))


def default_arms() -> dict[str, PrecisionConfig]:
    """``reference``, each single path switched to its serving-aligned value, ``serving_aligned``."""
    ref, srv = PrecisionConfig.reference(), PrecisionConfig.serving_aligned()
    arms = {"reference": ref}
    for name in path_fields():
        arms[name] = ref.replace(**{name: getattr(srv, name)})
    arms["serving_aligned"] = srv
    return arms


def batch_invariant_config(cfg: PrecisionConfig) -> PrecisionConfig:
    """``cfg`` with ``batch_invariant=True`` and :data:`BATCH_INVARIANT_OVERRIDES`."""
    return cfg.replace(batch_invariant=True, **BATCH_INVARIANT_OVERRIDES)


def _packed(seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, length = seqs.shape
    return seqs.reshape(-1), torch.arange(n + 1, dtype=torch.int64, device=seqs.device) * length


def _entropy_of_logp(logp: torch.Tensor) -> torch.Tensor:
    return -(logp.exp() * logp).sum(-1)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    return _entropy_of_logp(torch.log_softmax(logits.float(), dim=-1))


@torch.no_grad()
def calibrate(model, prompts: torch.Tensor, target_entropy: float, serve=None) -> tuple[float, float]:
    """Scale ``model.lm_head.weight`` in place so the serving forward's mean next-token entropy on
    ``prompts`` is ``target_entropy`` nats. Bisection (log scale) on FP32 logits of the serving hidden
    states; returns ``(scale, entropy measured after the BF16 weight update)``."""
    serve = ServingForward(model) if serve is None else serve
    ids, cu = _packed(prompts)
    hidden = serve.hidden(ids, cu).float()
    logits = hidden @ model.lm_head.weight.float().t()
    lo, hi = math.log(1e-3), math.log(1e4)  # entropy decreases with the scale
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _entropy(logits * math.exp(mid)).mean().item() > target_entropy:
            lo = mid
        else:
            hi = mid
    scale = math.exp(0.5 * (lo + hi))
    w = model.lm_head.weight
    w.data = (w.data.float() * scale).to(w.dtype)
    return scale, _entropy(serve(ids, cu)).mean().item()


def log_probs(logits: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
    """FP32 log-softmax over the vocabulary (last dim): ``torch.log_softmax(logits.float())``, or
    with ``batch_invariant`` ``glm53::bi_log_softmax`` (each row bitwise independent of the others)."""
    if batch_invariant:
        return ops.bi_log_softmax(logits)
    return torch.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def rollout(serve, prompts: torch.Tensor, new_tokens: int, seed: int,
            progress=None, batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``new_tokens`` tokens per prompt from ``serve`` (temperature 1, seeded generator):
    one prefill of the packed prompts, then one incremental decode step (one token per sequence,
    :class:`graphs.decode.ServingDecoder` with KDA-state / conv-window / MLA / indexer caches) per
    sampled token. On CPU its logits are bitwise the last-position logits of a full re-forward of the packed
    sequences (``tests/test_decode.py``), so the samples are those of a full re-forward rollout.

    Returns ``(sequences int64 [n, prompt_len + new_tokens] on the prompts' device, serving log-probs
    FP32 [n, new_tokens, V] on the CPU)``: the log-softmax each sampling step drew from, kept in host
    memory (64 × 1024 tokens at the h200 vocabulary are 40 GB). ``batch_invariant``: the log-softmax
    is ``glm53::bi_log_softmax`` (:func:`log_probs`)."""
    # a generator on the prompts' device (same seed and device -> same samples): on the H200, host-side
    # sampling plus the copy took 377 ms a step at 64 x 154880 logits
    gen = torch.Generator(device=prompts.device).manual_seed(seed + 2)
    seqs, logps = prompts.clone(), None
    decoder = ServingDecoder(serve)
    logits, cache = decoder.prefill(prompts)
    for i in range(new_tokens):
        logp = log_probs(logits, batch_invariant)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        if logps is None:
            logps = torch.empty(logp.shape[0], new_tokens, logp.shape[1], dtype=logp.dtype)
        logps[:, i] = logp.cpu()
        seqs = torch.cat([seqs, tok], dim=1)
        if i + 1 < new_tokens:
            logits, cache = decoder.step(tok[:, 0], cache)
        if progress and (i + 1) % 128 == 0:
            progress(f"sampled {i + 1} / {new_tokens} tokens")
    return seqs, logps


def _quantile(ascending: torch.Tensor, q: float) -> float:
    """The ``q`` quantile of the ascending 1-D ``ascending``: linear interpolation at position ``q·(n − 1)``."""
    pos = q * (ascending.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, ascending.numel() - 1)
    a, b = ascending[lo].item(), ascending[hi].item()
    return a + (b - a) * (pos - lo)


def logratio_metrics(r: torch.Tensor, kl: torch.Tensor) -> dict:
    """The metrics of the module doc from the per-token log-ratios ``r`` (``log p_train(y) − log
    p_serve(y)``) and the per-token KL(serve ‖ train) ``kl`` (same length, any float dtype; ``r``
    is promoted to float64)."""
    r, kl = r.double().reshape(-1), kl.reshape(-1)
    if r.numel() == 0 or r.numel() != kl.numel():
        raise ValueError(f"mismatch: r and kl need the same number (>= 1) of tokens, got {r.numel()} and {kl.numel()}")
    a = r.abs()
    ascending = a.sort().values
    k3 = torch.expm1(r) - r
    return {"k3": k3.mean().item(), "mean_abs_logratio": a.mean().item(),
            "median_abs_logratio": _quantile(ascending, 0.5), "p99_abs_logratio": _quantile(ascending, 0.99),
            "max_abs_logratio": ascending[-1].item(),
            "frac_abs_logratio_gt_ln2": (a > LN2).double().mean().item(),
            "num_nonzero_logratio": int((r != 0).sum().item()),
            "max_token_kl": kl.max().item(), "mean_token_kl": kl.double().mean().item()}


@torch.no_grad()
def score(logits_of, serve_logp: torch.Tensor, seqs: torch.Tensor, prompt_len: int,
          batch_invariant: bool = False) -> dict:
    """Mismatch of teacher-forced logits against the serving log-probs ``[n, R, V]`` of the sampled
    response tokens ``seqs[:, prompt_len:]`` (:func:`logratio_metrics`). ``logits_of(i)``: the logits
    ``[L, V]`` of sequence ``i`` (a document of its own). One sequence at a time, so the logits and
    the FP32 temporaries stay ``[L, V]`` (at the h200 vocabulary ``[n, L, V]`` is tens of GB).
    ``batch_invariant``: the log-softmax is ``glm53::bi_log_softmax`` (:func:`log_probs`)."""
    R = serve_logp.shape[1]
    rs, kls = [], []
    for i in range(seqs.shape[0]):
        logp_train = log_probs(logits_of(i)[prompt_len - 1: prompt_len - 1 + R], batch_invariant)
        logp_serve = serve_logp[i].to(logp_train.device)
        y = seqs[i, prompt_len: prompt_len + R].unsqueeze(-1)
        rs.append((logp_train.gather(-1, y) - logp_serve.gather(-1, y)).squeeze(-1).double())
        kls.append((logp_serve.exp() * (logp_serve - logp_train)).sum(-1))
    return logratio_metrics(torch.cat(rs), torch.cat(kls))


def _train_forward(model, backend: str):
    if backend == "none":
        return model
    if backend == "inductor":
        inductor_ext.enable()  # the plugin as users run it: lowerings and the eager rounding points
    return torch.compile(model, backend=backend, fullgraph=True)


def run_mismatch(settings: MismatchSettings | None = None, arms: dict[str, PrecisionConfig] | None = None,
                 serving_precision: PrecisionConfig | None = None, progress=None) -> dict:
    """Run the ablation; returns the ``mismatch.json`` dict (see the module doc).

    ``arms``: name → training config (default :func:`default_arms`). ``serving_precision``: the
    serving forward's choices (default ``PrecisionConfig.serving_aligned()``; a different value
    builds a deliberately mis-aligned serving engine, for testing that the metric responds).
    ``settings.batch_invariant``: every arm's config and the serving precision go through
    :func:`batch_invariant_config` (arms that become equal to an earlier one are left out) and the
    log-softmax is ``glm53::bi_log_softmax``."""
    s = MismatchSettings() if settings is None else settings
    arms = default_arms() if arms is None else arms
    serving_precision = SERVING_PRECISION if serving_precision is None else serving_precision
    bi, left_out = s.batch_invariant, {}
    if bi:
        bi_arms = {}
        for name, cfg in arms.items():
            cfg = batch_invariant_config(cfg)
            same = next((other for other, c in bi_arms.items() if c == cfg), None)
            if same is None:
                bi_arms[name] = cfg
            else:
                left_out[name] = same
        arms = bi_arms
        serving_precision = batch_invariant_config(serving_precision)
    say = progress or (lambda msg: None)
    for name, same in left_out.items():
        say(f"arm {name} left out: batch-invariant, it is the config of arm {same}")
    if s.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("mismatch: --device cuda but no CUDA device is visible")
    model = build_model(s.seed, s.preset, s.device)
    serve = ServingForward(model, serving_precision)
    prompts = make_prompts(model.config.vocab_size, s.num_seqs, s.prompt_len, s.seed, s.device)
    say(f"calibrating lm_head to {s.target_entropy} nats")
    scale, entropy = calibrate(model, prompts, s.target_entropy, serve)
    say(f"sampling {s.new_tokens} tokens x {s.num_seqs} sequences from the serving forward"
        + (" (batch-invariant)" if bi else ""))
    seqs, serve_logp = rollout(serve, prompts, s.new_tokens, s.seed, progress=progress, batch_invariant=bi)
    resp_entropy = torch.cat([_entropy_of_logp(lp.to(s.device)) for lp in serve_logp]).mean().item()
    one_doc = torch.tensor([0, seqs.shape[1]], dtype=torch.int64, device=seqs.device)
    say("serving re-forward of the sampled sequences (the floor)")
    floor = score(lambda i: serve(seqs[i], one_doc), serve_logp, seqs, s.prompt_len, batch_invariant=bi)
    say(f"floor: {_summary(floor)}")
    out_arms = {}
    for name, cfg in arms.items():
        say(f"teacher-forcing arm {name} ({s.compile})")
        torch._dynamo.reset()
        fwd = _train_forward(model, s.compile)
        with torch.no_grad(), precision(cfg):
            metrics = score(lambda i, fwd=fwd: fwd(seqs[i], one_doc), serve_logp, seqs, s.prompt_len,
                            batch_invariant=bi)
        out_arms[name] = {**metrics, "precision": _fields(cfg)}
        say(f"arm {name}: {_summary(metrics)}")
    torch._dynamo.reset()
    if "reference" in out_arms:
        base = out_arms["reference"]["k3"]
        for entry in out_arms.values():
            entry["k3_reduction_vs_reference"] = (base - entry["k3"]) / base if base > 0 else 0.0
    return {
        "settings": dataclasses.asdict(s),
        "log_softmax": "glm53::bi_log_softmax" if bi else "torch.log_softmax",
        "batch_invariant_overrides": dict(BATCH_INVARIANT_OVERRIDES) if bi else {},
        "arms_left_out": left_out,
        "serving_precision": _fields(serving_precision),
        "serving_kda": "kda_recurrent (FP32 state)",
        "lm_head_scale": scale,
        "entropy": {"prompt_mean_nats": entropy, "response_mean_nats": resp_entropy},
        "num_response_tokens": int(seqs.shape[0] * s.new_tokens),
        "serving_reforward": floor,
        "arms": out_arms,
    }


def _summary(m: dict) -> str:
    return (f"k3 {m['k3']:.4e}, |r| mean {m['mean_abs_logratio']:.4e} median {m['median_abs_logratio']:.4e} "
            f"p99 {m['p99_abs_logratio']:.4e}, >ln2 {m['frac_abs_logratio_gt_ln2']:.2%}, "
            f"r!=0 {m['num_nonzero_logratio']}, max token KL {m['max_token_kl']:.4e}, "
            f"mean token KL {m['mean_token_kl']:.4e}")


def _fields(cfg: PrecisionConfig) -> dict:
    return dataclasses.asdict(cfg)


def format_title(result: dict) -> str:
    """One line: preset, device, compile backend and, when set, batch-invariant."""
    s = result["settings"]
    bi = ", batch-invariant" if s.get("batch_invariant") else ""
    return f"Train/serve mismatch KL ({s['preset']}, {s['device']}, compile={s['compile']}{bi})"


def _cells(m: dict, n_tokens: int) -> list[str]:
    return [f"{m['k3']:.3e}", f"{m['mean_abs_logratio']:.3e}", f"{m['median_abs_logratio']:.3e}",
            f"{m['p99_abs_logratio']:.3e}", f"{m['frac_abs_logratio_gt_ln2']:.2%}",
            f"{m['num_nonzero_logratio']} / {n_tokens}", f"{m['max_token_kl']:.3e}", f"{m['mean_token_kl']:.3e}"]


def format_table(result: dict) -> str:
    """Markdown table of the arms (k3, mean / median / p99 |r|, the fraction with |r| > ln 2, the
    tokens with r != 0, max/mean token KL, k3 reduction vs reference) and the floor row, with the
    calibration entropy."""
    e = result["entropy"]
    s = result["settings"]
    n = result["num_response_tokens"]
    bi = "batch-invariant kernels (glm53::bi_log_softmax), " if s.get("batch_invariant") else ""
    lines = [
        f"Mismatch KL (serving rollout, teacher-forced training model, {bi}compile={s['compile']}; "
        f"{s['num_seqs']} seqs x {s['new_tokens']} response tokens, prompt {s['prompt_len']}, seed {s['seed']})",
        f"calibrated lm_head x{result['lm_head_scale']:.4g}: mean next-token entropy {e['prompt_mean_nats']:.3f} nats "
        f"on prompts, {e['response_mean_nats']:.3f} nats on responses",
        "",
        "| arm | k3 | mean abs r | median abs r | p99 abs r | frac abs r > ln 2 | tokens r != 0 | max token KL "
        "| mean token KL | k3 reduction vs reference |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in result["arms"].items():
        red = a.get("k3_reduction_vs_reference")
        red_s = "" if red is None or name == "reference" else f"{100 * red:+.1f}%"
        lines.append(f"| {name} | " + " | ".join(_cells(a, n)) + f" | {red_s} |")
    f = result.get("serving_reforward")
    if f is not None:
        lines.append("| (floor: serving re-forward vs its decode) | " + " | ".join(_cells(f, n)) + " | |")
    return "\n".join(lines)


def format_markdown(result: dict, png: str | None = None) -> str:
    """``mismatch.md``: a title (preset, device, compile backend, batch-invariant or not), the table
    of :func:`format_table` and, given ``png`` (a file name next to it), the plot."""
    lines = [f"# {format_title(result)}", "", format_table(result)]
    if png is not None:
        lines += ["", f"![k3 and |r| percentiles per arm]({png})"]
    return "\n".join(lines) + "\n"


def write_json(result: dict, out: pathlib.Path) -> pathlib.Path:
    """Write ``result`` to ``out/mismatch.json`` (creating ``out``); returns the path."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mismatch.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False))
    return path
