"""Routed MoE experts (``graphs.modules.Experts``: sort by expert, ``torch._grouped_mm``, un-permute,
FP32 weighted sum over the top-k) against a plain per-token loop over the selected experts in FP64
(the same math, no rounding), forward and VJP; compiled with ``fullgraph=True`` under aot_eager and
inductor (CPU) without graph breaks; experts that no token picks (empty groups); the router's
(ids, weights) against transformers' ``Glm5NextTextTopkRouter``.

Tolerances (relative L2 against FP64 from the same BF16 inputs and weights): one BF16 rounding
of a Gaussian tensor is a relative L2 error of 1.66e-3 (unit 2⁻⁸). The routed path rounds the
gate/up projections, SiLU and the SwiGLU product (``mode="native"``), the down projection and the
final FP32 sum; these add in quadrature to the measured 4.2e-3 to 4.4e-3 (≈ 2.6 roundings' worth),
bound 8e-3. Backward chains as many BF16 steps (incoming gradient times weight, SwiGLU backward,
each grouped-mm gradient, the per-pair x gradient before its FP32 sum over k): measured 4.2e-3 to
4.9e-3 for x, both expert weights and the routing weights, bound 1e-2. Both bounds are ~2× the
measurement, far below what a wrong route, offset or weight gives (O(1): skipping the routing
weight is a relative error of ~0.3 and more, checked by planting it once).
"""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from graphs import GLM53Config
from graphs.modules import Experts, MoE, TopkRouter, cast_model
from inductor_ext import PrecisionConfig
from tests.support.fp64 import assert_rel_l2

REF = PrecisionConfig.reference()
TOL = {"out": 8e-3, "grad": 1e-2, "weights": 1e-2}
CONFIGS = {
    "E8-k2": GLM53Config.tiny(),
    "E32-k8": GLM53Config.tiny(n_routed_experts=32, num_experts_per_tok=8, n_group=4, topk_group=2),
}
T = 61  # odd, so no group size lines up with anything


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Unit-variance projections (std = fan_in^-0.5), BF16 like the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return cast_model(module, torch.bfloat16)


def _routing(cfg: GLM53Config, seed: int, unused=()):
    """Random distinct top-k ids per token avoiding ``unused``; positive FP32 weights summing to the
    routed scaling factor, like the router's."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(cfg.n_routed_experts) if e not in unused])
    k = cfg.num_experts_per_tok
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(T)])
    w = torch.rand(T, k, generator=g) + 0.1
    return idx, w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor


def _loop_fp64(x, idx, w, gate_up, down, limit):
    """Σ_j w[t, j] · expert_{idx[t, j]}(x[t]), one token and one selected expert at a time, FP64."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j, e in enumerate(idx[t].tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            act = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
            acc = acc + w[t, j] * (down[e] @ act)
        rows.append(acc)
    return torch.stack(rows)


def _fp64_leaves(x, w, experts):
    return [t.detach().double().requires_grad_(True) for t in (x, w, experts.gate_up_proj, experts.down_proj)]


def _check_against_fp64(experts, x, idx, w, run=None):
    """Forward and VJP of ``run(x, idx, w)`` (default: eager ``experts``) against the FP64 loop."""
    run = run or (lambda x, idx, w: experts(x, idx, w, REF, None))
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    experts.zero_grad(set_to_none=True)
    out = run(x, idx, w)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    out.float().mul(cot).sum().backward()
    x64, w64, gu64, dn64 = leaves = _fp64_leaves(x, w, experts)
    ref = _loop_fp64(x64, idx, w64, gu64, dn64, experts.limit)
    grads = torch.autograd.grad(ref.mul(cot.double()).sum(), leaves)
    errs = {"out": assert_rel_l2("out", out.double(), ref, TOL["out"])}
    for name, got, exp in zip(("x", "weights", "gate_up_proj", "down_proj"),
                              (x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad), grads):
        errs[name] = assert_rel_l2(f"grad {name}", got.double(), exp, TOL["weights" if name == "weights" else "grad"])
    return errs, out.detach(), [x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad]


@pytest.mark.parametrize("name", CONFIGS)
def test_routed_matches_fp64_per_token_loop(name):
    cfg = CONFIGS[name]
    experts = _randomize(Experts(cfg), seed=1)
    x = torch.randn(T, cfg.hidden_size).to(torch.bfloat16)
    idx, w = _routing(cfg, seed=2)
    errs, _, _ = _check_against_fp64(experts, x, idx, w)
    print(name, {k: f"{v:.2e}" for k, v in errs.items()})


@pytest.mark.parametrize("name", CONFIGS)
def test_router_ids_feed_the_experts(name):
    """The router's own (ids, weights) [T, k] drive the experts (real top-k, not random picks)."""
    cfg = CONFIGS[name]
    moe = _randomize(MoE(cfg), seed=3)
    x = torch.randn(T, cfg.hidden_size).to(torch.bfloat16)
    idx, w = moe.gate(x, PrecisionConfig.reference())
    assert idx.shape == w.shape == (T, cfg.num_experts_per_tok) and idx.dtype == torch.int64
    assert w.dtype == torch.float32
    _check_against_fp64(moe.experts, x, idx, w)


def test_experts_nobody_picks_are_empty_groups():
    """First, a middle and the last expert unused: same output as the loop, exactly zero gradient
    for their weights (the grouped mm skips empty groups, offsets stay right around them)."""
    cfg = CONFIGS["E32-k8"]
    unused = (0, 13, 14, cfg.n_routed_experts - 1)
    experts = _randomize(Experts(cfg), seed=4)
    x = torch.randn(T, cfg.hidden_size).to(torch.bfloat16)
    idx, w = _routing(cfg, seed=5, unused=unused)
    _check_against_fp64(experts, x, idx, w)
    for e in unused:
        assert experts.gate_up_proj.grad[e].abs().max() == 0 and experts.down_proj.grad[e].abs().max() == 0
    used = [e for e in range(cfg.n_routed_experts) if e not in unused]
    assert (experts.down_proj.grad[used].flatten(1).abs().amax(1) > 0).all()
    # every token on one expert: all other groups empty
    one = torch.full((T, 1), 5)
    single = GLM53Config.tiny(num_experts_per_tok=1)
    _check_against_fp64(_randomize(Experts(single), seed=6), x, one, torch.ones(T, 1))


def _compiled(backend, fn):
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    return counter, torch.compile(fn, backend=counter, fullgraph=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiles_to_one_graph_and_matches_fp64(backend):
    torch._dynamo.reset()
    cfg = CONFIGS["E32-k8"]
    experts = _randomize(Experts(cfg), seed=8)
    x = torch.randn(T, cfg.hidden_size).to(torch.bfloat16)
    idx, w = _routing(cfg, seed=9, unused=(3,))
    _, eager_out, eager_grads = _check_against_fp64(experts, x, idx, w)
    counter, run = _compiled(backend, lambda x, idx, w: experts(x, idx, w, REF, None))
    errs, out, grads = _check_against_fp64(experts, x, idx, w, run)
    print(backend, {k: f"{v:.2e}" for k, v in errs.items()})
    assert counter.frame_count == 1 and not counters["graph_break"], dict(counters["graph_break"])
    if backend == "aot_eager":  # same kernels as eager: bitwise
        torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
        for a, b in zip(grads, eager_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.compiler.set_stance("fail_on_recompile"):  # new routing, same shapes: no recompile
        idx2, w2 = _routing(cfg, seed=10, unused=(0, 31))
        _check_against_fp64(experts, x, idx2, w2, run)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("moe_act", ["none", "fp8_ue8m0"])
def test_moe_layer_compiles_without_graph_breaks(backend, moe_act):
    """Router → routed experts → shared expert, forward and backward in one graph."""
    torch._dynamo.reset()
    cfg = CONFIGS["E32-k8"]
    prec = REF.replace(moe_act=moe_act)
    moe = _randomize(MoE(cfg), seed=11)
    x = torch.randn(T, cfg.hidden_size).to(torch.bfloat16).requires_grad_(True)
    eager = moe(x, prec)
    counter, run = _compiled(backend, lambda x: moe(x, prec))
    out = run(x)
    out.float().square().mean().backward()
    assert counter.frame_count == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert all(p.grad is not None for p in moe.parameters() if p.requires_grad)
    tol = 0 if backend == "aot_eager" else 8e-3  # inductor fuses SwiGLU / FP8 math without BF16 steps
    if tol:
        print(moe_act, assert_rel_l2("compiled MoE", out.detach().double(), eager.detach().double(), tol))
    else:
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch._dynamo.reset()


def test_router_matches_transformers():
    """(ids, weights) = transformers' top-k indices and weights, bitwise (ids as sets per token)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextTopkRouter

    cfg = CONFIGS["E32-k8"]
    ours = TopkRouter(cfg)
    with torch.no_grad():
        ours.e_score_correction_bias.normal_(0, 0.3)
    theirs = Glm5NextTextTopkRouter(Glm5NextTextConfig(**cfg.to_hf_dict()))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(T, cfg.hidden_size).to(torch.bfloat16)
    idx, w = ours(x, PrecisionConfig.reference())
    _, w_ref, idx_ref = theirs(x)
    o, o_ref = idx.sort(-1), idx_ref.sort(-1)
    torch.testing.assert_close(o.values, o_ref.values, rtol=0, atol=0)
    torch.testing.assert_close(w.gather(1, o.indices), w_ref.gather(1, o_ref.indices), rtol=0, atol=0)
