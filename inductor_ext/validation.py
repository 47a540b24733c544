"""Field checks shared by the configuration dataclasses (``docs/DESIGN.md`` §6: bad input raises
``ValueError`` naming the field and the rule).

A leaf: imports nothing of the project and not torch, so :mod:`inductor_ext.config` and every other
config (``graphs.GLM53Config``, ``MismatchSettings``, the benchmarks' settings) can use it.

A *rule* is a callable ``rule(label, value) -> value`` that raises ``ValueError`` starting with
``label`` (e.g. ``"GLM53Config.hidden_size"``) or returns the value, normalized (an integral number
as ``int``, a real one as ``float``, a sequence as a tuple). The factories below build rules;
:func:`check_fields` applies a table of them to a (frozen) dataclass in its ``__post_init__`` and
refuses a table that leaves a field out, so a new field cannot go unchecked.

Ints are real ints (``bool`` and ``float`` are refused, ``256.0`` too); reals are finite numbers
(``bool``, ``nan`` and ``inf`` refused).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Callable, Iterable, Mapping

__all__ = ["Rule", "integer", "real", "boolean", "one_of", "text", "optional", "sequence", "callable_",
           "check_fields", "describe"]

Rule = Callable[[str, object], object]


def describe(value: object) -> str:
    """``value`` for an error message: its type and repr (``float 256.0``, ``bool True``)."""
    return f"{type(value).__name__} {value!r}"


def _bounds(minimum, maximum, kind: str) -> str:
    if minimum is not None and maximum is not None:
        return f"{kind} in [{minimum}, {maximum}]"
    if minimum == 1 and kind == "an int":
        return "a positive int"
    if minimum == 0 and kind == "an int":
        return "a non-negative int"
    return kind + (f" >= {minimum}" if minimum is not None else "") + (f" <= {maximum}" if maximum is not None else "")


def integer(minimum: int | None = None, maximum: int | None = None) -> Rule:
    """A real int (not ``bool``, not ``float``) in ``[minimum, maximum]`` (each bound optional)."""
    what = _bounds(minimum, maximum, "an int")

    def rule(label: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{label} must be {what}, got {describe(value)}")
        value = operator.index(value)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise ValueError(f"{label} must be {what}, got {value}")
        return value

    return rule


def real(*, gt: float | None = None, ge: float | None = None, lt: float | None = None) -> Rule:
    """A finite real number (an int is taken as a float; ``bool``, ``nan`` and ``inf`` are not)
    with the given strict lower (``gt``), lower (``ge``) and strict upper (``lt``) bounds."""
    what = "a finite number" + "".join(f" {op} {b}" for op, b in ((">", gt), (">=", ge), ("<", lt)) if b is not None)

    def rule(label: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{label} must be {what}, got {describe(value)}")
        x = float(value)
        if not math.isfinite(x) or (gt is not None and not x > gt) or (ge is not None and not x >= ge) \
                or (lt is not None and not x < lt):
            raise ValueError(f"{label} must be {what}, got {value!r}")
        return x

    return rule


def boolean() -> Rule:
    """``True`` or ``False`` (not ``0``, ``1`` or a string)."""
    def rule(label: str, value: object) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"{label} must be a bool, got {describe(value)}")
        return value

    return rule


def one_of(allowed: Iterable) -> Rule:
    """One of ``allowed`` (compared by type and value: ``True`` is not ``1``)."""
    allowed = tuple(allowed)

    def rule(label: str, value: object) -> object:
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise ValueError(f"{label} must be one of {allowed}, got {value!r}")
        return value

    return rule


def text() -> Rule:
    """A non-empty ``str``."""
    def rule(label: str, value: object) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError(f"{label} must be a non-empty str, got {describe(value)}")
        return value

    return rule


def optional(inner: Rule) -> Rule:
    """``None`` or what ``inner`` accepts."""
    def rule(label: str, value: object) -> object:
        return None if value is None else inner(label, value)

    return rule


def sequence(item: Rule, *, min_len: int = 0) -> Rule:
    """A list or tuple (not a string) of at least ``min_len`` entries, each accepted by ``item``;
    returned as a tuple. An entry's error names ``label[i]``."""
    def rule(label: str, value: object) -> tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ValueError(f"{label} must be a tuple or list, got {describe(value)}")
        if len(value) < min_len:
            raise ValueError(f"{label} must have at least {min_len} entries, got {len(value)}")
        return tuple(item(f"{label}[{i}]", v) for i, v in enumerate(value))

    return rule


def callable_() -> Rule:
    """A callable."""
    def rule(label: str, value: object) -> object:
        if not callable(value):
            raise ValueError(f"{label} must be callable, got {describe(value)}")
        return value

    return rule


def check_fields(obj: object, prefix: str, rules: Mapping[str, Rule]) -> None:
    """Apply ``rules`` (field name -> rule) to the dataclass ``obj`` in field order, labels
    ``prefix + name``, and store the normalized values (``object.__setattr__``: frozen classes
    too). A field without a rule, or a rule without a field, is a ``TypeError``: a programming
    error, every field must be checked."""
    names = [f.name for f in dataclasses.fields(obj)]
    missing, extra = set(names) - set(rules), set(rules) - set(names)
    if missing or extra:
        raise TypeError(f"{type(obj).__name__}: check_fields rules must cover exactly its fields; "
                        f"missing {sorted(missing)}, unknown {sorted(extra)}")
    for name in names:
        object.__setattr__(obj, name, rules[name](prefix + name, getattr(obj, name)))
