"""glm53-inductor: GLM-5.3 serving-aligned precision paths as torch.compile / Inductor custom ops.

Public surface::

    import inductor_ext
    inductor_ext.enable()                                 # idempotent
    cfg = inductor_ext.PrecisionConfig.serving_aligned()  # .reference(), .from_env(), PrecisionConfig(...)
    with inductor_ext.precision(cfg): ...                 # compile-time selection
    from inductor_ext import ops                          # ops.kda_chunk, ops.kda_recurrent, ...

Importing needs only torch; GPU kernels (triton, flash-linear-attention, ...) load lazily.
"""

from __future__ import annotations

from inductor_ext import ops  # noqa: E402  (registers the glm53 ops)
from inductor_ext._version import __version__  # noqa: E402
from inductor_ext.config import PrecisionConfig, active_config, precision  # noqa: E402
from inductor_ext.plugin import enable, is_enabled  # noqa: E402

__all__ = ["PrecisionConfig", "active_config", "enable", "is_enabled", "ops", "precision", "__version__"]
