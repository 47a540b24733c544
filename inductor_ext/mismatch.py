"""Fixed-token training/serving mismatch-KL ablation over :class:`PrecisionConfig` arms.

Protocol (CPU, reduced model from ``graphs/``):

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
   ``fullgraph=True``; backend ``aot_eager`` by default) under each arm's config. Per arm, over all
   response tokens: ``k3 = mean(exp(r) − 1 − r)`` with ``r = log p_train(y) − log p_serve(y)`` of the
   sampled token y (an unbiased estimator of KL(serve ‖ train)), ``mean |r|``, and the max (and mean)
   exact per-token KL(serve ‖ train) over the vocabulary.

Arms: ``reference``, one per precision path whose :meth:`PrecisionConfig.serving_aligned` value
differs from :meth:`PrecisionConfig.reference` (that single path switched), and ``serving_aligned``.
Same seed → bitwise the same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import torch

from inductor_ext.config import PrecisionConfig, precision

__all__ = ["MismatchSettings", "path_fields", "default_arms", "build_model", "make_prompts", "calibrate",
           "rollout", "score", "run_mismatch", "format_table", "write_json"]

COMPILE_BACKENDS = ("aot_eager", "inductor", "eager", "none")


@dataclasses.dataclass(frozen=True)
class MismatchSettings:
    """Knobs of one ablation run (the defaults are the CLI's)."""

    preset: str = "tiny"
    seed: int = 0
    num_seqs: int = 4
    prompt_len: int = 16
    new_tokens: int = 32
    target_entropy: float = 2.0  # nats, mean next-token entropy of the serving forward on the prompts
    compile: str = "aot_eager"  # training-model torch.compile backend; "none" = eager

    def __post_init__(self) -> None:
        if self.preset != "tiny":
            raise ValueError(f"mismatch: only the 'tiny' preset runs on CPU, got {self.preset!r}")
        if self.compile not in COMPILE_BACKENDS:
            raise ValueError(f"mismatch: compile must be one of {COMPILE_BACKENDS}, got {self.compile!r}")
        for name in ("num_seqs", "prompt_len", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"mismatch: {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.target_entropy:
            raise ValueError(f"mismatch: target_entropy must be > 0, got {self.target_entropy}")


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


def build_model(seed: int = 0, preset: str = "tiny"):
    """The reduced GLM-5.3 model with seeded random weights, BF16 (the training dtype), eval mode,
    ``precision=None`` (each arm selects its config with :func:`inductor_ext.precision`)."""
    from graphs import GLM53Config, GLM53Model

    if preset != "tiny":
        raise ValueError(f"mismatch: only the 'tiny' preset runs on CPU, got {preset!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GLM53Model(GLM53Config.tiny())
    return model.to_dtype(torch.bfloat16).eval().requires_grad_(False)


def make_prompts(vocab_size: int, num_seqs: int, prompt_len: int, seed: int) -> torch.Tensor:
    """Seeded uniform random prompts, int64 ``[num_seqs, prompt_len]``."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab_size, (num_seqs, prompt_len), generator=gen, dtype=torch.int64)


def _packed(seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, length = seqs.shape
    return seqs.reshape(-1), torch.arange(n + 1, dtype=torch.int64) * length


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def calibrate(model, prompts: torch.Tensor, target_entropy: float, serve=None) -> tuple[float, float]:
    """Scale ``model.lm_head.weight`` in place so the serving forward's mean next-token entropy on
    ``prompts`` is ``target_entropy`` nats. Bisection (log scale) on FP32 logits of the serving hidden
    states; returns ``(scale, entropy measured after the BF16 weight update)``."""
    from graphs.serving import ServingForward

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


@torch.no_grad()
def rollout(serve, prompts: torch.Tensor, new_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``new_tokens`` tokens per prompt from ``serve`` (temperature 1, seeded generator):
    one prefill of the packed prompts, then one incremental decode step (one token per sequence,
    :class:`graphs.decode.ServingDecoder` with KDA-state / conv-window / MLA / indexer caches) per
    sampled token. On CPU its logits are bitwise the last-position logits of a full re-forward of the packed
    sequences (``tests/test_decode.py``), so the samples are those of a full re-forward rollout.

    Returns ``(sequences int64 [n, prompt_len + new_tokens], serving log-probs FP32 [n, new_tokens, V])``:
    the log-softmax each sampling step drew from."""
    from graphs.decode import ServingDecoder

    gen = torch.Generator().manual_seed(seed + 2)
    seqs, logps = prompts.clone(), []
    decoder = ServingDecoder(serve)
    logits, cache = decoder.prefill(prompts)
    for i in range(new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        seqs = torch.cat([seqs, tok], dim=1)
        logps.append(logp)
        if i + 1 < new_tokens:
            logits, cache = decoder.step(tok[:, 0], cache)
    return seqs, torch.stack(logps, dim=1)


@torch.no_grad()
def score(train_logits: torch.Tensor, serve_logp: torch.Tensor, seqs: torch.Tensor, prompt_len: int) -> dict:
    """Mismatch of teacher-forced training logits ``[n, L, V]`` against the serving log-probs
    ``[n, R, V]`` of the sampled response tokens ``seqs[:, prompt_len:]``."""
    R = serve_logp.shape[1]
    logp_train = torch.log_softmax(train_logits.float()[:, prompt_len - 1: prompt_len - 1 + R], dim=-1)
    y = seqs[:, prompt_len: prompt_len + R].unsqueeze(-1)
    r = (logp_train.gather(-1, y) - serve_logp.gather(-1, y)).squeeze(-1).double()
    k3 = torch.expm1(r) - r
    kl = (serve_logp.exp() * (serve_logp - logp_train)).sum(-1)
    return {"k3": k3.mean().item(), "mean_abs_logratio": r.abs().mean().item(),
            "max_token_kl": kl.max().item(), "mean_token_kl": kl.double().mean().item()}


def _train_forward(model, backend: str):
    if backend == "none":
        return model
    return torch.compile(model, backend=backend, fullgraph=True)


def run_mismatch(settings: MismatchSettings | None = None, arms: dict[str, PrecisionConfig] | None = None,
                 serving_precision: PrecisionConfig | None = None, progress=None) -> dict:
    """Run the ablation; returns the ``mismatch.json`` dict (see the module doc).

    ``arms``: name → training config (default :func:`default_arms`). ``serving_precision``: the
    serving forward's choices (default ``PrecisionConfig.serving_aligned()``; a different value
    builds a deliberately mis-aligned serving engine, for testing that the metric responds)."""
    from graphs.serving import SERVING_PRECISION, ServingForward

    s = MismatchSettings() if settings is None else settings
    arms = default_arms() if arms is None else arms
    say = progress or (lambda msg: None)
    model = build_model(s.seed, s.preset)
    serve = ServingForward(model, serving_precision)
    prompts = make_prompts(model.config.vocab_size, s.num_seqs, s.prompt_len, s.seed)
    say(f"calibrating lm_head to {s.target_entropy} nats")
    scale, entropy = calibrate(model, prompts, s.target_entropy, serve)
    say(f"sampling {s.new_tokens} tokens x {s.num_seqs} sequences from the serving forward")
    seqs, serve_logp = rollout(serve, prompts, s.new_tokens, s.seed)
    resp_entropy = (-(serve_logp.exp() * serve_logp).sum(-1)).mean().item()
    ids, cu = _packed(seqs)
    out_arms = {}
    for name, cfg in arms.items():
        say(f"teacher-forcing arm {name} ({s.compile})")
        torch._dynamo.reset()
        fwd = _train_forward(model, s.compile)
        with torch.no_grad(), precision(cfg):
            logits = fwd(ids, cu).view(seqs.shape[0], seqs.shape[1], -1)
        out_arms[name] = {**score(logits, serve_logp, seqs, s.prompt_len), "precision": _fields(cfg)}
    torch._dynamo.reset()
    if "reference" in out_arms:
        base = out_arms["reference"]["k3"]
        for entry in out_arms.values():
            entry["k3_reduction_vs_reference"] = (base - entry["k3"]) / base if base > 0 else 0.0
    return {
        "settings": dataclasses.asdict(s),
        "serving_precision": _fields(SERVING_PRECISION if serving_precision is None else serving_precision),
        "serving_kda": "kda_recurrent (FP32 state)",
        "lm_head_scale": scale,
        "entropy": {"prompt_mean_nats": entropy, "response_mean_nats": resp_entropy},
        "num_response_tokens": int(seqs.shape[0] * s.new_tokens),
        "arms": out_arms,
    }


def _fields(cfg: PrecisionConfig) -> dict:
    return dataclasses.asdict(cfg)


def format_table(result: dict) -> str:
    """Markdown table of the arms (k3, mean |r|, max/mean token KL, k3 reduction vs reference) with
    the calibration entropy."""
    e = result["entropy"]
    s = result["settings"]
    lines = [
        f"Mismatch KL (serving rollout, teacher-forced training model, compile={s['compile']}; "
        f"{s['num_seqs']} seqs x {s['new_tokens']} response tokens, prompt {s['prompt_len']}, seed {s['seed']})",
        f"calibrated lm_head x{result['lm_head_scale']:.4g}: mean next-token entropy {e['prompt_mean_nats']:.3f} nats "
        f"on prompts, {e['response_mean_nats']:.3f} nats on responses",
        "",
        "| arm | k3 | mean abs log-ratio | max token KL | mean token KL | k3 reduction vs reference |",
        "|---|---|---|---|---|---|",
    ]
    for name, a in result["arms"].items():
        red = a.get("k3_reduction_vs_reference")
        red_s = "" if red is None or name == "reference" else f"{100 * red:+.1f}%"
        lines.append(f"| {name} | {a['k3']:.3e} | {a['mean_abs_logratio']:.3e} | {a['max_token_kl']:.3e} | "
                     f"{a['mean_token_kl']:.3e} | {red_s} |")
    return "\n".join(lines)


def write_json(result: dict, out: pathlib.Path) -> pathlib.Path:
    """Write ``result`` to ``out/mismatch.json`` (creating ``out``); returns the path."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mismatch.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False))
    return path
