"""CUDA kernels of the ``batch_invariant`` family (``glm53::bi_*``), written in Triton (``triton>=3.6``):

- :mod:`.matmul`: ``glm53::bi_linear``, one program per output tile over the full K (fixed K block,
  no split-K, one fixed tile configuration per compute dtype, no autotuning), and in the same
  kernel ``glm53::bi_grouped_linear`` (tiles of one group each, from a device-side tile map) and
  its weight gradient;
- :mod:`.norms`: ``glm53::bi_rms_norm``, ``bi_layer_norm``, ``bi_log_softmax`` and ``bi_row_sum``,
  one program per row with a fixed lane loop and an explicit halving tree;
- :mod:`.mhc`: ``glm53::bi_mhc_coefficients`` (mHC's sigmoids, softmax and Sinkhorn), one program
  per block of rows, each row's tile in registers (imported on its own by the op).

Block sizes come from the caller (``inductor_ext.ops.batch_invariant_reference``); these modules
import only torch and triton. Grids come from static shapes and no launch reads device data, so
the kernels capture into CUDA graphs. Imported lazily by :mod:`inductor_ext.ops.batch_invariant`
when the ``triton`` back-end is available; they also run on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from inductor_ext.kernels.batch_invariant.matmul import (
    CONFIGS,
    bi_grouped_matmul,
    bi_grouped_matmul_wgrad,
    bi_matmul,
    grouped_tile_map,
    launch_config,
)
from inductor_ext.kernels.batch_invariant.norms import (
    MAX_BLOCK,
    bi_layer_norm_rows,
    bi_log_softmax_rows,
    bi_rms_norm_rows,
    bi_row_sum_rows,
)

__all__ = ["CONFIGS", "MAX_BLOCK", "launch_config", "bi_matmul", "bi_grouped_matmul", "bi_grouped_matmul_wgrad",
           "grouped_tile_map",
           "bi_rms_norm_rows", "bi_layer_norm_rows", "bi_log_softmax_rows", "bi_row_sum_rows"]
