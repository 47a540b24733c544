"""What a three-TF32 ("dot3") product costs in a streaming kernel, Triton against Gluon (H200 only).

The kernel is the solve of the FP32 KDA forward taken on its own: for each of T/64·H (chunk, head)
pairs, four 64-column blocks of a [64, 256] FP32 right-hand side are overwritten with A⁻¹·block,
A⁻¹ a [64, 64] FP32 matrix per pair (one program per block). Variants:

- Triton, ``_dot3`` as in ``inductor_ext/kernels/kda_fp32_triton.py`` (hi/lo split, three chained
  ``tl.dot(..., input_precision="tf32")``);
- Triton, one TF32 dot (not FP32-grade: shows the cost of the two extra products);
- Triton, no dot at all (the same loads and stores: the kernel's memory floor);
- Gluon, the same three products as explicit ``warpgroup_mma`` calls, synchronous and asynchronous
  (one wait for the three).

Prints relative L2 against FP64 and CUDA-graph replay p50 / max per variant. Usage, on a CUDA machine
with triton 3.6: ``python notes/dot3_probe.py``. Session 15's numbers are in ``kda-fp32-kernels.md``.
"""

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from inductor_ext import timing
from inductor_ext.kernels.kda_fp32_triton import _dot3

BLOCKS = 4  # 64-column blocks per pair: K + V = 256 columns


@triton.jit
def _triton_solve(W, AI, MODE: tl.constexpr):
    # MODE 0: _dot3, 1: one TF32 dot, 2: no dot (row sums of A⁻¹ added, so that A⁻¹ is still read)
    pid = tl.program_id(0)
    pair = pid // 4
    r = tl.arange(0, 64)
    a = tl.load(AI + pair * 4096 + r[:, None] * 64 + r[None, :])
    off = pair * 16384 + r[:, None] * 256 + (pid % 4) * 64 + r[None, :]
    b = tl.load(W + off)
    if MODE == 0:
        out = _dot3(a, b)
    elif MODE == 1:
        out = tl.dot(a, b, input_precision="tf32")
    elif MODE == 3:  # the same products transposed: (bᵀ·aᵀ)ᵀ, so that the operand staged in shared memory is K-major
        out = tl.trans(_dot3(tl.trans(b), tl.trans(a)))
    else:
        out = b + tl.sum(a, 1)[:, None]
    tl.store(W + off, out)


@gluon.jit
def _gluon_split(x):
    hi = ((x.to(gl.int32, bitcast=True) + 0x1000) & -8192).to(gl.float32, bitcast=True)
    return hi, x - hi


@gluon.jit
def _gluon_solve(W, AI, ASYNC: gl.constexpr):
    pid = gl.program_id(0)
    pair = pid // 4
    blocked: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
    b_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2,
                                                  transposed=True)  # TF32 wgmma wants B K-major
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, blocked))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, blocked))
    a_hi, a_lo = _gluon_split(gl.load(AI + pair * 4096 + r[:, None] * 64 + c[None, :]))
    off = pair * 16384 + r[:, None] * 256 + (pid % 4) * 64 + c[None, :]
    b_hi, b_lo = _gluon_split(gl.load(W + off))
    b_hi = gl.allocate_shared_memory(gl.float32, [64, 64], b_layout, b_hi)
    b_lo = gl.allocate_shared_memory(gl.float32, [64, 64], b_layout, b_lo)
    fence_async_shared()
    a_hi = gl.convert_layout(a_hi, a_layout)
    a_lo = gl.convert_layout(a_lo, a_layout)
    acc = gl.zeros([64, 64], dtype=gl.float32, layout=mma)
    acc = warpgroup_mma(a_lo, b_hi, acc, is_async=ASYNC)
    acc = warpgroup_mma(a_hi, b_lo, acc, is_async=ASYNC)
    acc = warpgroup_mma(a_hi, b_hi, acc, is_async=ASYNC)
    if ASYNC:
        acc = warpgroup_mma_wait(0, deps=[acc])
    gl.store(W + off, gl.convert_layout(acc, blocked))


def main(pairs: int = 256 * 64) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    ainv = torch.randn(pairs, 64, 64, device="cuda", generator=gen)
    rhs = torch.randn(pairs, 64, 256, device="cuda", generator=gen)
    ref = ainv.double() @ rhs.double()
    w = rhs.clone()
    grid = (pairs * BLOCKS,)
    variants = {
        "triton dot3": lambda: _triton_solve[grid](w, ainv, MODE=0, num_warps=4),
        "triton dot3 transposed": lambda: _triton_solve[grid](w, ainv, MODE=3, num_warps=4),
        "triton one tf32 dot": lambda: _triton_solve[grid](w, ainv, MODE=1, num_warps=4),
        "triton no dot": lambda: _triton_solve[grid](w, ainv, MODE=2, num_warps=4),
        "gluon dot3, synchronous": lambda: _gluon_solve[grid](w, ainv, ASYNC=False, num_warps=4),
        "gluon dot3, one wait": lambda: _gluon_solve[grid](w, ainv, ASYNC=True, num_warps=4),
    }
    for name, launch in variants.items():
        w.copy_(rhs)
        launch()
        err = ((w.double() - ref).norm() / ref.norm()).item()
        stats = timing.replay_stats(launch, 20)
        print(f"{name}: relative L2 against FP64 {err:.2e}, replay p50 {stats['p50_us']:.0f} / max "
              f"{stats['max_us']:.0f} us", flush=True)


if __name__ == "__main__":
    main()
