"""CUDA kernels of ``glm53::sparse_mla``: Triton :func:`sparse_mla_fwd` (``forward.py``) and
:func:`sparse_mla_bwd` (``backward.py``, deterministic fixed-point ``dkv``); the TileLang
forward and backward for sm_90 live in ``tilelang_forward.py`` and ``tilelang_backward.py``
(imported on their own: they need the ``tilelang`` extra when a kernel is built), with what they
share in ``tilelang_common.py``.

The Triton modules import only torch and triton, so a GPU machine can load them by path without
the package (``importlib.util.spec_from_file_location``)."""

from .backward import fixed_point_scale, row_scales, sparse_mla_bwd
from .forward import sparse_mla_fwd

__all__ = ["sparse_mla_fwd", "sparse_mla_bwd", "fixed_point_scale", "row_scales"]
