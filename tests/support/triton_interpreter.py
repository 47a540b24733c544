"""Workarounds for Triton 3.6 interpreter bugs that do not exist on the GPU, shared by the tests
that run the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``."""

import numpy as np


def apply_interpreter_shims():
    """Work around three Triton 3.6 interpreter bugs that do not exist on the GPU: ``range(n)`` over a
    runtime int fails with numpy >= 2.4 (``int()`` of a 1-element array), ``tl.dot`` multiplies
    BF16 operands as their raw uint16 storage, and ``tl.minimum`` / ``tl.maximum`` (and so
    ``tl.min`` / ``tl.max``) propagate NaN where the GPU's min.f32 / max.f32 return the other operand."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if getattr(interp, "_glm53_shimmed", False):
        return
    patch_tensor = interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = _patch_lang_tensor
    create_dot = interp.InterpreterBuilder.create_dot

    def _dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def f32(h):
            if h.dtype.scalar != tl.bfloat16:
                return h
            data = interp._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interp.TensorHandle(data, tl.float32)

        return create_dot(self, f32(a), f32(b), d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = _dot
    interp.InterpreterBuilder.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)
    interp.InterpreterBuilder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
    interp._glm53_shimmed = True


def interpreter_kernels(package: str, test_file: str, *shims):
    """The kernel package ``package`` for tests on CPU tensors: skips unless ``TRITON_INTERPRET=1``
    (naming the command for ``test_file``), applies :func:`apply_interpreter_shims` and each of
    ``shims`` (callables), then imports the package."""
    import importlib
    import os

    import pytest

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(f"interpreter tests: run `TRITON_INTERPRET=1 pytest {test_file}` (own process)")
    apply_interpreter_shims()
    for shim in shims:
        shim()
    return importlib.import_module(package)
