"""Fake (meta) kernels of the ``glm53`` ops: output shapes, dtypes and strides, no data.

One module per op family, named like the op's module in ``inductor_ext/ops``; each holds plain
functions and a ``FAKES`` table (op name → fake). Nothing registers on import: the op package
(:mod:`inductor_ext.ops`) calls :func:`register_all` once every op is defined.
"""

from __future__ import annotations

import sys

import torch

from fake_impls import (
    batch_invariant,
    checks,
    fp8_qdq,
    fp32_linear,
    kda,
    kpool,
    layer_norm_fp32,
    mhc,
    mhc_batch_invariant,
    round_to,
    sparse_mla,
    swiglu,
    token_logprobs,
)

__all__ = ["FAMILIES", "register_all"]

FAMILIES = (batch_invariant, checks, fp32_linear, fp8_qdq, kda, kpool, layer_norm_fp32, mhc, mhc_batch_invariant,
            round_to, sparse_mla, swiglu, token_logprobs)
_registered: set[str] = set()


def register_all() -> None:
    """Register every family's fakes with ``torch.library``; idempotent. The ops must be defined."""
    for family in FAMILIES:
        for name, fake in family.FAKES.items():
            if name not in _registered:
                torch.library.register_fake(name)(fake)
                _registered.add(name)


if getattr(sys.modules.get("inductor_ext.ops"), "__all__", None) is not None:
    register_all()  # this package was imported first: the ops exist now (see inductor_ext.ops)
