"""CUDA kernel of ``glm53::token_logprobs``: :func:`token_logprobs_fwd` (``forward.py``), the
vocabulary chunks' logits from a caller-given GEMM and, in Triton, the online log-sum-exp, the
target gather and the final log-probabilities and entropy. Imports only torch and triton (block
sizes and the chunk come from :mod:`inductor_ext.ops.token_logprobs_reference`); runs on CPU tensors
under ``TRITON_INTERPRET=1``."""

from .forward import token_logprobs_fwd

__all__ = ["token_logprobs_fwd"]
