"""Fake of ``glm53::input_error``: raises :class:`~inductor_ext.ops._checks.InputError`, so that a bad
argument found while Dynamo traces reaches the caller as the op's own ``ValueError``
(``inductor_ext/ops/_checks.py`` says why through a fake kernel)."""

from __future__ import annotations

from inductor_ext.ops._checks import InputError

__all__ = ["FAKES", "input_error_fake"]


def input_error_fake(message):
    """Raise the bad-argument error ``message``; never returns."""
    raise InputError(message)


FAKES = {
    "glm53::input_error": input_error_fake,
}
