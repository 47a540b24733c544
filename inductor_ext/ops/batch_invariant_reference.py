"""Leaf of the ``batch_invariant`` family: constants, input checks and the plain-torch reference
kernels of ``glm53::bi_linear``, ``bi_grouped_linear`` (+ its weight gradient), ``bi_rms_norm``,
``bi_layer_norm``, ``bi_log_softmax`` and ``bi_row_sum`` (imports only torch).

Batch invariance: every output row is a bitwise function of that row's inputs (and the weights)
alone, whatever the number of rows M in the call, because every reduction runs in an order fixed
by the reduced length, never by M:

- **K reduction of bi_linear** (``x [M, K] · weight [N, K]ᵀ``): K is cut into blocks of
  :data:`BLOCK_K` (zero-padded at the end); each block's FP32 products are summed in ascending k,
  and the block sums are added to an FP32 accumulator in ascending block order (the structure of
  the Triton kernel's ``acc = dot(a_k, b_k, acc)`` loop; inside a block the GPU's MMA has its own
  fixed order, so GPU and CPU agree within a tolerance, each invariant). No split-K, no block size
  chosen from M.
- **Grouped linear** (MoE experts, ``x [M, K]`` rows sorted by group, ``weight [E, N, K]``):
  every group's rows run the bi_linear reference against that group's weight, so each row is
  bitwise the row computed alone by ``bi_linear``; the weight gradient of group e is the bi_linear
  reduction over that group's rows (blocks of :data:`BLOCK_K` rows from the group's first row).
- **Row reductions** (norm statistics, log-sum-exp, row sums): :data:`ROW_BLOCK` FP32 lanes; lane
  ``j`` accumulates elements ``j, j + ROW_BLOCK, j + 2·ROW_BLOCK, …`` in ascending order (padding
  adds the identity), then the halving tree folds the lanes. That is exactly the loop of the
  Triton kernels in ``inductor_ext/kernels/batch_invariant`` (one program per row).

Every step is an elementwise torch op on CPU (IEEE FP32 multiply, add, divide; IEEE sqrt through
FP64, :func:`sqrt_rn`; no fused
multiply-add; no ``torch.matmul`` and no torch reduction kernel, whose blocking may depend on the
shape), so the argument holds by construction: a row's elements see the same sequence of
operations whatever the other rows are. The tests check it bitwise for M = 1..64 and inside a 4096-row
call (``tests/ops/test_batch_invariant.py``).
"""

from __future__ import annotations

import torch

from inductor_ext.ops._checks import input_error, real, tensors

__all__ = [
    "BLOCK_K",
    "ROW_BLOCK",
    "FLOATS",
    "tree_sum",
    "tree_max",
    "lane_sum",
    "lane_max",
    "sqrt_rn",
    "validate_bi_linear_inputs",
    "validate_bi_grouped_linear_inputs",
    "group_bounds",
    "validate_bi_rms_norm_inputs",
    "validate_bi_layer_norm_inputs",
    "validate_bi_log_softmax_inputs",
    "validate_bi_row_sum_inputs",
    "bi_linear_reference",
    "bi_grouped_linear_reference",
    "bi_grouped_linear_wgrad_reference",
    "bi_rms_norm_reference",
    "bi_layer_norm_reference",
    "bi_log_softmax_reference",
    "bi_row_sum_reference",
    "rms_norm_output_dtype",
]

BLOCK_K = 64  # the K block of bi_linear: fixed, never chosen from M (no split-K)
ROW_BLOCK = 1024  # FP32 lanes of the row reductions (a power of two), fixed
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------
# fixed-order reductions (elementwise torch ops only)
# ---------------------------------------------------------------------------------------------


def tree_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by the halving tree ``t[:h] + t[h:]`` until one
    element remains: the order the Triton kernels' ``_tree_sum`` uses."""
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = t[..., :h] + t[..., h:]
    return t[..., 0]


def tree_max(t: torch.Tensor) -> torch.Tensor:
    """Max over the last dim (a power of two) by the halving tree, ``fmax`` (NaN-ignoring, as
    ``tl.maximum`` on the GPU)."""
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = torch.fmax(t[..., :h], t[..., h:])
    return t[..., 0]


def _lanes(x2: torch.Tensor, fill: float) -> torch.Tensor:
    """``x2 [R, L]`` padded with ``fill`` to a multiple of :data:`ROW_BLOCK`, viewed ``[R, blocks, lanes]``."""
    R, L = x2.shape
    blocks = max(1, -(-L // ROW_BLOCK))
    padded = x2.new_full((R, blocks * ROW_BLOCK), fill)
    padded[:, :L] = x2
    return padded.view(R, blocks, ROW_BLOCK)


def lane_sum(x2: torch.Tensor) -> torch.Tensor:
    """FP32 sum over the last dim of ``x2 [R, L]`` in the fixed lane order (module docstring) → ``[R]``."""
    blocks = _lanes(x2.float(), 0.0)
    acc = torch.zeros_like(blocks[:, 0])
    for b in range(blocks.shape[1]):
        acc = acc + blocks[:, b]
    return tree_sum(acc)


def lane_max(x2: torch.Tensor) -> torch.Tensor:
    """FP32 max over the last dim of ``x2 [R, L]`` in the fixed lane order (``fmax``) → ``[R]``."""
    blocks = _lanes(x2.float(), float("-inf"))
    acc = torch.full_like(blocks[:, 0], float("-inf"))
    for b in range(blocks.shape[1]):
        acc = torch.fmax(acc, blocks[:, b])
    return tree_max(acc)


def sqrt_rn(t: torch.Tensor) -> torch.Tensor:
    """IEEE (correctly rounded) FP32 square root: through FP64, exact after the one rounding back
    (53 >= 2·24 + 2 bits). torch's FP32 ``sqrt`` on CPU is not correctly rounded (it differs from
    IEEE in ~17% of uniform inputs in torch 2.13); the Triton kernels use ``sqrt_rn``."""
    return torch.sqrt(t.double()).float()


# ---------------------------------------------------------------------------------------------
# input checks (static: shapes, dtypes, devices; never data)
# ---------------------------------------------------------------------------------------------


def _floats(op: str, optional: tuple[str, ...] = (), **named) -> None:
    tensors(op, optional=optional, **named)
    for name, t in named.items():
        if t is not None and t.dtype not in FLOATS:
            raise input_error(f"{op}: {name} must be bfloat16, float16 or float32, got {t.dtype}")
    present = [t for t in named.values() if t is not None]
    devices = {t.device for t in present}
    if len(devices) != 1:
        raise input_error(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    if present[0].device.type not in ("cpu", "cuda"):
        raise input_error(f"{op}: tensors must be on cpu or cuda, got {present[0].device}")


def _last_dim(op: str, x) -> None:
    if x.dim() < 1 or x.shape[-1] < 1:
        raise input_error(f"{op}: x must be [..., D] with D >= 1, got {tuple(x.shape)}")


def _vector(op: str, name: str, t, d: int) -> None:
    if t is not None and tuple(t.shape) != (d,):
        raise input_error(f"{op}: {name} must be [D={d}], got {tuple(t.shape)}")


def _eps(op: str, eps) -> None:
    real(op, "eps", eps, gt=0)


def validate_bi_linear_inputs(x, weight, bias, out_dtype) -> None:
    """``x [..., K]``, ``weight [N, K]``, optional ``bias [N]`` (float dtypes, one device, K, N >= 1);
    ``out_dtype`` a float dtype. ``ValueError`` naming the rule."""
    op = "bi_linear"
    _floats(op, ("bias",), x=x, weight=weight, bias=bias)
    _last_dim(op, x)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.shape[0] < 1:
        raise input_error(f"{op}: weight must be [N >= 1, K={x.shape[-1]}], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise input_error(f"{op}: bias must be [N={weight.shape[0]}], got {tuple(bias.shape)}")
    if out_dtype not in FLOATS:
        raise input_error(f"{op}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")


def validate_bi_grouped_linear_inputs(x, weight, offs) -> None:
    """``x [M, K]`` (M >= 0, K >= 1), ``weight [E >= 1, N >= 1, K]`` (float dtypes), ``offs`` int32
    ``[E]``, all on one device. Static only: the offsets' values are checked by the wrapper in eager
    mode (non-decreasing, within [0, M]). ``ValueError`` naming the rule."""
    op = "bi_grouped_linear"
    tensors(op, offs=offs)
    _floats(op, x=x, weight=weight)
    if x.dim() != 2 or x.shape[1] < 1:
        raise input_error(f"{op}: x must be [M, K] with K >= 1, got {tuple(x.shape)}")
    if weight.dim() != 3 or weight.shape[0] < 1 or weight.shape[1] < 1 or weight.shape[2] != x.shape[1]:
        raise input_error(f"{op}: weight must be [E >= 1, N >= 1, K={x.shape[1]}], got {tuple(weight.shape)}")
    if offs.dtype != torch.int32:
        raise input_error(f"{op}: offs must be int32 (the end row of each group), got {offs.dtype}")
    if tuple(offs.shape) != (weight.shape[0],):
        raise input_error(f"{op}: offs must be [E={weight.shape[0]}], got {tuple(offs.shape)}")
    if offs.device != x.device:
        raise input_error(f"{op}: all tensors must be on one device, got {x.device} and offs on {offs.device}")


def validate_bi_rms_norm_inputs(x, weight, eps) -> None:
    """``x [..., D]``, ``weight [D]`` (float dtypes, one device), ``eps > 0``."""
    op = "bi_rms_norm"
    _floats(op, x=x, weight=weight)
    _last_dim(op, x)
    _vector(op, "weight", weight, x.shape[-1])
    _eps(op, eps)


def validate_bi_layer_norm_inputs(x, weight, bias, eps) -> None:
    """``x [..., D]``, optional ``weight [D]`` and ``bias [D]`` (float dtypes, one device), ``eps > 0``."""
    op = "bi_layer_norm"
    _floats(op, ("weight", "bias"), x=x, weight=weight, bias=bias)
    _last_dim(op, x)
    _vector(op, "weight", weight, x.shape[-1])
    _vector(op, "bias", bias, x.shape[-1])
    _eps(op, eps)


def validate_bi_log_softmax_inputs(x) -> None:
    """``x [..., V]`` with V >= 1, a float dtype, on cpu or cuda."""
    _floats("bi_log_softmax", x=x)
    _last_dim("bi_log_softmax", x)


def validate_bi_row_sum_inputs(x) -> None:
    """``x [..., L]`` with L >= 1, a float dtype, on cpu or cuda."""
    _floats("bi_row_sum", x=x)
    _last_dim("bi_row_sum", x)


# ---------------------------------------------------------------------------------------------
# reference kernels (every device; batch-invariant by construction)
# ---------------------------------------------------------------------------------------------


def bi_linear_reference(x, weight, bias, out_dtype):
    """``x [..., K] · weight [N, K]ᵀ (+ bias)`` in FP32: K in :data:`BLOCK_K` blocks (zero-padded),
    each block's products summed in ascending k, block sums added to the accumulator in ascending
    order, bias added last, one rounding to ``out_dtype`` → ``[..., N]`` contiguous."""
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    kp = -(-K // BLOCK_K) * BLOCK_K
    xt = x2.new_zeros((kp, M, 1), dtype=torch.float32)  # k-major columns of x, zero-padded
    xt[:K, :, 0] = x2.t()
    wt = weight.new_zeros((kp, 1, N), dtype=torch.float32)
    wt[:K, 0] = weight.t()
    acc = xt.new_zeros((M, N))
    part, product = torch.empty_like(acc), torch.empty_like(acc)
    for k0 in range(0, kp, BLOCK_K):
        torch.mul(xt[k0], wt[k0], out=part)  # every element: one FP32 product, then adds in k order
        for k in range(k0 + 1, k0 + BLOCK_K):
            torch.mul(xt[k], wt[k], out=product)
            part += product
        acc += part
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype).reshape(*x.shape[:-1], N)


def group_bounds(offs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, ends)`` int64 ``[E]`` of the groups of ``offs`` (``offs[e]`` the end row of group
    e, ``torch._grouped_mm``'s convention) over ``rows`` rows: group e is rows ``[ends[e-1],
    ends[e])`` (``ends[-1] := 0``). Torch ops on offs' device, no host read, so the CUDA kernels'
    tile map uses it too; offsets are clamped to ``[0, rows]`` and made non-decreasing (a running
    max), which leaves valid offsets unchanged and gives any other input one defined meaning on
    every device."""
    ends = torch.cummax(offs.to(torch.int64).clamp(0, rows), 0).values
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return starts, ends


def bi_grouped_linear_reference(x, weight, offs):
    """``y[r] = x[r] · weight[e]ᵀ`` for the rows r of group e (:func:`group_bounds`), each group by
    :func:`bi_linear_reference` in x's dtype, so every row is bitwise that row alone through
    bi_linear; rows past the last offset are 0 → ``[M, N]`` contiguous. Reads offs on the host."""
    M, N = x.shape[0], weight.shape[1]
    y = x.new_zeros((M, N))
    starts, ends = group_bounds(offs, M)
    for e, (lo, hi) in enumerate(zip(starts.tolist(), ends.tolist())):
        if hi > lo:
            y[lo:hi] = bi_linear_reference(x[lo:hi], weight[e], None, x.dtype)
    return y


def bi_grouped_linear_wgrad_reference(dy, x, offs, out_dtype):
    """The weight gradient of :func:`bi_grouped_linear_reference`: ``dweight[e] = dy[g]ᵀ · x[g]``
    over the rows g of group e (:func:`bi_linear_reference` of ``dy[g]ᵀ`` and ``x[g]ᵀ``: the
    reduction over the group's rows in blocks of :data:`BLOCK_K` rows, ascending from the group's
    first row), exact zeros for a group without rows → ``[E, N, K]`` in ``out_dtype``."""
    E, N, K = offs.shape[0], dy.shape[1], x.shape[1]
    dw = dy.new_zeros((E, N, K), dtype=out_dtype)
    starts, ends = group_bounds(offs, x.shape[0])
    for e, (lo, hi) in enumerate(zip(starts.tolist(), ends.tolist())):
        if hi > lo:
            dw[e] = bi_linear_reference(dy[lo:hi].t(), x[lo:hi].t(), None, out_dtype)
    return dw


def rms_norm_output_dtype(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """``weight · x̂.to(x.dtype)`` in torch's promotion of the two dtypes (the model's RMSNorm)."""
    return torch.promote_types(x_dtype, weight_dtype)


def bi_rms_norm_reference(x, weight, eps):
    """RMSNorm with the model's semantics (``graphs/modules.py`` RMSNorm): ``x̂ = x / sqrt(Σx²/D + eps)``
    in FP32 (fixed-order Σ, IEEE sqrt and divide), rounded to x's dtype, then ``weight · x̂`` computed
    in FP32 and rounded once to ``promote_types(x.dtype, weight.dtype)`` (what torch's ``weight * x̂``
    gives) → ``[..., D]`` contiguous."""
    D = x.shape[-1]
    xf = x.reshape(-1, D).float()
    s = sqrt_rn(lane_sum(xf * xf) / D + eps)
    n = (xf / s[:, None]).to(x.dtype).float()
    y = n * weight.float()
    return y.to(rms_norm_output_dtype(x.dtype, weight.dtype)).reshape(x.shape)


def _layer_norm_stats(xf):
    """Per row of FP32 ``xf [R, D]``: ``xc = x − μ`` and ``var = Σxc²/D`` (μ = Σx/D), fixed order."""
    D = xf.shape[-1]
    mean = lane_sum(xf) / D
    xc = xf - mean[:, None]
    return xc, lane_sum(xc * xc) / D


def bi_layer_norm_reference(x, weight, bias, eps):
    """LayerNorm in FP32: ``x̂ = (x − μ) / sqrt(var + eps)`` (biased variance, two fixed-order
    passes), ``y = x̂ · weight + bias`` (each optional, multiply then add), one rounding to x's dtype."""
    D = x.shape[-1]
    xc, var = _layer_norm_stats(x.reshape(-1, D).float())
    y = xc / sqrt_rn(var + eps)[:, None]
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(x.shape)


def bi_log_softmax_reference(x):
    """``log_softmax`` over the last dim in FP32: ``(x − m) − log Σ exp(x − m)`` with ``m`` the
    fixed-order ``fmax`` and the fixed-order sum → FP32 ``[..., V]`` contiguous."""
    V = x.shape[-1]
    xf = x.reshape(-1, V).float()
    m = lane_max(xf)
    z = xf - m[:, None]
    out = z - torch.log(lane_sum(torch.exp(z)))[:, None]
    return out.reshape(x.shape)


def bi_row_sum_reference(x):
    """FP32 sum over the last dim in the fixed lane order → FP32 ``[...]`` (the backward's reductions)."""
    L = x.shape[-1]
    return lane_sum(x.reshape(-1, L)).reshape(x.shape[:-1])
