"""The ``h200`` KDA and DSA decoder layers under ``torch.compile(mode="reduce-overhead")`` on CUDA:
one graph (``fullgraph=True``, zero graph breaks), captured by cudagraph trees with skips turned
into errors (``triton.cudagraph_or_error``; the skip counter must stay 0), no recompile on replay,
and the replayed outputs (forward) and gradients (forward + backward) equal the eager layer's on a
*fresh* input (cudagraph trees copy it into the recorded graph's static input: a stale-input bug
would show). 512 tokens in two packed documents, ``PrecisionConfig.serving_aligned()`` (the
bench's precision, so flash-linear-attention's autotuning carries over to ``bench layer``).

Tolerance: both sides are BF16; Inductor fuses pointwise chains in FP32 (one rounding instead of
one per op), so elements differ by a few BF16 ulps (2^-8 relative): the elementwise bound is
rtol 2e-2 (~5 ulps) + atol 2e-2 of the tensor's RMS, and up to 1e-4 of the elements may exceed it
(gradient sums with cancellation: 2 of 131 072 dx elements on the CPU tiny preset) with a relative
L2 within 1e-2, or (``inductor_ext.bench.compare.equal_by``) a difference within twice the eager layer's own change
when its input moves one BF16 ulp: the DSA layer's FP8 (e4m3) MoE activations turn BF16-ulp
differences between the compiled and the eager layer upstream (attention, mHC) into whole e4m3
steps, 2^-3 relative, about 1 time in 16 (measured at 512 tokens before this criterion: forward
rel L2 1.8e-2 with 6.8 % of the elements outside the fixed bound). Top-k choices are discontinuous,
so the test pins them: at 512 tokens the KPool
indexer selects every visible pool (topk 2048 > the documents; its token-id sets must match
exactly), and the MoE router's correction bias pins experts 0..7 for every token (a bias of 10
outweighs any sigmoid score difference; the other 280 grouped-GEMM groups stay empty), so no pick
can flip at a near-tie. Parameter gradients: relative L2 within 2e-2, or within twice that of the
eager layer's own one-ulp sensitivity for the same parameter. ``bench layer`` measures the unpinned
router at 8192 tokens.

Run on the H200: ``python -m pytest -m cuda tests/graphs/test_layers_cuda.py -s``.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import inductor_ext
from graphs import DecoderLayer, GLM53Config
from graphs.modules import MoE, cast_model
from inductor_ext import PrecisionConfig, backends
from inductor_ext.bench.compare import RTOL, SENSITIVITY_FACTOR, compare, equal_by, nudge_ulp
from lowerings._compat import cudagraph_trees_recorded, inductor_config, reset_cudagraph_trees

pytestmark = [pytest.mark.cuda, pytest.mark.gpu_exclusive, pytest.mark.xdist_group("h200_layers")]
TOKENS = 512
PARAM_GRAD_REL_L2 = 2e-2
CASES = [pytest.param(kind, variant, id=f"{kind}-{variant}")
         for kind in ("kda", "dsa") for variant in ("fwd", "fwd_bwd")]
_LAYER: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _release_layers():
    yield
    _LAYER.clear()  # the DSA layer's 15 GB go back before the next module's CUDA tests
    torch._dynamo.reset()
    reset_cudagraph_trees()
    torch.cuda.empty_cache()


def _layer(kind):
    """The h200 layer of ``kind`` (one kept at a time: the DSA layer holds 7.3 B BF16 parameters)."""
    if kind not in _LAYER:
        _LAYER.clear()
        torch.cuda.empty_cache()
        cfg = GLM53Config.h200(attn_impl="flex")
        torch.manual_seed(0)
        with torch.device("cuda"):
            layer = DecoderLayer(cfg, cfg.first_layer(kind))
        if isinstance(layer.mlp, MoE):  # pin the routing (see the module docstring); h200: the DSA layer
            layer.mlp.gate.e_score_correction_bias[: cfg.num_experts_per_tok] = 10.0
        _LAYER[kind] = (cast_model(layer, torch.bfloat16), cfg)
    return _LAYER[kind]


def _inputs(cfg, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(TOKENS, cfg.hc_mult, cfg.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    return x, torch.tensor([0, TOKENS * 5 // 8, TOKENS], device="cuda")


def _assert_equal_to_eager(name, got, want, nudged, kind):
    """``nudged``: the eager result on the input moved one ulp (the layer's own sensitivity)."""
    s, sens = compare(got, want), compare(nudged, want)
    by = equal_by(s, "kda", sens)  # the pinned routing gives both kinds the KDA allowances
    msg = (f"{kind} {name}: max abs {s['max_abs']:.3e} (atol {s['atol']:.3e}), rel L2 {s['rel_l2']:.3e}, "
           f"{s['mismatched']}/{s['elements']} elements outside the bound; eager's one-ulp sensitivity "
           f"rel L2 {sens['rel_l2']:.3e}, {sens['mismatched']} outside; equal by {by}")
    print(f"\n[replay vs eager] {msg}")
    assert by is not None, msg


@pytest.mark.parametrize("kind,variant", CASES)
def test_reduce_overhead_replay_equals_eager(kind, variant):
    if kind == "kda" and not backends.available("fla"):
        pytest.skip("fla-core not installed: kda_chunk's CUDA fallback (the reference) reads cu_seqlens on the host")
    inductor_ext.enable()
    torch._dynamo.reset()
    reset_cudagraph_trees()
    counters.clear()
    layer, cfg = _layer(kind)
    named = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
    x, cu = _inputs(cfg, seed=1)
    fresh, _ = _inputs(cfg, seed=2)

    def fwd(x, cu):
        return layer(x, cu)

    def loss(x, cu):
        return layer(x, cu)[0].float().square().mean()

    def grads(fn, x):
        leaf = x.detach().requires_grad_(True)
        value = fn(leaf, cu)
        return (value.detach(), *torch.autograd.grad(value, [leaf] + [p for _, p in named], allow_unused=True))

    def step(x):
        torch.compiler.cudagraph_mark_step_begin()
        if variant == "fwd":
            with torch.no_grad():
                return compiled(x, cu)
        return grads(compiled, x)

    with inductor_ext.precision(PrecisionConfig.serving_aligned()), \
            inductor_config.patch({"triton.cudagraph_or_error": True}):
        if variant == "fwd":
            with torch.no_grad():
                want, nudged = layer(fresh, cu), layer(nudge_ulp(fresh), cu)
        else:
            want, nudged = grads(loss, fresh), grads(loss, nudge_ulp(fresh))
        counters.clear()  # eager FlexAttention runs through its own torch.compile(backend="eager")
        compiled = torch.compile(fwd if variant == "fwd" else loss, backend="inductor", mode="reduce-overhead",
                                 fullgraph=True)
        for _ in range(3):  # cudagraph trees: warm-up run, recording, one replay
            step(x)
        with torch.compiler.set_stance("fail_on_recompile"):
            got = step(fresh)  # a replay on new input values
        torch.cuda.synchronize()

    assert counters["inductor"]["cudagraph_skips"] == 0, "a cudagraph skip (cudagraph_or_error should have raised)"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, "one graph, compiled once"
    recorded = cudagraph_trees_recorded(torch.cuda.current_device())
    print(f"\n[{kind} {variant}] cudagraph trees recorded {recorded} graph(s)")
    assert recorded is None or recorded >= (1 if variant == "fwd" else 2), "no CUDA graph was recorded"

    if variant == "fwd":
        _assert_equal_to_eager("out", got[0], want[0], nudged[0], kind)
        if kind == "dsa":
            g_ids, w_ids = (torch.sort(i.long(), dim=1).values for i in (got[1], want[1]))
            assert torch.equal(g_ids, w_ids), "indexer token-id sets differ (every visible pool is selected at 512)"
        return
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=0.0, msg=lambda m: f"{kind} loss: {m}")
    _assert_equal_to_eager("dx", got[1], want[1], nudged[1], kind)
    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()

    worst = (0.0, "-", 0.0)  # (rel L2 vs eager, parameter, the eager one-ulp sensitivity of its gradient)
    for (name, _), g, w, n in zip(named, got[2:], want[2:], nudged[2:]):
        assert (g is None) == (w is None), f"{name}: gradient None on one side only"
        if g is not None:
            err, sens = rel(g, w), rel(n, w)
            assert err <= max(PARAM_GRAD_REL_L2, SENSITIVITY_FACTOR * sens), \
                f"{kind} parameter gradient {name}: rel L2 {err:.3e} (eager's one-ulp sensitivity {sens:.3e})"
            worst = max(worst, (err, name, sens))
    print(f"[{kind} fwd_bwd] worst parameter-gradient rel L2 {worst[0]:.3e} ({worst[1]}; eager's one-ulp "
          f"sensitivity {worst[2]:.3e})")


def test_compiled_document_indexing_equals_eager():
    """Packed-document positions and the KPool layout compiled by Inductor (Triton searchsorted)
    equal eager: torch 2.11 mis-compiled searchsorted over a *sliced* boundary tensor
    (pytorch/pytorch#182343), which put the first document's tokens at wrong positions."""
    from inductor_ext.ops import kpool_layout
    from inductor_ext.ops.packing import document_positions

    cu = torch.tensor([0, 640, 641, 1024], device="cuda")
    eager = (document_positions(cu, 1024, "cuda"), *kpool_layout(cu, 1024, 4))
    compiled = torch.compile(lambda c: (document_positions(c, 1024, "cuda"), *kpool_layout(c, 1024, 4)),
                             fullgraph=True)(cu)
    for name, a, b in zip(("positions", "pool_token", "q_lo", "q_n", "tail_start", "tail_len"), compiled, eager):
        assert torch.equal(a, b), f"{name}: compiled differs from eager"
