"""CUDA kernels of ``glm53::kda_chunk`` / ``kda_chunk_bwd`` under precision ``"fp32"`` (K, V ≤ 128):
the own FP32-grade Triton kernels, :func:`.forward.kda_fp32_fwd` and :func:`.backward.kda_fp32_bwd`.

Residuals (``inductor_ext.ops.kda_reference.fp32_residual_shapes``): the forward keeps each chunk's Aqk,
A⁻¹ and k̂–k̂ decay products (chunk-major FP32, in the op's Aqk and Akk slots); the backward recomputes
the rest from the inputs. Empty residuals (a call made with ``residuals=False`` elsewhere) make the
backward recompute those too.

Modules, one per stage: :mod:`.primitives` (the tf32x3 split and dots), :mod:`.chunk_list`,
:mod:`.chunk` (the chunk kernel), :mod:`.solve` (A⁻¹, w and u), :mod:`.state` (the Triton state pass),
:mod:`.gluon_state` (the Gluon state pass on Hopper), :mod:`.output`, :mod:`.forward` (host side, the
Gluon/Triton choice), :mod:`.backward_state`, :mod:`.backward_chunk`, :mod:`.backward` (host side).
"""

from __future__ import annotations

import torch

from inductor_ext.kernels.kda_fp32.backward import kda_fp32_bwd
from inductor_ext.kernels.kda_fp32.forward import CAUSAL_LAUNCH, kda_fp32_fwd

__all__ = ["kda_chunk_fwd", "kda_chunk_bwd"]


def kda_chunk_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision, residuals):
    """(o in v's dtype, FP32 final state, five empty FP32 residuals, Aqk, (A⁻¹, k̂–k̂ products));
    precision "fp32_causal" takes the row-causal decay path (``kda_fp32_fwd(causal=True)``)."""
    causal = precision == "fp32_causal"
    o, final, *kept = kda_fp32_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, keep_a=residuals,
                                   causal=causal, **(CAUSAL_LAUNCH if causal else {}))
    # one tensor per output: a custom op's outputs must not alias each other
    empties = [q.new_empty(0, dtype=torch.float32) for _ in range(7 - len(kept))]
    return (o, final, *empties, *kept)


def kda_chunk_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision,
                  qn, kn, q_rstd, k_rstd, g_cumsum, Aqk, Akk, do, dht):
    """(dq, dk, dv, dg, dbeta, dh0) from the inputs and the forward's Aqk and (A⁻¹, k̂–k̂ products)."""
    given_a = (Aqk, Akk) if Aqk.numel() else None
    return kda_fp32_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, given_a=given_a)
