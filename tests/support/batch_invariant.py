"""Helpers of the batch-invariance tests: the invariance checker, a planted batch-variant linear,
independent FP64 references, and two Triton-interpreter fixes these kernels need.

Written for the tests from the contract (``inductor_ext/ops/batch_invariant_reference.py``
docstring); the FP64 references share no code with ``inductor_ext``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

__all__ = [
    "bits",
    "assert_bitwise",
    "check_batch_invariance",
    "planted_linear",
    "linear_fp64",
    "grouped_linear_fp64",
    "grouped_case",
    "rms_norm_fp64",
    "layer_norm_fp64",
    "log_softmax_fp64",
    "rounding_floor",
    "rel_l2",
    "interpreter_numerics",
]

PROBES = 64  # rows computed alone, then inside calls of M = 1..PROBES rows and one big call
BIG = 4096
# the invariance tests of the model's pieces run on both (the cuda ones on the H200)
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.cuda))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as an integer tensor (so -0.0 != 0.0 and NaN == NaN of one payload)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{name}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}")
    bad = (bits(got.cpu()) != bits(want.cpu())).nonzero()
    assert bad.numel() == 0, f"{name}: {bad.shape[0]} of {got.numel()} elements differ, first at {bad[:4].tolist()}"


def check_batch_invariance(fn, inputs, *, sizes=range(1, PROBES + 1), big: int = BIG, seed: int = 0) -> list[str]:
    """Failures of the batch-invariance contract of ``fn`` (rows in → rows out), empty when it holds.

    ``inputs`` is a tensor or a tuple of tensors whose dim 0 is the row; ``fn(*rows)`` returns a
    tensor whose dim 0 is the row. The first ``max(sizes)`` rows are computed alone (one row per
    call); every call on the first M rows, M in ``sizes``, must give those rows bitwise, and so must
    one call of ``big`` rows (the probe rows among random filler rows, shuffled) at each probe
    row's new position."""
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    probes = max(sizes)
    alone = torch.cat([fn(*(t[i:i + 1] for t in inputs)) for i in range(probes)])
    failures = []
    for M in sizes:
        got = fn(*(t[:M] for t in inputs))
        bad = (bits(got) != bits(alone[:M])).reshape(M, -1).any(1).nonzero().flatten()
        if bad.numel():
            failures.append(f"M={M}: rows {bad.tolist()[:8]} differ from the rows computed alone")
    if big:
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(big, generator=g)
        batch = []
        for t in inputs:
            filler = torch.randn((big - probes, *t.shape[1:]), generator=g).to(t.device) * t[:probes].float().std()
            batch.append(torch.cat([t[:probes], filler.to(t.dtype)])[perm.to(t.device)])
        where = torch.argsort(perm)[:probes].to(alone.device)  # the new position of probe row i
        got = fn(*batch)[where]
        bad = (bits(got) != bits(alone)).reshape(probes, -1).any(1).nonzero().flatten()
        if bad.numel():
            failures.append(f"M={big} (shuffled): probe rows {bad.tolist()[:8]} differ from the rows computed alone")
    return failures


def _halving_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) by pairwise halving."""
    while t.shape[-1] > 1:
        t = t[..., : t.shape[-1] // 2] + t[..., t.shape[-1] // 2:]
    return t[..., 0]


def planted_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A PLANTED batch-variant linear (FP32 in and out): the K block is chosen from the row count
    (16 below 32 rows, 64 from there), as a heuristic that picks a reduction split by M would; each
    block summed by a halving tree, block sums in ascending order. Mathematically a matmul; its K
    order changes with M, so :func:`check_batch_invariance` must reject it."""
    M, K = x.shape
    block = 16 if M < 32 else 64
    kp = -(-K // block) * block
    xp, wp = torch.zeros(M, kp), torch.zeros(weight.shape[0], kp)
    xp[:, :K], wp[:, :K] = x, weight
    acc = torch.zeros(M, weight.shape[0])
    for k0 in range(0, kp, block):
        acc = acc + _halving_sum(xp[:, None, k0:k0 + block] * wp[None, :, k0:k0 + block])
    return acc


# ---------------------------------------------------------------------------------------------
# independent FP64 references (differentiable: their autograd is the FP64 VJP)
# ---------------------------------------------------------------------------------------------


def linear_fp64(x, w, b=None):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def grouped_linear_fp64(x, w, offs):
    """``torch._grouped_mm`` semantics in FP64: rows ``[offs[e-1], offs[e])`` times ``w[e]ᵀ``, rows
    past ``offs[-1]`` zero (valid offsets only; differentiable in x and w)."""
    ends = [0, *offs.tolist()]
    parts = [x[lo:hi].double() @ w[e].double().t() for e, (lo, hi) in enumerate(zip(ends, ends[1:]))]
    tail = x.new_zeros((x.shape[0] - ends[-1], w.shape[1]), dtype=torch.float64)
    return torch.cat([*parts, tail])


def grouped_case(probes, probe_groups, counts, *, generator, tail: int = 0):
    """One grouped call around the probe rows ``probes [P, K]``: group e holds ``counts[e]`` rows (at
    least its probes, the rest random filler), in a random order inside the group; ``tail`` filler
    rows follow the last group. ``probe_groups[i]`` is probe i's group. Returns ``(x, offs, where)``:
    the call's rows, int32 end offsets and ``where[i]``, the call row of probe i."""
    order = []
    for e, count in enumerate(counts):
        mine = [i for i, g in enumerate(probe_groups) if g == e]
        assert count >= len(mine), f"group {e}: {count} rows < {len(mine)} probes"
        group = torch.tensor(mine + [-1] * (count - len(mine)), dtype=torch.long)
        order.append(group[torch.randperm(count, generator=generator)])
    order = torch.cat([*order, torch.full((tail,), -1, dtype=torch.long)])
    filler = torch.randn((order.numel(), probes.shape[1]), generator=generator) * probes.float().std()
    x = filler.to(probes.dtype)
    x[order >= 0] = probes[order[order >= 0]]
    offs = torch.tensor(counts, dtype=torch.long).cumsum(0).to(torch.int32)
    where = torch.empty(len(probe_groups), dtype=torch.long)
    where[order[order >= 0]] = (order >= 0).nonzero().flatten()
    return x, offs, where


def rms_norm_fp64(x, w, eps):
    x = x.double()
    return w.double() * x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)


def layer_norm_fp64(x, w, b, eps):
    x = x.double()
    xc = x - x.mean(-1, keepdim=True)
    y = xc / torch.sqrt(xc.square().mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.double()
    return y if b is None else y + b.double()


def log_softmax_fp64(x):
    x = x.double()
    return x - torch.logsumexp(x, -1, keepdim=True)


def rel_l2(actual, expected) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def rounding_floor(ref64: torch.Tensor, dtype: torch.dtype) -> float:
    """Relative L2 error of rounding the FP64 result to ``dtype``: the best any kernel can do."""
    return rel_l2(ref64.to(dtype), ref64)


# ---------------------------------------------------------------------------------------------
# Triton interpreter (TRITON_INTERPRET=1) numerics
# ---------------------------------------------------------------------------------------------

_STORAGE = {torch.float32: np.float32, torch.bfloat16: np.uint16, torch.float16: np.float16}
_VIEW = {torch.float32: torch.float32, torch.bfloat16: torch.int16, torch.float16: torch.float16}


def _to_torch(handle_data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    arr = np.ascontiguousarray(handle_data)
    if dtype == torch.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(_VIEW[t.dtype]).numpy().view(_STORAGE[t.dtype])


def _ordered_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a [M, K] · b [K, N]`` with FP32 products summed in ascending k (the CPU reference's order
    inside a K block): each output element computed the same way wherever its row sits in the tile."""
    part = a[:, 0, None] * b[None, 0, :]
    for k in range(1, a.shape[1]):
        part = part + a[:, k, None] * b[None, k, :]
    return part


@contextlib.contextmanager
def interpreter_numerics(*, ordered_dot: bool):
    """Inside: the interpreter's float casts among fp32/bf16/fp16 round to nearest even through torch
    (Triton 3.6's numpy casts truncate fp32 -> bf16 in ``cast_impl`` and round half up, with a
    mantissa carry that corrupts the exponent, in ``create_fp_to_fp``; the GPU's ``cvt.rn`` is RNE).
    With ``ordered_dot``, ``tl.dot`` of 16/32-bit floats is :func:`_ordered_dot` (+ acc) instead of
    ``np.matmul`` + acc: OpenBLAS' sgemm rounds rows differently by their position in its
    micro-tiles (rows 6..11 of a 128-row tile differ from the same row at position 0), which a GPU
    MMA does not, so the interpreter could not show the kernel's invariance; the ordered dot's
    products and in-block order are the CPU reference's own, so the Triton matmul then matches the
    reference bitwise."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    names = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}
    builder = interp.InterpreterBuilder
    saved = builder.create_fp_to_fp, builder.cast_impl, builder.create_dot

    def convert(src, dst_type):
        s, d = names.get(src.dtype.scalar), names.get(dst_type.scalar)
        if s is None or d is None:
            return None
        return interp.TensorHandle(_to_numpy(_to_torch(src.data, s).to(d)), dst_type.scalar)

    def fp_to_fp(self, src, dst_type, rounding_mode):
        out = None if rounding_mode == interp._ir.ROUNDING_MODE.RTZ else convert(src, dst_type)
        return saved[0](self, src, dst_type, rounding_mode) if out is None else out

    def cast_impl(self, src, dst_type):  # fp_ext / fp_trunc (Triton 3.6 truncates fp32 -> bf16 here)
        out = convert(src, dst_type)
        return saved[1](self, src, dst_type) if out is None else out

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if names.get(a.dtype.scalar) is None or names.get(b.dtype.scalar) is None:
            return saved[2](self, a, b, d, input_precision, max_num_imprecise_acc)
        fa = _to_torch(a.data, names[a.dtype.scalar]).float().numpy()
        fb = _to_torch(b.data, names[b.dtype.scalar]).float().numpy()
        return interp.TensorHandle(d.data + _ordered_dot(fa, fb), d.dtype.scalar)

    builder.create_fp_to_fp, builder.cast_impl = fp_to_fp, cast_impl
    if ordered_dot:
        builder.create_dot = dot
    try:
        yield
    finally:
        builder.create_fp_to_fp, builder.cast_impl, builder.create_dot = saved
