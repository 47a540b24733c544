"""Plain-torch reference of ``glm53::sparse_mla`` (DSA sparse attention, absorbed MLA form).

Contract (``docs/DESIGN.md`` §4 "sparse_mla"): every query row ``t`` attends, with all ``H`` heads,
only to the latent rows ``kv[j]`` listed in ``token_ids[t]`` (any order; ``-1`` entries, anywhere in
the row, are padding). Keys are the whole latent row (``D`` wide, shared by the heads), values its
first ``d_v`` columns::

    s[t,h,j] = scale · q[t,h,:] · kv[ids[t,j], :]              (FP32)
    lse[t,h] = log Σ_j exp s[t,h,j]                             (natural log, FP32)
    out[t,h] = Σ_j exp(s[t,h,j] − lse[t,h]) · kv[ids[t,j], :d_v]  (FP32 accumulation, one rounding)

A row without a valid id gives ``out = 0`` and ``lse = −inf``; a NaN in q or in a listed kv row gives
NaN (never 0: a NaN row must not look like a padding row). An id listed twice counts twice.

This module is a leaf (it imports only torch): the op module, the tests and the kernels' checks use
it. The kernels here gather the listed rows, so the largest intermediate is one chunk of query rows
times ``W`` listed keys (``[rows, W, max(D, H)]`` FP32, at most :data:`CHUNK_BYTES`); nothing is ever
``[T, S]``. The backward accumulates ``dkv`` with ``index_add_`` chunk after chunk, in a fixed order
(deterministic on the CPU; the CUDA fallback inherits ``index_add_``'s atomics).
"""

from __future__ import annotations

import torch

from inductor_ext.ops._checks import input_error, real, tensors

__all__ = [
    "CHUNK_BYTES",
    "FLOATS",
    "ID_DTYPES",
    "MAX_CUDA_DIM",
    "MAX_SCALE",
    "validate_sparse_mla_inputs",
    "check_sparse_mla_ids",
    "reference_chunk_rows",
    "sparse_mla_reference",
    "sparse_mla_bwd_reference",
]

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)
CHUNK_BYTES = 64 << 20  # one chunk of gathered FP32 rows (or of FP32 scores) in the reference
MAX_CUDA_DIM = 1024  # the Triton kernels hold a query row's D columns as at most 4 chunks of 256
# bound on the score scale: GLM-5.3's is qk_nope_head_dim^-0.5 (~0.09, ~0.16 with YaRN's mscale²);
# scores scale·q·k are FP32, and a scale far above 1 overflows them to inf (1e36: NaN out, lse inf)
MAX_SCALE = 1e4


def validate_sparse_mla_inputs(q, kv, token_ids, scale, d_v) -> None:
    """Static checks (shapes, dtypes, devices, d_v range, scale); ``ValueError`` naming the rule.

    ``q [T, H, D]`` and ``kv [S, D]`` of one float dtype (bf16, fp16 or fp32), ``token_ids [T, W]``
    int32/int64, ``H >= 1``, ``W >= 1``, ``S >= 1``, ``1 <= d_v <= D``, ``0 < scale <= MAX_SCALE``
    (finite), all on one cpu/cuda device; on CUDA ``D <= 1024`` (the Triton kernels' limit). Never
    reads data.
    """
    tensors("sparse_mla", q=q, kv=kv, token_ids=token_ids)
    if q.dim() != 3:
        raise input_error(f"sparse_mla: q must be 3-D [T, H, D], got shape {tuple(q.shape)}")
    if kv.dim() != 2:
        raise input_error(f"sparse_mla: kv must be 2-D [S, D], got shape {tuple(kv.shape)}")
    if token_ids.dim() != 2:
        raise input_error(f"sparse_mla: token_ids must be 2-D [T, W], got shape {tuple(token_ids.shape)}")
    T, H, D = q.shape
    if q.dtype not in FLOATS:
        raise input_error(f"sparse_mla: q must be bfloat16, float16 or float32, got {q.dtype}")
    if kv.dtype != q.dtype:
        raise input_error(f"sparse_mla: kv must have q's dtype {q.dtype}, got {kv.dtype}")
    if token_ids.dtype not in ID_DTYPES:
        raise input_error(f"sparse_mla: token_ids must be int32 or int64, got {token_ids.dtype}")
    if H < 1:
        raise input_error(f"sparse_mla: q needs H >= 1 heads, got shape {tuple(q.shape)}")
    if D < 1 or kv.shape[1] != D:
        raise input_error(f"sparse_mla: kv must be [S, D={D}] (q's last dim), got {tuple(kv.shape)}")
    if kv.shape[0] < 1:
        raise input_error(f"sparse_mla: kv needs S >= 1 rows, got shape {tuple(kv.shape)}")
    if token_ids.shape[0] != T:
        raise input_error(f"sparse_mla: token_ids must be [T={T}, W], got {tuple(token_ids.shape)}")
    if token_ids.shape[1] < 1:
        raise input_error(f"sparse_mla: token_ids needs W >= 1 columns, got {tuple(token_ids.shape)}")
    if isinstance(d_v, bool) or not isinstance(d_v, int) or not 1 <= d_v <= D:
        raise input_error(f"sparse_mla: d_v must be an int with 1 <= d_v <= D={D}, got {d_v!r}")
    real("sparse_mla", "scale", scale, gt=0, le=MAX_SCALE)
    devices = {t.device for t in (q, kv, token_ids)}
    if len(devices) != 1:
        raise input_error(f"sparse_mla: q, kv and token_ids must be on one device, got {sorted(map(str, devices))}")
    if q.device.type not in ("cpu", "cuda"):
        raise input_error(f"sparse_mla: tensors must be on cpu or cuda, got {q.device}")
    if q.device.type == "cuda" and D > MAX_CUDA_DIM:
        raise input_error(f"sparse_mla: on CUDA D must be <= {MAX_CUDA_DIM}, got D={D}")


def check_sparse_mla_ids(token_ids: torch.Tensor, num_keys: int) -> None:
    """Every id must be -1 (padding) or a row of kv, ``0 <= id < S``. Reads the data (a host
    synchronisation on CUDA): call it in eager mode only."""
    if token_ids.numel() == 0:  # T = 0
        return
    lo, hi = (int(v) for v in torch.aminmax(token_ids))
    if lo < -1 or hi >= num_keys:
        raise input_error(f"sparse_mla: token_ids must be -1 or in [0, S={num_keys}), got values in [{lo}, {hi}]")


def reference_chunk_rows(W: int, D: int, H: int, budget: int | None = None) -> int:
    """Query rows per chunk: ``rows · W · max(D, H) · 4 <= budget`` (default :data:`CHUNK_BYTES`;
    at least one row)."""
    budget = CHUNK_BYTES if budget is None else budget
    return max(1, budget // (W * max(D, H) * 4))


def _gather(kv: torch.Tensor, ids: torch.Tensor):
    """FP32 rows ``kv[ids]`` ([rows, W, D]; zeros at padding, as the kernels' masked loads: a NaN in
    row 0 must not reach a row that only pads) and the validity mask [rows, W]."""
    valid = ids >= 0
    rows = kv[ids.clamp_min(0)].float()
    return rows.masked_fill_(~valid[..., None], 0.0), valid


def _probabilities(qf, g, valid, scale):
    """Masked scores ``scale · q·k`` [rows, H, W] FP32 (``-inf`` at padding)."""
    s = torch.matmul(qf, g.transpose(1, 2)).mul_(scale)
    return s.masked_fill_(~valid[:, None, :], float("-inf"))


def sparse_mla_reference(q, kv, token_ids, scale: float, d_v: int):
    """Forward on any device: ``(out [T, H, d_v] q.dtype, lse [T, H] fp32)``, chunked over query rows."""
    T, H, D = q.shape
    W = token_ids.shape[1]
    out = q.new_empty(T, H, d_v)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    rows = reference_chunk_rows(W, D, H)
    with torch.autocast(q.device.type, enabled=False):
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            g, valid = _gather(kv, token_ids[t0:t1].long())
            s = _probabilities(q[t0:t1].float(), g, valid, scale)
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            e = torch.exp(s - m)  # exp(-inf) = 0 at padding
            l = e.sum(-1, keepdim=True)  # [rows, H, 1]
            o = torch.matmul(e, g[..., :d_v]) / l
            # a row without a valid id (l = 0) gives 0; NaN (from q or kv) stays NaN: never `l > 0`
            o = torch.where(l == 0, torch.zeros_like(o), o)
            out[t0:t1] = o.to(q.dtype)
            lse[t0:t1] = (torch.log(l) + m).squeeze(-1)  # log 0 = -inf
    return out, lse


def sparse_mla_bwd_reference(q, kv, token_ids, out, lse, dout, dlse, scale: float, d_v: int):
    """Backward on any device: ``(dq [T, H, D] q.dtype, dkv [S, D] kv.dtype)`` of the loss whose
    gradients at ``(out, lse)`` are ``(dout, dlse)``; ids get none.

    Per chunk of query rows (FP32): ``p = exp(s − lse)``, ``dp = dO·vᵀ``,
    ``ds = scale · p · (dp − (Σ dO·out − dlse))``, ``dq = ds·k``; each listed key gets
    ``dsᵀ·q`` (all D columns) plus ``pᵀ·dO`` (first d_v columns), added into an FP32 ``dkv`` with
    ``index_add_`` in chunk order. Both gradients are rounded once, at the end.
    """
    T, H, D = q.shape
    W = token_ids.shape[1]
    dq = q.new_empty(T, H, D)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    rows = reference_chunk_rows(W, D, H)
    with torch.autocast(q.device.type, enabled=False):
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            ids = token_ids[t0:t1].long()
            g, valid = _gather(kv, ids)
            qf = q[t0:t1].float()
            s = _probabilities(qf, g, valid, scale)
            p = torch.exp(s - lse[t0:t1, :, None].float())
            p = torch.where(valid[:, None, :], p, torch.zeros_like(p))
            do = dout[t0:t1].float()
            delta = (do * out[t0:t1].float()).sum(-1) - dlse[t0:t1].float()  # [rows, H]
            dp = torch.matmul(do, g[..., :d_v].transpose(1, 2))
            ds = p * (dp - delta[..., None]) * scale
            dq[t0:t1] = torch.matmul(ds, g).to(q.dtype)
            dk = torch.matmul(ds.transpose(1, 2), qf)  # [rows, W, D]
            dk[..., :d_v] += torch.matmul(p.transpose(1, 2), do)
            flat = valid.reshape(-1)
            dkv.index_add_(0, ids.reshape(-1)[flat], dk.reshape(-1, D)[flat])
    return dq, dkv.to(kv.dtype)
