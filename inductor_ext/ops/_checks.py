"""Input checks shared by the op families (``docs/DESIGN.md`` §6).

Every wrapper's check raises through :func:`input_error`: ``raise input_error(f"op: rule, got ...")``.
In eager mode that is a plain raise of :class:`InputError` (a ``ValueError``). While Dynamo traces,
an exception raised by the traced code reaches a ``fullgraph=True`` caller as
``torch._dynamo.exc.Unsupported`` ("Observed exception", a ``RuntimeError``), whatever its type,
also through ``torch._check`` / ``torch._check_value``. What Dynamo (torch 2.13) lets out unchanged
is an ``IndexError`` raised by a fake kernel during fake-tensor propagation (``run_node`` and
``convert_frame`` re-raise it as is, for dim-out-of-range errors). So :class:`InputError` is also an
``IndexError``, and under Dynamo :func:`input_error` calls ``glm53::input_error``, whose fake kernel
(``fake_impls/checks.py``) raises it: the caller of a compiled function gets the op's own exception
and message. ``tests/ops/test_bad_input_matrix.py`` pins this behaviour.

Static checks (types, shapes, dtypes, devices, python scalars) run always; data checks (finiteness,
signs, id ranges, offsets) read tensor values, which synchronises with the host, so they run in
:func:`eager` mode only. Offsets that shape an output (``cu_seqlens``) are asserted on the device
when traced or captured (:func:`check_cu_seqlens`).
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = ["InputError", "input_error", "eager", "tensors", "floats_on_one_device", "real", "integer",
           "check_cu_seqlens",
           "check_cu_seqlens_values"]


class InputError(ValueError, IndexError):
    """A bad argument of a ``glm53`` op: a ``ValueError`` whose message starts with the op's name.
    Also an ``IndexError`` only so that Dynamo re-raises it unchanged from a compiled call (module
    docstring); catch it as ``ValueError``."""


@torch.library.custom_op("glm53::input_error", mutates_args=())
def _input_error_op(message: str) -> None:
    """Raises :class:`InputError` (``message``); the fake kernel raises it too. What
    :func:`input_error` calls while Dynamo traces."""
    raise InputError(message)


def input_error(message: str) -> InputError:
    """The exception for a bad argument, to ``raise``. While Dynamo traces, raises it at once
    through ``glm53::input_error`` (module docstring); the return is then not reached."""
    if torch.compiler.is_compiling():
        torch.ops.glm53.input_error(message)
    return InputError(message)


def eager(*data: torch.Tensor | None) -> bool:
    """True outside Dynamo tracing and CUDA-graph capture, and when none of ``data`` (the tensors a
    check would read) is a fake tensor: only then may a check read data (which synchronises with
    the host)."""
    if torch.compiler.is_compiling():
        return False
    if any(isinstance(t, torch._subclasses.FakeTensor) for t in data):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def tensors(op: str, *, optional: tuple[str, ...] = (), **named) -> None:
    """Each named argument must be a ``torch.Tensor`` (those listed in ``optional`` may be ``None``);
    ``ValueError`` naming the first that is not."""
    for name, value in named.items():
        if value is None and name in optional:
            continue
        if not isinstance(value, torch.Tensor):
            raise input_error(f"{op}: {name} must be a tensor, got {type(value).__name__}")


FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def floats_on_one_device(op: str, named: dict) -> None:
    """``ValueError`` unless every tensor of ``named`` is bfloat16, float16 or float32 and all share
    one cpu or cuda device (checked in that order)."""
    for name, t in named.items():
        if t.dtype not in FLOATS:
            raise input_error(f"{op}: {name} must be bfloat16, float16 or float32, got {t.dtype}")
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise input_error(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    if next(iter(devices)).type not in ("cpu", "cuda"):
        raise input_error(f"{op}: tensors must be on cpu or cuda, got {next(iter(devices))}")


def real(op: str, name: str, value, *, gt: float | None = None, ge: float | None = None,
         le: float | None = None) -> float:
    """A finite python number (not ``bool``, not a tensor) within the given bounds, as ``float``."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and not isinstance(value, torch.Tensor)
    if ok:
        x = float(value)  # comparisons, not math.isfinite: a symbolic float (dynamic=True) only guards
        ok = -math.inf < x < math.inf and (gt is None or x > gt) and (ge is None or x >= ge) and (le is None or x <= le)
    if not ok:  # the message is built only here: formatting while traced would break the graph
        bounds = " and".join(f" {sym} {b:g}" for sym, b in ((">", gt), (">=", ge), ("<=", le)) if b is not None)
        raise input_error(f"{op}: {name} must be a finite number{bounds}, got {type(value).__name__} {value!r}")
    return float(value)


def integer(op: str, name: str, value, *, ge: int | None = None) -> int:
    """A python int (not ``bool``; a ``SymInt`` while traced with dynamic shapes) of at least ``ge``."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or (ge is not None and value < ge):
        what = "an int" + (f" >= {ge}" if ge is not None else "")
        raise input_error(f"{op}: {name} must be {what}, got {type(value).__name__} {value!r}")
    return value


def check_cu_seqlens(op: str, cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    """The values of ``cu_seqlens`` (non-decreasing from 0 to ``num_tokens``): in eager mode a host
    check (:func:`check_cu_seqlens_values`, ``ValueError``); traced or captured a device assertion
    (``torch._assert_async``: a ``RuntimeError`` on the CPU, a device-side assert on CUDA), so that
    offsets that end before T never give an output of the wrong length or unwritten rows."""
    if eager(cu_seqlens):
        check_cu_seqlens_values(op, cu_seqlens, num_tokens)
        return
    ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == num_tokens) & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
    # the message names no size: formatting a symbolic T into it would specialize the graph on T
    torch._assert_async(ok, f"{op}: cu_seqlens must be non-decreasing from 0 to the token count T")


def check_cu_seqlens_values(op: str, cu_seqlens: torch.Tensor, num_tokens: int) -> None:
    """``cu_seqlens`` must be non-decreasing from 0 to ``num_tokens`` (reads the data: call it in
    eager mode only); ``ValueError`` prefixed with ``op`` otherwise."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != num_tokens or any(b < a for a, b in zip(cu, cu[1:])):
        raise input_error(f"{op}: cu_seqlens must be non-decreasing from 0 to T={num_tokens}, got {cu}")
