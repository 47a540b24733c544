"""CUDA kernels of ``glm53::kda_chunk`` / ``kda_chunk_bwd``: flash-linear-attention's KDA chunk
kernels (fla-core 0.6.0), called below its ``torch.compiler.disable``-wrapped public ``chunk_kda``.

Packed documents use fla's fixed-shape chunk list (``use_graph=True``): the number of chunk slots
is ``ceil(T/64) + N - 1`` from static shapes, so nothing synchronises with the host and the calls
can be captured in a CUDA graph. Precision "fp32" runs them (on FP32-promoted inputs, TF32 dots)
only for head dims above 128; below, ``inductor_ext.kernels.kda_fp32`` serves it.
"""

from __future__ import annotations

import torch
from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
from fla.ops.kda.chunk_bwd import chunk_kda_bwd as _fla_chunk_kda_bwd
from fla.ops.kda.chunk_fwd import chunk_kda_fwd as _fla_chunk_kda_fwd
from fla.ops.utils.index import prepare_chunk_indices_static

from inductor_ext.kernels.kda_fla.mask import zero_above_chunk_diagonal
from inductor_ext.ops.kda_reference import CHUNK, chunk_count, drop_residuals

__all__ = ["kda_chunk_fwd", "kda_chunk_bwd"]


def _compute_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _norm_input(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """q/k as l2norm's input: BF16 stays BF16 when the precision is FP32 (the norm kernel widens it
    exactly on load and writes FP32), saving a separate promotion pass; anything else is cast first."""
    keep = x.dtype == torch.bfloat16 and dt == torch.float32
    return (x if keep else x.to(dt)).contiguous()


def _chunk_list(q, cu_seqlens):
    if cu_seqlens is None:
        return None, None
    return prepare_chunk_indices_static(cu_seqlens, CHUNK, nt_max=chunk_count(q, cu_seqlens))


def kda_chunk_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision, residuals):
    """CUDA kernel of ``glm53::kda_chunk``: fla's l2norm + chunk_kda_fwd on q/k/v/beta in the
    precision's dtype (g as given: fla accumulates it in FP32); returns o (v's dtype), the FP32
    final state and the residuals (empty unless ``residuals``)."""
    out_dtype = v.dtype
    dt = _compute_dtype(precision)
    v, beta = (x.to(dt).contiguous() for x in (v, beta))
    qn, q_rstd = l2norm_fwd(_norm_input(q, dt), output_dtype=dt)
    kn, k_rstd = l2norm_fwd(_norm_input(k, dt), output_dtype=dt)
    chunk_indices, chunk_offsets = _chunk_list(q, cu_seqlens)
    o, final_state, g_cumsum, Aqk, Akk, *_ = _fla_chunk_kda_fwd(
        q=qn, k=kn, v=v, g=g.contiguous(), beta=beta, scale=scale,
        initial_state=None if initial_state is None else initial_state.contiguous(),
        output_final_state=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        chunk_size=CHUNK, use_graph=cu_seqlens is not None, chunk_offsets=chunk_offsets,
    )
    rstd_shape = q.shape[:3]
    out = (o.to(out_dtype), final_state, qn, kn, q_rstd.view(rstd_shape), k_rstd.view(rstd_shape), g_cumsum, Aqk, Akk)
    if not residuals:
        return drop_residuals(out)
    zero_above_chunk_diagonal(Aqk, chunk_indices, cu_seqlens)  # fla leaves it unwritten (torch.empty)
    return out


def kda_chunk_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision,
                  qn, kn, q_rstd, k_rstd, g_cumsum, Aqk, Akk, do, dht):
    """CUDA kernel of ``glm53::kda_chunk_bwd``: fla's chunk_kda_bwd (recomputing w, u, h from the
    residuals) + l2norm backward; gradients in their inputs' dtypes, dh0 FP32."""
    dt = _compute_dtype(precision)
    v_c, beta_c = v.to(dt).contiguous(), beta.to(dt).contiguous()
    chunk_indices, chunk_offsets = _chunk_list(q, cu_seqlens)
    dq, dk, dv, dbeta, dg, dh0, _, _ = _fla_chunk_kda_bwd(
        q=qn, k=kn, v=v_c, beta=beta_c, Aqk=Aqk, Akk=Akk, scale=scale,
        initial_state=None if initial_state is None else initial_state.contiguous(),
        do=do.to(dt).contiguous(), dht=None if dht is None else dht.contiguous(), g=g_cumsum,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=CHUNK,
        use_graph=cu_seqlens is not None, chunk_offsets=chunk_offsets,
    )
    dq = l2norm_bwd(qn, q_rstd.reshape(-1), dq)
    dk = l2norm_bwd(kn, k_rstd.reshape(-1), dk)
    # with use_graph=True fla returns dv and dh0 in module-global buffers that its next call
    # overwrites: copy them out (an op's outputs must not alias anything that outlives the call)
    if dh0 is None:  # no initial state: the op still returns a (zero) dh0
        n_states = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
        dh0 = q.new_zeros(n_states, q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
    elif cu_seqlens is not None:
        dh0 = dh0.clone()
    dv = dv.to(v.dtype, copy=cu_seqlens is not None)
    return dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype), dh0
