"""The tf32x3 primitives of the FP32 KDA kernels: FP32-grade products from three TF32 tensor-core MMAs.

An FP32 operand x is split into ``hi``, x rounded to TF32 (sign, exponent and the 10 mantissa bits TF32
keeps; to nearest, ties away from zero), and ``lo = x − hi``, exact in FP32 with |lo| ≤ 2^-11 |x|. A
product ``a·b`` is then ``lo_a·hi_b + hi_a·lo_b + hi_a·hi_b`` (lo·lo dropped), three TF32 MMAs
accumulated by the tensor cores from zero: the arithmetic of Triton's ``tf32x3`` with a cheaper split
(an integer add and mask instead of ``cvt.rna.tf32.f32``) and no NaN mask between the MMAs, so the
operands must be finite.

- :func:`split_tf32`, :func:`dot3`, :func:`dot3t`: for ``triton.jit`` kernels;
- :func:`split_tf32_gluon`: the same split for ``gluon.jit`` kernels (a Gluon function cannot call a
  ``triton.jit`` helper). Both must give the same bits: the Gluon state pass of :mod:`.gluon_state`
  is bitwise equal to the Triton one of :mod:`.state`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

__all__ = ["TF32_HI", "split_tf32", "dot3", "dot3t", "split_tf32_gluon"]

TF32_HI = tl.constexpr(-8192)  # 0xFFFFE000: sign, exponent and the 10 mantissa bits TF32 keeps


@triton.jit
def split_tf32(x):
    """(hi, lo): hi = x rounded to TF32, to nearest with ties away from zero (``cvt.rna.tf32.f32``
    done as an integer add and mask), lo = x - hi, exact in FP32 with |lo| <= 2^-11 |x|."""
    hi = ((x.to(tl.int32, bitcast=True) + 0x1000) & TF32_HI).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def dot3(a, b):
    """a·b ``[M, N]`` FP32 with FP32-grade products from three TF32 MMAs on split operands, as Triton's
    ``tf32x3``: lo·hi and hi·lo, then hi·hi, accumulated by the tensor cores from zero. Callers add
    any accumulator on the CUDA cores: chained onto a large accumulator, the tensor cores' addition
    drops low bits of the small products. Operands must be finite (no NaN mask between the MMAs)."""
    a_hi, a_lo = split_tf32(a)
    b_hi, b_lo = split_tf32(b)
    out = tl.dot(a_lo, b_hi, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32), input_precision="tf32")
    out = tl.dot(a_hi, b_lo, out, input_precision="tf32")
    return tl.dot(a_hi, b_hi, out, input_precision="tf32")


@triton.jit
def dot3t(a, b):
    """:func:`dot3` computed as (bᵀ·aᵀ)ᵀ: the same products. TF32 tensor cores read their second
    operand K-major from shared memory: staging a row-major b there takes one scalar (transposing)
    store per element, staging aᵀ, for a row-major a, takes vector stores. For tiles loaded from
    memory; on operands that other dots produced or that stay live the extra layout conversions cost
    more than that (H200 measurements: ``docs/kda.md``)."""
    return tl.trans(dot3(tl.trans(b), tl.trans(a)))


@gluon.jit
def split_tf32_gluon(x):
    """:func:`split_tf32` for Gluon kernels, the same bits: (hi, lo), x rounded to TF32 (ties away from
    zero) and the exact FP32 remainder."""
    hi = ((x.to(gl.int32, bitcast=True) + 0x1000) & -8192).to(gl.float32, bitcast=True)
    return hi, x - hi
