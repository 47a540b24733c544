"""Fake (meta) kernels of the ``glm53`` ops: output shapes, dtypes and strides, no data.

One module per op family, named like the op's module in ``inductor_ext/ops``. Importing this
package registers every fake; ``inductor_ext.ops`` does so after defining the ops.
"""

from fake_impls import kda  # noqa: F401
from fake_impls import fp8_qdq, fp32_linear, layer_norm_fp32, mhc, swiglu  # noqa: F401

__all__ = ["kda"]
__all__ += ["fp32_linear", "layer_norm_fp32", "swiglu", "fp8_qdq", "mhc"]
from fake_impls import kpool, round_to  # noqa: F401, E402

__all__ += ["kpool", "round_to"]
