"""CUDA kernels of the KPool indexer ops, written in Triton (``triton>=3.6``), one file per stage:

- :mod:`.compress`: ``glm53::kpool_compress`` (all four modes) and ``glm53::kpool_quant_query``,
  bitwise equal to the CPU reference (see that module for the one ``exp`` caveat);
- :mod:`.score`: ``glm53::kpool_logits`` into the padded MQA workspace (FP32 accumulation, ~1e-8
  relative to the reference);
- :mod:`.select`: ``glm53::kpool_select`` (top pools per query, lower slot wins ties).

Every launch takes its grid from static shapes and never reads device data on the host, so the
indexer captures into a CUDA graph. Imported lazily by :mod:`inductor_ext.ops.kpool` when the
``triton`` back-end is available; the kernels also run on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from inductor_ext.kernels.kpool.compress import kpool_compress_fwd, kpool_quant_query_fwd
from inductor_ext.kernels.kpool.score import kpool_logits_fwd
from inductor_ext.kernels.kpool.select import kpool_select_fwd

__all__ = ["kpool_compress_fwd", "kpool_quant_query_fwd", "kpool_logits_fwd", "kpool_select_fwd"]
