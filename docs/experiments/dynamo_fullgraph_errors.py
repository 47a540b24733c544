"""Which way of raising a bad-input error reaches the caller of ``torch.compile(fn, fullgraph=True)`` as
a ``ValueError`` (or with the op's own message first) in this torch: the experiment behind
``inductor_ext/ops/_checks.py`` (``docs/DESIGN.md`` §6). Prints one line per mechanism: the exception
type the caller gets, whether it is a ``ValueError``, and the first line of its message.

    python docs/experiments/dynamo_fullgraph_errors.py
"""

from __future__ import annotations

import torch
import torch._dynamo


class ValueIndexError(ValueError, IndexError):
    pass


@torch.library.custom_op("experiment::checked", mutates_args=())
def _checked(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_checked.register_fake
def _(x):
    if x.shape[-1] % 128:
        raise ValueError("checked: bad shape (fake kernel)")
    return x.new_empty(x.shape)


@torch.library.custom_op("experiment::checked_index", mutates_args=())
def _checked_index(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_checked_index.register_fake
def _(x):
    if x.shape[-1] % 128:
        raise ValueIndexError("checked_index: bad shape (fake kernel, ValueError + IndexError)")
    return x.new_empty(x.shape)


@torch.library.custom_op("experiment::fail", mutates_args=())
def _fail(message: str) -> None:
    raise ValueIndexError(message)


@_fail.register_fake
def _(message):
    raise ValueIndexError(message)


@torch._dynamo.assume_constant_result
def _constant_check(n):
    if n % 128:
        raise ValueError("op: assume_constant_result")
    return True


@torch.compiler.disable
def _disabled_check(n):
    if n % 128:
        raise ValueError("op: compiler.disable")


@torch._dynamo.error_on_graph_break(False)
def _lenient_check(n):
    if n % 128:
        raise ValueError("op: error_on_graph_break(False)")


def _raise(x):
    if x.shape[-1] % 128:
        raise ValueError("op: plain raise")
    return x + 1


def _raise_index(x):
    if x.shape[-1] % 128:
        raise ValueIndexError("op: plain raise of a ValueError + IndexError")
    return x + 1


MECHANISMS = {
    "raise ValueError": _raise,
    "raise ValueError+IndexError": _raise_index,
    "torch._check": lambda x: (torch._check(x.shape[-1] % 128 == 0, lambda: "op: _check"), x + 1)[1],
    "torch._check_value": lambda x: (torch._check_value(x.shape[-1] % 128 == 0, lambda: "op: _check_value"), x)[1],
    "torch._check_with(ValueError)": lambda x: (
        torch._check_with(ValueError, x.shape[-1] % 128 == 0, lambda: "op: _check_with"), x)[1],
    "fake kernel raises ValueError": lambda x: _checked(x),
    "fake kernel raises ValueError+IndexError": lambda x: _checked_index(x),
    "op without tensors, fake raises ValueError+IndexError": lambda x: (
        _fail("op: through a failing op") if x.shape[-1] % 128 else None, x)[1],
    "assume_constant_result": lambda x: (_constant_check(x.shape[-1]), x)[1],
    "compiler.disable": lambda x: (_disabled_check(x.shape[-1]), x)[1],
    "error_on_graph_break(False)": lambda x: (_lenient_check(x.shape[-1]), x)[1],
}


def main() -> None:
    x = torch.randn(2, 100)
    for name, fn in MECHANISMS.items():
        torch._dynamo.reset()
        try:
            torch.compile(fn, fullgraph=True, backend="eager")(x)
            print(f"{name:55s} no error")
        except Exception as e:  # noqa: BLE001  (what the caller gets is the measurement)
            print(f"{name:55s} {type(e).__name__:24s} ValueError={isinstance(e, ValueError)!s:5s} "
                  f"{str(e).splitlines()[0][:70]}")


if __name__ == "__main__":
    main()
