"""Public entry points of the ``glm53`` ops: thin wrappers over ``torch.ops.glm53.*``.

One module per op family (``kda``, ``kpool``, ``fp32_linear``, ``layer_norm_fp32``, ``swiglu``,
``fp8_qdq``, ``mhc``, ``mhc_batch_invariant``, ``round_to``, ``sparse_mla``, ``batch_invariant``,
``token_logprobs``),
each holding the family's schemas, kernels, autograd and public wrapper; this package re-exports the
wrappers. Each wrapper checks its inputs (``ValueError`` naming the rule, compiled with
``fullgraph=True`` too: :mod:`inductor_ext.ops._checks`), resolves a precision
argument left ``None`` from the active :class:`~inductor_ext.PrecisionConfig` while tracing (so the
choice is a literal in the graph) and calls the op. Data-dependent checks (finite gates, sorted
offsets) synchronise with the host, so they run only in eager mode: never while Dynamo traces or a
CUDA graph is captured.
Importing this package defines every op and then registers the fake kernels of :mod:`fake_impls`."""

from __future__ import annotations

import fake_impls
import inductor_ext.ops.round_to  # noqa: F401  (defines glm53::round_to, the lowerings' rounding point)
from inductor_ext.ops.batch_invariant import (
    bi_grouped_linear,
    bi_layer_norm,
    bi_linear,
    bi_log_softmax,
    bi_rms_norm,
    bi_row_sum,
)
from inductor_ext.ops.fp8_qdq import fp8_qdq
from inductor_ext.ops.fp32_linear import fp32_linear
from inductor_ext.ops.kda import kda_chunk, kda_recurrent
from inductor_ext.ops.kpool import (
    kpool_compress,
    kpool_layout,
    kpool_logits,
    kpool_project,
    kpool_quant_query,
    kpool_select,
)
from inductor_ext.ops.kpool_pipeline import kpool_indexer
from inductor_ext.ops.layer_norm_fp32 import layer_norm_fp32
from inductor_ext.ops.mhc import mhc_post, mhc_pre
from inductor_ext.ops.mhc_batch_invariant import bi_mhc_coefficients, mhc_post_batch_invariant, mhc_pre_batch_invariant
from inductor_ext.ops.sparse_mla import sparse_mla
from inductor_ext.ops.swiglu import swiglu
from inductor_ext.ops.token_logprobs import token_logprobs

# imported first, fake_impls is still initializing here (its fakes import op leaves, which import
# this package): it registers the fakes itself once it is complete
if hasattr(fake_impls, "register_all"):
    fake_impls.register_all()

__all__ = [
    "kda_chunk",
    "kda_recurrent",
    "fp32_linear",
    "layer_norm_fp32",
    "swiglu",
    "fp8_qdq",
    "mhc_pre",
    "mhc_post",
    "mhc_pre_batch_invariant",
    "mhc_post_batch_invariant",
    "kpool_project",
    "kpool_layout",
    "kpool_compress",
    "kpool_quant_query",
    "kpool_logits",
    "kpool_select",
    "kpool_indexer",
    "sparse_mla",
    "bi_linear",
    "bi_grouped_linear",
    "bi_rms_norm",
    "bi_layer_norm",
    "bi_log_softmax",
    "bi_row_sum",
    "bi_mhc_coefficients",
    "token_logprobs",
]
