"""``glm53::swiglu``: the clamped SwiGLU of GLM-5.3's MLPs and experts.

Contract (``docs/DESIGN.md`` §4), L = ``limit`` (``swiglu_limit`` = 10 in GLM-5.3)::

    y = silu(min(gate, L)) · clamp(up, −L, L)

- ``mode="native"``: transformers ``Glm5NextTextMLP`` semantics, every step in the input dtype
  (``F.silu`` rounds once to the input dtype, the product rounds again). The backward is the chain
  of autograd formulas transformers gets (``silu_backward`` and products in the input dtype).
- ``mode="serving"``: the serving engine's fused activation, FP32 throughout with silu written as
  ``g / (1 + exp(−g))``, one rounding to the input dtype. Backward in FP32, one rounding per input.
  Compiled by Inductor on CUDA, ``exp`` is the serving engine's own (``lowerings.swiglu.serving_exp``,
  bitwise LMDeploy's activation); the eager kernel uses ATen's ``expf``.

In both modes the clamps pass gradients where the input lies inside the closed interval (PyTorch's
``clamp`` convention), gradients are returned in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inductor_ext.config import SWIGLU_MODES as MODES
from inductor_ext.config import active_config
from inductor_ext.ops._checks import input_error, real, tensors

__all__ = ["swiglu", "MODES", "swiglu_reference", "validate_swiglu_inputs"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def validate_swiglu_inputs(gate, up, limit, mode) -> None:
    """Static checks (types, mode, limit, shapes, dtypes, devices); raise ``ValueError`` naming the rule."""
    tensors("swiglu", gate=gate, up=up)
    if mode not in MODES:
        raise input_error(f"swiglu: mode must be one of {MODES}, got {mode!r}")
    real("swiglu", "limit", limit, gt=0)
    if gate.shape != up.shape:
        raise input_error(f"swiglu: gate and up must share a shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype not in _FLOATS or up.dtype != gate.dtype:
        raise input_error(
            f"swiglu: gate and up must share a dtype among bfloat16, float16, float32, got {gate.dtype} and {up.dtype}"
        )
    if gate.device != up.device:
        raise input_error(f"swiglu: gate and up must be on one device, got {gate.device} and {up.device}")
    if gate.device.type not in ("cpu", "cuda"):
        raise input_error(f"swiglu: tensors must be on cpu or cuda, got {gate.device}")


def swiglu_reference(gate, up, limit, mode):
    """Plain-torch kernel (every device); output in the input dtype, see the module docstring."""
    if mode == "native":
        return (F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)).contiguous()
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(-limit, limit)
    return (g / (1.0 + torch.exp(-g)) * u).to(gate.dtype).contiguous()


_T = torch.Tensor


@torch.library.custom_op("glm53::swiglu", mutates_args=(), device_types=("cpu", "cuda"))
def _swiglu_op(gate: _T, up: _T, limit: float, mode: str) -> _T:
    """``silu(min(gate, limit)) · clamp(up, ±limit)``; gate, up ``[...]`` same shape and dtype,
    output in that dtype; ``mode`` "native" | "serving". Kernel: :func:`swiglu_reference`."""
    return swiglu_reference(gate, up, limit, mode)


def _setup_context(ctx, inputs, output):
    gate, up, limit, mode = inputs
    ctx.limit, ctx.mode = limit, mode
    ctx.save_for_backward(gate, up)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    L = ctx.limit
    gate_in = gate <= L  # clamp(max=L) passes the gradient where gate <= L
    up_in = (up >= -L) & (up <= L)
    if ctx.mode == "native":
        g, u = gate.clamp(max=L), up.clamp(-L, L)
        dg = torch.ops.aten.silu_backward(dy * u, g)
        du = dy * F.silu(g)
    else:
        g, u = gate.float().clamp(max=L), up.float().clamp(-L, L)
        dyf = dy.float()
        s = torch.sigmoid(g)
        dg = (dyf * u * (s * (1.0 + g * (1.0 - s)))).to(gate.dtype)
        du = (dyf * (g * s)).to(up.dtype)
    zero = dg.new_zeros(())
    return torch.where(gate_in, dg, zero), torch.where(up_in, du, zero), None, None


_swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate, up, *, limit=10.0, mode=None):
    """Clamped SwiGLU ``silu(min(gate, limit)) · clamp(up, ±limit)``, ``glm53::swiglu``.

    Args:
        gate, up: same shape ``[...]`` and dtype (bf16, fp16 or fp32).
        limit: ``swiglu_limit`` (> 0, GLM-5.3: 10).
        mode: ``"native"`` (transformers: every step in the input dtype) or ``"serving"`` (FP32
            with silu as ``g / (1 + exp(-g))``, one rounding); ``None`` takes
            ``PrecisionConfig.swiglu`` of the active config.

    Returns:
        ``[...]`` in the input dtype; differentiable in gate and up.
    """
    mode = active_config().swiglu if mode is None else mode
    validate_swiglu_inputs(gate, up, limit, mode)
    return torch.ops.glm53.swiglu(gate, up, float(limit), mode)
