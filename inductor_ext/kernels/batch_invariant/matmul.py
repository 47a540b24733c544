"""Batch-invariant matmul for ``glm53::bi_linear``: ``y = x · weightᵀ (+ bias)``, FP32 accumulation.

One program computes one ``[BLOCK_M, BLOCK_N]`` output tile over the full K: ``acc = dot(a_k, b_k,
acc)`` for K blocks of ``block_k`` in ascending order, then the bias, then one rounding. The tile
configuration comes from the compute dtype (:func:`launch_config`), never from M, and nothing is
autotuned: no split-K, no stream-K, no reduction split, so the MMA instructions that accumulate an
output element and their order are the same for every M, and an element's value depends only on
its row of x and its column of weightᵀ (rows beyond M are masked to zero inside the tile and never
reach another row's accumulator). Grouped tile order (``GROUP_M``) only changes which program
computes a tile, not how. ``M`` is not specialized, so every M runs the same compiled kernel.

FP32 inputs use ``input_precision="ieee"`` (no TF32); mixed input dtypes are upcast to FP32 in
registers (exact). A strided weight is read in place (the backward's ``xᵀ``, ``weightᵀ``); a left
operand whose K is not contiguous (the backward's ``dyᵀ``) is copied K-contiguous first (faster).
Imports only torch and triton; the K block comes from the caller
(``inductor_ext.ops.batch_invariant_reference.BLOCK_K``).

The same kernel serves ``glm53::bi_grouped_linear`` (MoE experts; constexpr ``RAGGED``, no copied
body): ``RAGGED = 1`` reads per-tile metadata (:func:`grouped_tile_map`: group, first row, end row
of each tile slot) so a program computes a tile of rows of ONE group against that group's weight
(``weight [E, N, K]``, group stride), with the dense tile configuration and K loop: a row's value
is the one the dense kernel gives it alone, whatever the group sizes. ``RAGGED = 2`` is its weight
gradient: program block e reduces over the rows of group e (the K loop from the group's first row
to its end, ascending blocks) into ``dweight[e]``. The metadata are built with torch ops on the
device (no host read), the grids from static shapes, so both capture into CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["CONFIGS", "SKINNY_FP32", "launch_config", "bi_matmul", "bi_grouped_matmul", "bi_grouped_matmul_wgrad",
           "grouped_tile_map"]

# compute dtype -> fixed launch configuration (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages).
# Changing an entry changes tiling only; the K order is fixed by the caller's block_k.
CONFIGS = {
    torch.bfloat16: (128, 128, 8, 8, 3),
    torch.float16: (128, 128, 8, 8, 3),
    torch.float32: (64, 64, 8, 4, 2),
}
SKINNY_FP32 = (16, 32, 8, 2, 2)  # FP32 products with N <= 32 (see launch_config)


@triton.jit(do_not_specialize=["M", "TILES"])  # one compiled kernel for every M (no M == 1 / M % 16 variants)
def _bi_matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, meta_ptr, M, N, K, E, TILES,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_ye, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, RAGGED: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # RAGGED = 0: dense. 1: grouped rows (bi_grouped_linear, its dx): tile slot t computes rows
    # [meta[1, t], meta[2, t]) of group meta[0, t] against weight[group] (group E: the rows past the
    # last offset, zeros; -1: an excess slot, returns). 2: grouped reduction (its dweight): program
    # block g reduces K over rows [meta[0, g], meta[1, g]) into y[g]. The tile loop is the same.
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    if RAGGED == 1:
        num_m = TILES
    else:
        num_m = tl.cdiv(M, BLOCK_M)
    if RAGGED == 2:
        group = pid // (num_m * num_n)
        pid = pid % (num_m * num_n)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m

    m_end = M
    k_lo = 0
    k_end = K
    if RAGGED == 1:
        group = tl.load(meta_ptr + pid_m)
        if group < 0:
            return
        row0 = tl.load(meta_ptr + TILES + pid_m).to(tl.int64)
        m_end = tl.load(meta_ptr + 2 * TILES + pid_m)
        k_end = tl.where(group == E, 0, K)  # group E, the rows past the last offset: no K loop, zeros
        rm = row0 + tl.arange(0, BLOCK_M)
        w_ptr += group.to(tl.int64) * stride_we
    else:
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    if RAGGED == 2:
        k_lo = tl.load(meta_ptr + group)
        k_end = tl.load(meta_ptr + E + group)
        y_ptr += group.to(tl.int64) * stride_ye
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < m_end
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm
    w_cols = w_ptr + rn[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_end, BLOCK_K):  # ascending K blocks, the whole K in this program
        kk = k0 + rk
        if RAGGED == 2:  # K is the rows of dy and x here: 64-bit offsets
            kk = kk.to(tl.int64)
        a_ok = m_ok[:, None]
        b_ok = n_ok[None, :]
        if not EVEN_K:  # (K a multiple of BLOCK_K: no K mask, the same values: it only zeroes k >= K)
            k_ok = kk < k_end
            a_ok = a_ok & k_ok[None, :]
            b_ok = b_ok & k_ok[:, None]
        a = tl.load(x_rows + kk[None, :] * stride_xk, mask=a_ok, other=0.0)
        b = tl.load(w_cols + kk[:, None] * stride_wk, mask=b_ok, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def bi_matmul(x, weight, bias, out_dtype, block_k: int):
    """``x [..., K] · weight [N, K]ᵀ (+ bias [N])`` → contiguous ``[..., N]`` in ``out_dtype``; FP32
    accumulation over ascending K blocks of ``block_k``. Inputs may be strided (x must flatten to
    ``[M, K]`` without a copy for the in-place read; otherwise reshape copies it)."""
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=out_dtype)
    if M == 0:
        return y.reshape(*x.shape[:-1], N)
    _launch(x2, weight, bias, y, None, M, N, K, 1, 0, 0, (0, *weight.stride()), (0, *y.stride()), block_k)
    return y.reshape(*x.shape[:-1], N)


def launch_config(compute, N, K, block_k):
    """``(BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages, K block)`` of one launch: :data:`CONFIGS`
    of the compute dtype, never chosen from M. FP32 (``input_precision="ieee"``: Triton's FMA dot, one
    fused multiply-add chain per output element in ascending k, which no tile shape changes) also
    fits the tile to a skinny product: :data:`SKINNY_FP32` when N <= 32 (mHC's 24-column projection:
    more programs over the long K), and a K shorter than ``block_k`` (its backward's K = 24) padded to
    the next power of two instead of to ``block_k`` (one block either way; the skipped products are
    of zero padding)."""
    config = CONFIGS[compute]
    if compute == torch.float32:
        if N <= SKINNY_FP32[1] and config[1] > SKINNY_FP32[1]:  # (narrower tiles only: a test's 16-wide stay)
            config = SKINNY_FP32
        if K < block_k:
            block_k = max(16, triton.next_power_of_2(K))
    return (*config, block_k)


def _launch(x2, w, bias, y, meta, M, N, K, E, tiles, grid_m, w_strides, y_strides, block_k, ragged=0):
    if x2.stride(1) != 1:
        # a transposed left operand (the weight gradients' dyᵀ) runs 2.5-3× slower in place on the
        # H200; a K-contiguous copy has the same values and the same K order
        x2 = x2.contiguous()
    compute = x2.dtype if x2.dtype == w.dtype else torch.float32
    # (ragged 2 reduces over each group's rows: K is not the launch's K there)
    block_m, block_n, group_m, num_warps, num_stages, block_k = launch_config(
        compute, N, K if ragged != 2 else block_k, block_k)
    if ragged == 0:
        grid_m = triton.cdiv(M, block_m)
    elif ragged == 2:
        grid_m = E * triton.cdiv(M, block_m)
    grid = (grid_m * triton.cdiv(N, block_n),)
    _bi_matmul_kernel[grid](
        x2, w, bias if bias is not None else y, y, meta if meta is not None else y, M, N, K, E, tiles,
        x2.stride(0), x2.stride(1), *w_strides, *y_strides,
        HAS_BIAS=bias is not None, UPCAST=x2.dtype != w.dtype, IEEE=compute == torch.float32, RAGGED=ragged,
        EVEN_K=ragged != 2 and K % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        num_warps=num_warps, num_stages=num_stages,
    )


def grouped_tile_map(starts, ends, rows: int, block_m: int) -> torch.Tensor:
    """Tile slots of the grouped launch: int32 ``[3, TILES]`` = (group, first row, end row) per slot,
    ``TILES = cdiv(rows, block_m) + E`` (static). Groups are ``[starts[e], ends[e])`` (int64 ``[E]``,
    non-decreasing, contiguous) plus a last pseudo-group ``E`` of the rows past ``ends[-1]`` (written
    as zeros); group g takes ``cdiv(count_g, block_m)`` consecutive slots, and since
    ``Σ_g cdiv(c_g, B) <= cdiv(Σ_g c_g, B) + (E + 1) - 1`` the E + 1 groups fit in TILES; excess slots
    carry group -1. Torch ops on the device (cumsum, searchsorted): no host read, CUDA-graph capturable."""
    E = starts.shape[0]
    starts = torch.cat([starts, ends[-1:]])
    ends = torch.cat([ends, ends.new_full((1,), rows)])
    per_group = torch.div(ends - starts + (block_m - 1), block_m, rounding_mode="floor")
    last = torch.cumsum(per_group, 0)  # one past each group's last slot
    slot = torch.arange(triton.cdiv(rows, block_m) + E, device=starts.device, dtype=last.dtype)
    group = torch.searchsorted(last, slot, right=True).clamp_(max=E)
    first_slot = last[group] - per_group[group]
    row0 = starts[group] + (slot - first_slot) * block_m
    group = torch.where(slot < last[-1], group, -1)
    return torch.stack([group, row0, ends[group.clamp(min=0)]]).to(torch.int32)


def bi_grouped_matmul(x, weight, starts, ends, out_dtype, block_k: int):
    """``y[r] = x[r] · weight[e]ᵀ`` for the rows r in ``[starts[e], ends[e])`` (int64 ``[E]`` from
    ``batch_invariant_reference.group_bounds``), zeros past ``ends[-1]``: ``x [M, K]``, ``weight
    [E, N, K]`` (any strides: the backward passes ``weightᵀ`` per group as a view) → contiguous
    ``[M, N]`` in ``out_dtype``. Each program computes one ``[BLOCK_M, BLOCK_N]`` tile of ONE group
    with the dense kernel's tile configuration and K loop, so a row's value is the one
    :func:`bi_matmul` gives it alone (on the GPU; under the interpreter with the ordered dot)."""
    M, K = x.shape
    E, N = weight.shape[0], weight.shape[1]
    y = torch.empty((M, N), device=x.device, dtype=out_dtype)
    if M == 0:
        return y
    compute = x.dtype if x.dtype == weight.dtype else torch.float32
    meta = grouped_tile_map(starts, ends, M, launch_config(compute, N, K, block_k)[0])
    tiles = meta.shape[1]
    _launch(x, weight, None, y, meta, M, N, K, E, tiles, tiles, weight.stride(), (0, *y.stride()), block_k, ragged=1)
    return y


def bi_grouped_matmul_wgrad(dy, x, starts, ends, out_dtype, block_k: int):
    """``dweight[e] = dy[g]ᵀ · x[g]`` over the rows g in ``[starts[e], ends[e])``: ``dy [M, N]``,
    ``x [M, K]`` → contiguous ``[E, N, K]`` in ``out_dtype``, FP32 accumulation. The dense tile loop
    with the reduction over the group's rows in blocks of ``block_k`` rows, ascending from the
    group's first row (the order of ``bi_matmul(dy[g]ᵀ, x[g]ᵀ)``, no split); a group without rows
    stores exact zeros. Grid: E · tiles of ``[N, K]``, static."""
    M, N = dy.shape
    K, E = x.shape[1], starts.shape[0]
    dw = torch.empty((E, N, K), device=dy.device, dtype=out_dtype)
    meta = torch.stack([starts, ends]).to(torch.int32)
    # the dense kernel on dyᵀ [N, M] and xᵀ as the weight [K, M]: output rows N, columns K, reduction M
    dyt = dy.t()
    # (the K argument is unused there, the bounds come from meta: 0 keeps one compiled variant for every M)
    _launch(dyt, x.t(), None, dw, meta, N, K, 0, E, 0, 0, (0, *x.t().stride()), dw.stride(), block_k, ragged=2)
    return dw
