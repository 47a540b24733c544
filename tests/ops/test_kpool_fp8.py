"""KPool indexer FP8 serving path on CPU: Hadamard-128, e4m3 pool/query quantization (bitwise against
independent references written here), ue8m0 scales over every BF16 amax, DeepGEMM-style logits error."""

import fractions
import math

import numpy as np
import pytest
import torch

from inductor_ext import ops
from inductor_ext.ops import kpool_reference as ref
from tests.support.kpool import HEADS, D, P, calc_diff, kp_check_selection, kp_indexer, kp_inputs, kp_run

FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# independent references (LMDeploy-style XOR butterfly, per-pool loops, exact scale rounding)
# ---------------------------------------------------------------------------------------------


def xor_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalized Hadamard in FP32 written as partner exchange: lane d pairs with d ^ stride."""
    x = x.float()
    d = torch.arange(D)
    for level in range(7):
        stride = 1 << level
        other = x[..., d ^ stride]
        x = torch.where((d & stride) == 0, x + other, other - x)
    return x * D**-0.5


def pow2_ceil(s: float) -> float:
    """2^ceil(log2 s) exactly (frexp: s = m·2^e with m in [0.5, 1))."""
    m, e = math.frexp(s)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def _scale(amax: float, fmt: str, reciprocal: bool) -> float:
    a = np.float32(max(np.float32(amax), np.float32(1e-4)))
    s = a * np.float32(1.0 / 448.0) if reciprocal else a / np.float32(448.0)
    return pow2_ceil(float(s)) if fmt == "ue8m0" else float(np.float32(s))


def _quant(x: torch.Tensor, s: float) -> torch.Tensor:
    return (x / torch.tensor(s, dtype=torch.float32)).clamp(-448, 448).to(FP8)


def ref_pools_fp8(k, gate, ape, cu, fmt):
    """Pool by pool: decode two-pass pooling, bf16, Hadamard, bf16, e4m3 with the serving scale."""
    pools, scales = [], []
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()):
        for p in range((eos - bos) // P):
            rows = [bos + P * p + i for i in range(P)]
            score = [gate[r].float() + ape[i].float() for i, r in enumerate(rows)]
            mx = score[0]
            for sc in score[1:]:
                mx = torch.maximum(mx, sc)
            acc, den = torch.zeros(D), torch.zeros(D)
            for i, r in enumerate(rows):
                e = torch.exp((score[i] - mx).double()).float()  # correctly rounded exp (the contract)
                den = den + e
                acc = acc + k[r].float() * e
            x = xor_hadamard((acc / den).bfloat16()).bfloat16().float()
            s = _scale(x.abs().max().item(), fmt, reciprocal=True)
            pools.append(_quant(x, s))
            scales.append(s)
    return torch.stack(pools), torch.tensor(scales, dtype=torch.float32)


def ref_query_fp8(q, w, fmt):
    qr = xor_hadamard(q).bfloat16().float()
    q8 = torch.empty(q.shape, dtype=FP8)
    sq = torch.empty(q.shape[:2])
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            sq[t, h] = _scale(qr[t, h].abs().max().item(), fmt, reciprocal=False)
            q8[t, h] = _quant(qr[t, h], sq[t, h].item())
    return q8, sq, w * sq * D**-0.5


def _bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t.view(torch.int32)


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


def test_hadamard_orthonormal():
    H = ref.hadamard128(torch.eye(D))  # row i = H e_i
    i = torch.arange(D)
    popcount = torch.tensor([bin(v).count("1") for v in (i[:, None] & i[None, :]).flatten().tolist()])
    sylvester = ((-1.0) ** popcount).view(D, D) * np.float32(D**-0.5)
    assert torch.equal(H, sylvester), "hadamard128 is not the normalized Sylvester matrix"
    eye = H.double() @ H.double().t()
    assert (eye - torch.eye(D, dtype=torch.float64)).abs().max() <= 1e-6, "H·Hᵀ != I"
    x = torch.randn(50, D)
    assert torch.equal(ref.hadamard128(x), xor_hadamard(x)), "butterfly differs from the XOR-partner form"
    exact = x.double() @ H.double().t()
    err = ((ref.hadamard128(x).double() - exact).norm() / exact.norm()).item()
    assert err <= 1e-6, f"hadamard128 vs FP64 matrix product: relative L2 {err:.3e}"
    y = torch.randn(50, D)
    dots = (ref.hadamard128(x).double() * ref.hadamard128(y).double()).sum(-1)
    assert torch.allclose(dots, (x.double() * y.double()).sum(-1), atol=1e-4), "rotation changed dot products"


@pytest.mark.parametrize("reciprocal", [True, False], ids=["pool", "query"])
@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_scale_over_every_bf16_amax(fmt, reciprocal):
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16)  # positive finite bf16
    amax = bits.view(torch.bfloat16).float()
    amax = amax[amax >= np.float32(1e-4)]
    x = torch.zeros(amax.shape[0], D)
    x[:, 0], x[:, 1] = amax, -amax / 2
    q, s = ref.quantize_e4m3(x, fmt, reciprocal)
    expected = torch.tensor([_scale(a, fmt, reciprocal) for a in amax.tolist()], dtype=torch.float32)
    bad = (s != expected).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} scales differ, first amax {amax[bad[:5]].tolist()}"
    ratio = amax / s
    if fmt == "fp32":  # s = amax/448 up to FP32 rounding; the clamp absorbs a ratio of 448(1+ε)
        assert ((ratio - 448).abs() <= 448 * 2.0**-21).all(), "fp32 scale is not amax/448"
    else:
        assert (ratio <= 448).all(), "amax/scale above 448: the block maximum would clip"
    if fmt == "ue8m0":
        exact = [fractions.Fraction(a) / 448 for a in amax.tolist()]  # DESIGN: 2^ceil(log2(amax/448))
        n = [f.numerator.bit_length() - f.denominator.bit_length() for f in exact]
        n = [e + 1 if fractions.Fraction(2) ** e < f else e for e, f in zip(n, exact)]
        n = [e - 1 if fractions.Fraction(2) ** (e - 1) >= f else e for e, f in zip(n, exact)]
        assert s.tolist() == [2.0**e for e in n], "ue8m0 scale differs from exact 2^ceil(log2(amax/448))"
        assert (s == torch.exp2(torch.round(torch.log2(s)))).all() and (ratio > 224).all(), "ue8m0 not tight"
    assert torch.equal(_bits(q[:, 0]), _bits((amax / s).clamp(-448, 448).to(FP8))), "q(amax) wrong"
    floor_q, floor_s = ref.quantize_e4m3(torch.full((1, D), 1e-6), fmt, reciprocal)
    assert floor_s.item() == _scale(1e-6, fmt, reciprocal), "amax floor 1e-4 not applied"


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_fp8_pools_bitwise_vs_independent_reference(fmt):
    lengths = [13, 0, 40, 3, 29]
    m = kp_indexer(16, seed=20)
    x, _, cu = kp_inputs(lengths, seed=21)
    k, gate, _ = ops.kpool_project(x, m.wk.weight, m.k_norm.weight, m.k_norm.bias, m.weights_proj.weight,
                                   m.index_kpool_compress_gate, head_proj="fp32")
    gate = (gate.float() * 4).bfloat16()  # sharper softmax: the max-subtraction matters
    pool_token = ops.kpool_layout(cu, x.shape[0], P)[0]
    pool, scale = ops.kpool_compress(k, gate, m.index_kpool_compress_ape.float(), pool_token, mode=f"fp8_{fmt}")
    exp_pool, exp_scale = ref_pools_fp8(k, gate, m.index_kpool_compress_ape.float(), cu, fmt)
    n = exp_pool.shape[0]
    assert pool.dtype == FP8 and pool.shape == (x.shape[0] // P, D), f"pool {pool.dtype} {tuple(pool.shape)}"
    assert torch.equal(_bits(pool[:n]), _bits(exp_pool)), "fp8 pool payload differs from the reference"
    assert torch.equal(_bits(scale[:n]), _bits(exp_scale)), "fp8 pool scale differs from the reference"
    assert (_bits(pool[n:]) == 0).all() and (scale[n:] == 0).all(), "unused slots must be zero"


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_query_quantization_and_folded_weight(fmt):
    g = torch.Generator().manual_seed(22)
    q = (torch.randn(9, HEADS, D, generator=g) * torch.logspace(-3, 2, HEADS)[None, :, None]).bfloat16()
    w = torch.randn(9, HEADS, generator=g)
    q8, w_eff = ops.kpool_quant_query(q, w, scale_fmt=fmt)
    exp_q8, _, exp_w = ref_query_fp8(q, w, fmt)
    assert torch.equal(_bits(q8), _bits(exp_q8)), "q8 differs from the reference"
    assert torch.equal(w_eff, exp_w), "w_eff != w · q_scale · 128^-0.5"


def test_fp8_logits_vs_dequantized(record_property):
    g = torch.Generator().manual_seed(23)
    q = torch.randn(64, HEADS, D, generator=g).bfloat16()
    w = torch.randn(64, HEADS, generator=g)
    k = torch.randn(96, D, generator=g).bfloat16()
    gate = torch.randn(96, D, generator=g).bfloat16()
    ape = torch.randn(P, D, generator=g)
    pool8, sk = ops.kpool_compress(k, gate, ape, torch.arange(0, 96, P), mode="fp8_ue8m0")
    q8, w_eff = ops.kpool_quant_query(q, w)
    _, sq, _ = ref_query_fp8(q, w, "ue8m0")
    logits = ops.kpool_logits(q8, w_eff, pool8, sk, precision="fp8", layout="legacy")
    qd = q8.double() * sq.double()[..., None]
    kd = pool8.double() * sk.double()[:, None]
    exact = torch.einsum("th,thp->tp", w.double() * D**-0.5, torch.relu(torch.einsum("thd,pd->thp", qd, kd)))
    diff = calc_diff(logits, exact)
    # quantization error of the whole FP8 path against BF16 scoring of the rotated inputs
    pool16, _ = ops.kpool_compress(k, gate, ape, torch.arange(0, 96, P), mode="bf16_fp32")
    bf16 = ops.kpool_logits(q, w, pool16, torch.ones(24), precision="bf16")
    quant = calc_diff(logits, bf16)
    record_property("fp8_logits_calc_diff", diff)
    record_property("fp8_vs_bf16_calc_diff", quant)
    assert diff <= 5e-6, f"fp8 logits: calc_diff {diff:.3e} vs dequantized FP64 > 5e-6"
    assert quant <= 5e-3, f"fp8 vs bf16 logits: calc_diff {quant:.3e}"


def test_fp8_selection_overlaps_bf16(record_property):
    lengths, topk = [200, 120], 32
    m = kp_indexer(topk, seed=24)
    x, qr, cu = kp_inputs(lengths, seed=25)
    bf16 = kp_run(m, x, qr, cu, kpool="bf16", kpool_pooling="fp32", head_proj="fp32")
    for fmt in ("ue8m0", "fp32"):
        fp8 = kp_run(m, x, qr, cu, kpool="fp8", head_proj="fp32", scale_fmt=fmt)
        kp_check_selection(fp8, cu, topk)
        same = sum(len(set(a.tolist()) & set(b.tolist()) - {-1}) for a, b in zip(fp8, bf16))
        total = sum(len(set(b.tolist()) - {-1}) for b in bf16)
        record_property(f"fp8_{fmt}_token_overlap_with_bf16", same / total)
        assert same / total >= 0.85, f"fp8 ({fmt}) keeps only {same / total:.3f} of the bf16 selection"
