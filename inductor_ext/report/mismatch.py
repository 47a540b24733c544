"""Fixed-token training/serving mismatch-KL ablation over :class:`PrecisionConfig` arms.

Protocol (reduced model from ``graphs/``: ``tiny`` on the CPU, ``h200_stack`` on CUDA):

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
   ``fullgraph=True``; backend ``aot_eager`` by default) under each arm's config, one sequence
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
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import torch

from graphs import GLM53Config, GLM53Model
from graphs.decode import ServingDecoder
from graphs.serving import SERVING_PRECISION, ServingForward
from inductor_ext.config import PrecisionConfig, precision

__all__ = ["MismatchSettings", "PRESETS", "path_fields", "default_arms", "stack_config", "build_model", "make_prompts",
           "calibrate", "rollout", "score", "run_mismatch", "format_table", "write_json"]

COMPILE_BACKENDS = ("aot_eager", "inductor", "eager", "none")
PRESETS = ("tiny", "h200_stack")  # h200_stack: 3 KDA + 1 DSA layers at h200 widths, CUDA only (see stack_config)
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
    compile: str = "aot_eager"  # training-model torch.compile backend; "none" = eager

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"mismatch: preset must be one of {PRESETS}, got {self.preset!r}")
        if self.device not in DEVICES:
            raise ValueError(f"mismatch: device must be one of {DEVICES}, got {self.device!r}")
        if self.preset == "h200_stack" and self.device != "cuda":
            raise ValueError("mismatch: the h200_stack preset needs --device cuda (a GPU machine); use tiny on CPU")
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


def stack_config():
    """The ``h200_stack`` preset: ``h200`` widths, 3 KDA layers + 1 DSA layer (the first MLP dense,
    the others MoE with 32 routed experts, top-8), FlexAttention for the sparse attention."""
    return GLM53Config.h200(
        num_hidden_layers=4, layer_types=("linear_attention",) * 3 + ("indexed_attention",),
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"), indexer_types=("full",) * 4,
        n_routed_experts=32, attn_impl="flex")


def build_model(seed: int = 0, preset: str = "tiny", device: str = "cpu"):
    """The reduced GLM-5.3 model (``tiny`` or ``h200_stack``) with seeded random weights (drawn on
    the CPU, so every device gets the same ones), BF16 (the training dtype), eval mode, on ``device``,
    ``precision=None`` (each arm selects its config with :func:`inductor_ext.precision`)."""
    if preset not in PRESETS:
        raise ValueError(f"mismatch: preset must be one of {PRESETS}, got {preset!r}")
    cfg = GLM53Config.tiny() if preset == "tiny" else stack_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GLM53Model(cfg)
    return model.to_dtype(torch.bfloat16).to(device).eval().requires_grad_(False)


def make_prompts(vocab_size: int, num_seqs: int, prompt_len: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Seeded uniform random prompts (drawn on the CPU), int64 ``[num_seqs, prompt_len]`` on ``device``."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, vocab_size, (num_seqs, prompt_len), generator=gen, dtype=torch.int64).to(device)


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


@torch.no_grad()
def rollout(serve, prompts: torch.Tensor, new_tokens: int, seed: int,
            progress=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``new_tokens`` tokens per prompt from ``serve`` (temperature 1, seeded generator):
    one prefill of the packed prompts, then one incremental decode step (one token per sequence,
    :class:`graphs.decode.ServingDecoder` with KDA-state / conv-window / MLA / indexer caches) per
    sampled token. On CPU its logits are bitwise the last-position logits of a full re-forward of the packed
    sequences (``tests/test_decode.py``), so the samples are those of a full re-forward rollout.

    Returns ``(sequences int64 [n, prompt_len + new_tokens] on the prompts' device, serving log-probs
    FP32 [n, new_tokens, V] on the CPU)``: the log-softmax each sampling step drew from, kept in host
    memory (64 × 1024 tokens at the h200 vocabulary are 40 GB)."""
    # a generator on the prompts' device (same seed and device -> same samples): on the H200, host-side
    # sampling plus the copy took 377 ms a step at 64 x 154880 logits
    gen = torch.Generator(device=prompts.device).manual_seed(seed + 2)
    seqs, logps = prompts.clone(), None
    decoder = ServingDecoder(serve)
    logits, cache = decoder.prefill(prompts)
    for i in range(new_tokens):
        logp = torch.log_softmax(logits.float(), dim=-1)
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


@torch.no_grad()
def score(logits_of, serve_logp: torch.Tensor, seqs: torch.Tensor, prompt_len: int) -> dict:
    """Mismatch of teacher-forced logits against the serving log-probs ``[n, R, V]`` of the sampled
    response tokens ``seqs[:, prompt_len:]``. ``logits_of(i)``: the logits ``[L, V]`` of sequence
    ``i`` (a document of its own). One sequence at a time, so the logits and the FP32 temporaries
    stay ``[L, V]`` (at the h200 vocabulary ``[n, L, V]`` is tens of GB)."""
    R = serve_logp.shape[1]
    rs, kls = [], []
    for i in range(seqs.shape[0]):
        logp_train = torch.log_softmax(logits_of(i)[prompt_len - 1: prompt_len - 1 + R].float(), dim=-1)
        logp_serve = serve_logp[i].to(logp_train.device)
        y = seqs[i, prompt_len: prompt_len + R].unsqueeze(-1)
        rs.append((logp_train.gather(-1, y) - logp_serve.gather(-1, y)).squeeze(-1).double())
        kls.append((logp_serve.exp() * (logp_serve - logp_train)).sum(-1))
    r, kl = torch.cat(rs), torch.cat(kls)
    k3 = torch.expm1(r) - r
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
    s = MismatchSettings() if settings is None else settings
    arms = default_arms() if arms is None else arms
    say = progress or (lambda msg: None)
    if s.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("mismatch: --device cuda but no CUDA device is visible")
    model = build_model(s.seed, s.preset, s.device)
    serve = ServingForward(model, serving_precision)
    prompts = make_prompts(model.config.vocab_size, s.num_seqs, s.prompt_len, s.seed, s.device)
    say(f"calibrating lm_head to {s.target_entropy} nats")
    scale, entropy = calibrate(model, prompts, s.target_entropy, serve)
    say(f"sampling {s.new_tokens} tokens x {s.num_seqs} sequences from the serving forward")
    seqs, serve_logp = rollout(serve, prompts, s.new_tokens, s.seed, progress=progress)
    resp_entropy = torch.cat([_entropy_of_logp(lp.to(s.device)) for lp in serve_logp]).mean().item()
    one_doc = torch.tensor([0, seqs.shape[1]], dtype=torch.int64, device=seqs.device)
    say("serving re-forward of the sampled sequences (the floor)")
    floor = score(lambda i: serve(seqs[i], one_doc), serve_logp, seqs, s.prompt_len)
    say(f"floor: k3 {floor['k3']:.4e}, mean |r| {floor['mean_abs_logratio']:.4e}")
    out_arms = {}
    for name, cfg in arms.items():
        say(f"teacher-forcing arm {name} ({s.compile})")
        torch._dynamo.reset()
        fwd = _train_forward(model, s.compile)
        with torch.no_grad(), precision(cfg):
            metrics = score(lambda i, fwd=fwd: fwd(seqs[i], one_doc), serve_logp, seqs, s.prompt_len)
        out_arms[name] = {**metrics, "precision": _fields(cfg)}
        say(f"arm {name}: k3 {metrics['k3']:.4e}, mean |r| {metrics['mean_abs_logratio']:.4e}, "
            f"max token KL {metrics['max_token_kl']:.4e}, mean token KL {metrics['mean_token_kl']:.4e}")
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
        "serving_reforward": floor,
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
    f = result.get("serving_reforward")
    if f is not None:
        lines.append(f"| (floor: serving re-forward vs its decode) | {f['k3']:.3e} | {f['mean_abs_logratio']:.3e} | "
                     f"{f['max_token_kl']:.3e} | {f['mean_token_kl']:.3e} | |")
    return "\n".join(lines)


def write_json(result: dict, out: pathlib.Path) -> pathlib.Path:
    """Write ``result`` to ``out/mismatch.json`` (creating ``out``); returns the path."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mismatch.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False))
    return path
