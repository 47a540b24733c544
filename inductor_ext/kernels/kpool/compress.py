"""Triton kernels of ``glm53::kpool_compress`` and ``glm53::kpool_quant_query`` (CUDA).

Bitwise contract: pools, pool scales, FP8 queries and folded head weights equal the CPU reference
(:mod:`inductor_ext.ops.kpool_reference`) because every rounding step is written in the
reference's order: FP32 adds and multiplies as separate roundings (the launch disables FMA
contraction, ``enable_fp_fusion=False``), IEEE division (``div_rn``; Triton's ``/`` on CUDA is an
approximate division), the same Hadamard butterflies, and the power-of-two scale taken from the
exponent bits (exactly ``exp2(ceil(log2 s))`` for the FP32 scales that occur: s = bf16 amax ·
fp32(1/448) or / 448, never within an FP32 ulp above a power of two unless equal to it).

``exp`` in the softmax over the P slots is evaluated in FP64 and rounded to FP32 (correctly
rounded), in the kernels and in the reference alike: FP32 ``exp`` implementations differ by an ulp
on about 1 % of arguments (PyTorch's CPU SLEEF against FP64), enough to move a BF16 pool value.

Shapes: T tokens, S pool slots, H heads, D = 128. All launch grids come from static shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inductor_ext.ops.kpool_reference import COMPRESS_MODES, HEAD_DIM

__all__ = [
    "kpool_compress_fwd", "kpool_quant_query_fwd", "hadamard128_tl", "pow2_ceil_tl", "round_bf16_tl", "e4m3_bits_tl",
]

_MODE_ID = {m: i for i, m in enumerate(COMPRESS_MODES)}  # bf16_reference 0, bf16_fp32 1, fp8_ue8m0 2, fp8_fp32 3
_NO_FMA = {"enable_fp_fusion": False}  # CUDA launch option; the interpreter drops unknown kwargs


@triton.jit
def hadamard128_tl(x, R: tl.constexpr):
    """Orthonormal Hadamard-128 of each row of FP32 ``x [R, 128]``: butterflies of stride 1 .. 64
    (low = a + b, high = a - b, as the reference), then × fp32(128^-0.5)."""
    # unrolled by hand: the CUDA front end rejects a constexpr stride re-bound in a static loop
    x = _butterfly_tl(x, R, 1)
    x = _butterfly_tl(x, R, 2)
    x = _butterfly_tl(x, R, 4)
    x = _butterfly_tl(x, R, 8)
    x = _butterfly_tl(x, R, 16)
    x = _butterfly_tl(x, R, 32)
    x = _butterfly_tl(x, R, 64)
    return x * 0.08838834764831845


@triton.jit
def _butterfly_tl(x, R: tl.constexpr, S: tl.constexpr):
    """One radix-2 level of stride S over each row of ``x [R, 128]``: low = a + b, high = a - b."""
    y = tl.permute(tl.reshape(x, (R, 64 // S, 2, S)), (0, 1, 3, 2))
    a, b = tl.split(y)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (R, 128))


@triton.jit
def pow2_ceil_tl(s):
    """2^ceil(log2 s) of positive normal FP32 ``s`` from its bits (exact; no log2 approximation)."""
    bits = s.to(tl.int32, bitcast=True)
    expo = bits & 0x7F800000
    up = tl.where((bits & 0x007FFFFF) != 0, expo + 0x00800000, expo)
    return up.to(tl.float32, bitcast=True)


@triton.jit
def round_bf16_tl(x):
    """FP32 → the FP32 value of its round-to-nearest-even BF16 (finite inputs). Written with integer
    ops because Triton's interpreter truncates in ``.to(tl.bfloat16)``; on CUDA it equals cvt.rn."""
    b = x.to(tl.int32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b & -65536).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits_tl(v):
    """Bits (uint8) of float8_e4m3fn(v), round to nearest even, for FP32 ``|v| <= 448``.

    The value is rounded to its e4m3 quantum with the add/subtract trick (exact in FP32: the
    quantum is 2^(e-3) for normals, 2^-9 for subnormals) and encoded with integer ops, so CUDA and
    the interpreter (whose FP8 casts do not round to nearest even) give the same bits as torch."""
    b = v.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    qe = tl.maximum((b >> 23) & 0xFF, 121) - 3  # biased exponent of the quantum
    c = (((qe + 23) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 · 2^23 · quantum
    r = (tl.abs(v) + c) - c
    rb = r.to(tl.int32, bitcast=True)
    re = (rb >> 23) & 0xFF
    normal = ((re - 120) << 3) | ((rb >> 20) & 7)
    sub = (r * 512.0).to(tl.int32)
    return (tl.where(re >= 121, normal, sub) | sign).to(tl.uint8)


@triton.jit
def _quantize_rows(x, reciprocal: tl.constexpr, ue8m0: tl.constexpr):
    """e4m3 quantization of FP32 rows ``x [R, 128]`` → (e4m3 bits uint8 [R, 128], scale fp32 [R])."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    if reciprocal:
        scale = amax * 0.002232142857142857  # × fp32(1/448): the serving pool quantizer
    else:
        scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    if ue8m0:
        scale = pow2_ceil_tl(scale)
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    return e4m3_bits_tl(q), scale


@triton.jit
def _kpool_compress_kernel(
    k_ptr, gate_ptr, ape_ptr, pool_token_ptr, pool_ptr, scale_ptr,
    S, stride_k, stride_g, stride_ape,
    P: tl.constexpr, MODE: tl.constexpr, BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, 128)
    in_range = rows < S
    first = tl.load(pool_token_ptr + rows, mask=in_range, other=-1)
    valid = first >= 0
    base = tl.where(valid, first, 0)
    ld = valid[:, None]
    g_row = gate_ptr + base[:, None] * stride_g + d[None, :]
    k_row = k_ptr + base[:, None] * stride_k + d[None, :]

    # m = max_s(gate_s + ape_s), taken slot by slot like the reference
    m = tl.load(g_row, mask=ld, other=0.0).to(tl.float32) + tl.load(ape_ptr + d).to(tl.float32)[None, :]
    for s in tl.static_range(1, P):
        sc = tl.load(g_row + s * stride_g, mask=ld, other=0.0).to(tl.float32) \
            + tl.load(ape_ptr + s * stride_ape + d).to(tl.float32)[None, :]
        m = tl.maximum(m, sc)
    den = tl.zeros((BLOCK_S, 128), tl.float32)
    acc = tl.zeros((BLOCK_S, 128), tl.float32)
    for s in tl.static_range(P):
        sc = tl.load(g_row + s * stride_g, mask=ld, other=0.0).to(tl.float32) \
            + tl.load(ape_ptr + s * stride_ape + d).to(tl.float32)[None, :]
        # correctly rounded exp (FP64 then one rounding); see the module docstring
        e = tl.exp((sc - m).to(tl.float64)).to(tl.float32)
        den = den + e
        if MODE != 0:
            acc = acc + tl.load(k_row + s * stride_k, mask=ld, other=0.0).to(tl.float32) * e
    if MODE == 0:
        # transformers: probs = bf16(e / Σe); pool = Σ bf16(probs·k), FP32 accumulation, one rounding
        for s in tl.static_range(P):
            sc = tl.load(g_row + s * stride_g, mask=ld, other=0.0).to(tl.float32) \
                + tl.load(ape_ptr + s * stride_ape + d).to(tl.float32)[None, :]
            e = tl.exp((sc - m).to(tl.float64)).to(tl.float32)
            prob = round_bf16_tl(tl.math.div_rn(e, den))
            kk = tl.load(k_row + s * stride_k, mask=ld, other=0.0).to(tl.float32)
            acc = acc + round_bf16_tl(prob * kk)
    else:
        acc = tl.math.div_rn(acc, den)
    one = tl.where(valid, 1.0, 0.0)
    out = pool_ptr + rows[:, None] * 128 + d[None, :]
    st = in_range[:, None]
    if MODE < 2:
        tl.store(out, round_bf16_tl(tl.where(ld, acc, 0.0)).to(tl.bfloat16), mask=st)
        tl.store(scale_ptr + rows, one, mask=in_range)
    else:
        x = round_bf16_tl(hadamard128_tl(round_bf16_tl(acc), BLOCK_S))
        q, scale = _quantize_rows(x, True, MODE == 2)
        tl.store(out, tl.where(ld, q, 0), mask=st)
        tl.store(scale_ptr + rows, tl.where(valid, scale, 0.0), mask=in_range)


@triton.jit
def _kpool_quant_query_kernel(
    q_ptr, w_ptr, q8_ptr, w_eff_ptr, R, UE8M0: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, 128)
    ok = rows < R
    x = tl.load(q_ptr + rows[:, None] * 128 + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    x = round_bf16_tl(hadamard128_tl(x, BLOCK_R))
    q, scale = _quantize_rows(x, False, UE8M0)
    tl.store(q8_ptr + rows[:, None] * 128 + d[None, :], q, mask=ok[:, None])
    w = tl.load(w_ptr + rows, mask=ok, other=0.0)
    tl.store(w_eff_ptr + rows, (w * scale) * 0.08838834764831845, mask=ok)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def kpool_compress_fwd(k, gate, ape, pool_token, mode: str, block_s: int = 16):
    """Pool compression on the device of ``k``.

    Args:
        k, gate: ``[T, 128]`` bf16 (row stride free, unit column stride after a copy if needed).
        ape: ``[P, 128]`` fp32/bf16/fp16; pool_token: ``[S]`` int64, -1 = unused slot.
        mode: one of ``bf16_reference``, ``bf16_fp32``, ``fp8_ue8m0``, ``fp8_fp32``.

    Returns:
        ``(pool [S,128] bf16 | float8_e4m3fn, scale [S] fp32)``, contiguous; unused slots are
        zeros with scale 0 (bf16 modes: scale 1 for used slots).
    """
    k, gate, ape = _rows_contiguous(k), _rows_contiguous(gate), _rows_contiguous(ape)
    pool_token = pool_token.contiguous()
    S, P = pool_token.shape[0], ape.shape[0]
    fp8 = mode.startswith("fp8")
    pool = torch.empty(S, HEAD_DIM, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=k.device)
    scale = torch.empty(S, dtype=torch.float32, device=k.device)
    if S > 0:
        _kpool_compress_kernel[(triton.cdiv(S, block_s),)](
            k, gate, ape, pool_token, pool.view(torch.uint8) if fp8 else pool, scale, S,
            k.stride(0), gate.stride(0), ape.stride(0),
            P=P, MODE=_MODE_ID[mode], BLOCK_S=block_s, num_warps=4, **_NO_FMA)
    return pool, scale


def kpool_quant_query_fwd(q, w, scale_fmt: str, block_r: int = 16):
    """FP8 query: ``q [T,H,128]`` bf16, ``w [T,H]`` fp32 → ``(q8 [T,H,128] e4m3, w_eff [T,H] fp32)``
    with ``w_eff = (w · s_q) · fp32(128^-0.5)``, bitwise equal to the reference."""
    q, w = q.contiguous(), w.contiguous()
    T, H, _ = q.shape
    q8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    w_eff = torch.empty(T, H, dtype=torch.float32, device=q.device)
    R = T * H
    if R > 0:
        _kpool_quant_query_kernel[(triton.cdiv(R, block_r),)](
            q, w, q8.view(torch.uint8), w_eff, R, UE8M0=scale_fmt == "ue8m0", BLOCK_R=block_r, num_warps=4, **_NO_FMA)
    return q8, w_eff
