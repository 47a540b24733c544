"""Bitwise comparison on CUDA with the serving engine's Triton kernels (LMDeploy 0.18.0).

Peers (imported, never copied into this repository; ``python scripts/fetch_lmdeploy_kernels.py``
extracts just these modules from LMDeploy's wheel into the git-ignored ``.lmdeploy/``, put it on ``PYTHONPATH``):

- ``lmdeploy.pytorch.kernels.cuda.blocked_gemm_fp8.quant_fp8(x, 128, float8_e4m3fn,
  scale_fmt="ue8m0")``: e4m3 values ``[M, K]`` and FP32 scales ``[M, K/128]`` (row-major; the
  scale is the power of two itself, not an exponent byte). Against ``ops.fp8_qdq(x, "ue8m0")``.
- ``lmdeploy.pytorch.kernels.cuda.moe.v4_swiglu_quant.v4_swiglu_and_quant_fp8(gate_up, limit)``:
  gate_up ``[M, 2I]`` (gate = first half, up = second half), FP32
  ``min(g, L) / (1 + exp(-min(g, L))) * clamp(u, ±L)`` rounded once to gate_up's dtype (the "BF16
  activation"), then quantized like ``quant_fp8``. The kernel never stores the BF16 activation;
  it is recovered exactly by running the unmodified kernel with ``dtype=torch.float16``: the
  output is then ``fp16(act / 2^k)`` with ``2^k = pow2ceil(amax / 65504)``, exact for every
  element with ``|out| > 2^-17`` (a BF16 value has 8 significant bits, FP16 11, and the FP16
  quantum is 2^-24), so ``out · 2^k`` is the BF16 activation bit for bit. The (rare) elements
  below that are compared in the FP16 domain instead (ours mapped through the same exact
  scaling and FP16 rounding) and counted in the summary line.

Our side: the eager ops (the plain-torch reference kernels on CUDA) and the same ops compiled by
Inductor with ``inductor_ext.enable()`` (the decompositions of ``lowerings/``); for the activation
also compiled with Inductor's ``use_fast_math`` ("compiled_fast_exp"). Expected sources of
difference in the activation: LMDeploy computes ``exp`` as ``tl.math.exp`` (on NVIDIA ``ex2.approx``
of ``x·log2 e``) and divides with Triton's ``/`` (``div.full.f32``, approximate); eager CUDA uses
ATen's ``expf`` and IEEE division, default Inductor ``libdevice.exp`` and ``/``, fast-math Inductor
``tl.math.exp`` and ``/``. Ours return the
dequantized â in BF16 and the scales; the e4m3 values are recovered as ``e4m3(â / s)``, which is
exact (â = q·s is exact in BF16: q has 4 significant bits and s is a power of two).

Every comparison prints one summary line (``pytest -s``); a difference fails the test with the
count of differing elements and the largest distance in units in the last place of the compared
dtype (ordered bit patterns; +0 and -0 differ in bits at 0 ULP).
"""

from __future__ import annotations

import functools

import pytest
import torch

import inductor_ext
from inductor_ext import ops

pytestmark = pytest.mark.cuda

try:  # the serving kernels: only the Triton modules, from .lmdeploy/ (see the module docstring)
    from lmdeploy.pytorch.kernels.cuda import blocked_gemm_fp8 as lmd_quant
    from lmdeploy.pytorch.kernels.cuda.moe import v4_swiglu_quant as lmd_swiglu
except Exception as exc:  # noqa: BLE001  (ImportError, or triton missing inside them)
    lmd_quant = lmd_swiglu = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    _IMPORT_ERROR = ""

needs_lmdeploy = pytest.mark.skipif(
    lmd_quant is None,
    reason="LMDeploy 0.18 kernel modules not importable (" + _IMPORT_ERROR + "); build .lmdeploy/ with "
    "`python scripts/fetch_lmdeploy_kernels.py` and run with PYTHONPATH=$PWD/.lmdeploy",
)

GROUP, LIMIT = 128, 10.0
E4M3 = torch.float8_e4m3fn
QUANT_SHAPES = {"8x128": (8, 128), "40x1024": (40, 1024), "8192x4096": (8192, 4096)}
ACT_SHAPES = {"16x2x256": (16, 256), "8192x2x2048": (8192, 2048)}  # rows, moe_intermediate
MODES = ("eager", "compiled")
# + Inductor with use_fast_math: exp as tl.math.exp, the ex2.approx form LMDeploy's fast_expf uses
# (default Inductor calls libdevice.exp): isolates the exp when the activation differs
ACT_MODES = MODES + ("compiled_fast_exp",)


# ---------------------------------------------------------------- comparison helpers

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT[t.element_size()])


def _ordered(bits: torch.Tensor) -> torch.Tensor:
    """Sign-magnitude float bits → integers in the order of the values (so that differences count ULPs)."""
    i = bits.long()
    mag = i & ((1 << (8 * bits.element_size() - 1)) - 1)
    return torch.where(i < 0, -mag, mag)


def diff(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[int, int]:
    """(number of elements whose bits differ, largest distance in ULPs of the dtype)."""
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        raise AssertionError(
            f"layout: ours {ours.dtype}{tuple(ours.shape)} vs theirs {theirs.dtype}{tuple(theirs.shape)}")
    a, b = _bits(ours), _bits(theirs)
    if torch.equal(a, b):
        return 0, 0
    return int((a != b).sum()), int((_ordered(a) - _ordered(b)).abs().max())


def check(name: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], note: str = "") -> tuple[bool, str]:
    """Compare each (ours, theirs) pair bitwise; one summary line, True when all are equal."""
    parts, ok = [], True
    for label, (ours, theirs) in pairs.items():
        n, ulp = diff(ours, theirs)
        ok &= n == 0
        parts.append(f"{label} {n}/{ours.numel()} differ (max {ulp} ULP {str(ours.dtype).replace('torch.', '')})")
    line = f"[lmdeploy] {name}: " + "; ".join(parts) + (f"; {note}" if note else "") + (
        " -> BITWISE EQUAL" if ok else " -> DIFFERENT")
    return ok, line


def report(ok: bool, line: str) -> None:
    print(line)
    if not ok:
        pytest.fail(line, pytrace=False)


# ---------------------------------------------------------------- inputs

def quant_input(rows: int, cols: int, device, seed: int = 0) -> torch.Tensor:
    """Random BF16 ``[rows, cols]`` (std 3) whose first rows are edge cases when rows >= 8."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * 3
    if rows >= 8:
        groups = cols // GROUP
        rnd = lambda: torch.randn(cols, generator=gen)  # noqa: E731
        x[0] = 0.0
        x[0, 1::2] = -0.0  # amax 0: the 1e-6 floor, signed zeros
        x[1] = rnd() * 1e-8  # amax below the floor
        x[2] = rnd() * 1e36  # huge (BF16 max 3.4e38)
        k = torch.arange(groups) * 7 % 41 - 20  # amax = 448·2^k: amax/448 exactly a power of two
        x[3] = rnd().clamp(-1, 1) * 0.5 * (448 * 2.0 ** k).repeat_interleave(GROUP)
        x[3, ::GROUP] = 448 * 2.0 ** k * torch.where(k % 2 == 0, 1.0, -1.0)
        x[4] = x[3]
        x[4, ::GROUP] *= 1 + 2 ** -7  # just above 448·2^k (BF16-rounded): the scale doubles
        x[5] = rnd() * 1e-39  # BF16 subnormals
        x[6] = rnd() * 1e-3  # one outlier per group: the rest lands in e4m3 subnormals / zero
        x[6, 5::GROUP] = 1e3
        binade = torch.randint(-10, 4, (cols,), generator=gen)
        mid = (17 + 2 * torch.randint(0, 8, (cols,), generator=gen)) * 2.0 ** binade
        x[7] = mid * torch.where(rnd() < 0, -1.0, 1.0)  # e4m3 rounding ties (odd multiples of half a quantum)
        x[7, ::GROUP] = 448.0  # at scale 1
    return x.to(torch.bfloat16).to(device)


def gate_up_input(rows: int, inter: int, device, seed: int = 0) -> torch.Tensor:
    """Random BF16 ``[rows, 2·inter]`` (gate | up, std 6: ~10 % beyond ±L), edge rows when rows >= 8."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gu = torch.randn(rows, 2 * inter, generator=gen) * 6
    if rows >= 8:
        g, u = gu[:, :inter], gu[:, inter:]
        g[0, :6] = torch.tensor([LIMIT, -LIMIT, 2 * LIMIT, -2 * LIMIT, 1e4, -1e4])  # clamp boundaries
        u[0, :6] = torch.tensor([LIMIT, -LIMIT, -2 * LIMIT, 2 * LIMIT, 1e4, -1e4])
        g[1] = torch.linspace(-100, -60, inter)  # exp(-g) near / past FP32 overflow (exp(88.7))
        g[2] = 0.0
        u[3] = 0.0
        g[4] = torch.randn(inter, generator=gen) * 1e-30  # silu(g) ≈ g/2, tiny products
        g[5] = torch.randn(inter, generator=gen) * 1e3  # large positive gates: clamped to L
        u[6] = torch.randn(inter, generator=gen) * 1e-3  # activations across many binades
        g[7] = torch.randn(inter, generator=gen) * 0.01
    return gu.to(torch.bfloat16).to(device)


# ---------------------------------------------------------------- the serving kernels

def lmd_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LMDeploy ``quant_fp8`` group 128, ue8m0: (e4m3 ``[M, K]``, FP32 pow2 scales ``[M, K/128]``)."""
    return lmd_quant.quant_fp8(x, GROUP, dtype=E4M3, trans_scale=False, scale_fmt="ue8m0")


def lmd_swiglu_quant(gu: torch.Tensor, limit: float = LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """LMDeploy ``v4_swiglu_and_quant_fp8`` e4m3, ue8m0: (e4m3 ``[M, I]``, FP32 scales ``[M, I/128]``)."""
    return lmd_swiglu.v4_swiglu_and_quant_fp8(gu, swiglu_limit=limit, group_size=GROUP, dtype=E4M3, scale_fmt="ue8m0")


def lmd_bf16_activation(gu: torch.Tensor, limit: float = LIMIT):
    """The kernel's BF16 activation, recovered from its FP16-output run (see the module docstring).

    Returns (act BF16 ``[M, I]``, exact mask, fp16 out, fp16-run scales ``[M, I/128, 1]``)."""
    out16, s16 = lmd_swiglu.v4_swiglu_and_quant_fp8(gu, swiglu_limit=limit, group_size=GROUP,
                                                     dtype=torch.float16, scale_fmt="ue8m0")
    s16 = s16.unsqueeze(-1)
    out = out16.float().unflatten(-1, (-1, GROUP))
    act = (out * s16).flatten(-2).to(torch.bfloat16)  # exact: a power-of-two product of an FP16 value
    exact = out16.abs() > 2.0 ** -17  # |act / 2^k| >= 2^-17: FP16 holds the BF16 value whole
    return act, exact, out16, s16


def fp16_image(act: torch.Tensor, s16: torch.Tensor) -> torch.Tensor:
    """``fp16(act / 2^k)``: a BF16 activation through the FP16 run's exact scaling and rounding."""
    return (act.float().unflatten(-1, (-1, GROUP)) * (1.0 / s16)).flatten(-2).to(torch.float16)


# ---------------------------------------------------------------- our ops (eager and compiled)

def _our_quant(x):
    return ops.fp8_qdq(x, scale_fmt="ue8m0", return_scale=True)


def _our_act(gu):
    gate, up = gu.chunk(2, dim=-1)
    return ops.swiglu(gate, up, limit=LIMIT, mode="serving")


def _our_act_quant(gu):
    return ops.fp8_qdq(_our_act(gu), scale_fmt="ue8m0", return_scale=True)


@functools.cache
def ours(fn_name: str, mode: str):
    fn = {"quant": _our_quant, "act": _our_act, "act_quant": _our_act_quant}[fn_name]
    if mode == "eager":
        return fn
    inductor_ext.enable()
    # options make the backends unequal: torch.compile wrappers with equal inductor options share
    # Dynamo's cache entries, so a config patch around a second wrapper would reuse the first's code
    options = {"use_fast_math": True} if mode == "compiled_fast_exp" else None
    return torch.compile(fn, backend="inductor", fullgraph=True, dynamic=False, options=options)


def e4m3_of(xq: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """e4m3 values q of our â = q·s (exact division by the power-of-two scale)."""
    return (xq.float().unflatten(-1, (-1, GROUP)) / s.unsqueeze(-1)).flatten(-2).to(E4M3)


def dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """BF16 q·s of the serving kernel's output (exact)."""
    return (q.float().unflatten(-1, (-1, GROUP)) * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)


# ---------------------------------------------------------------- comparisons (device-agnostic)

def compare_quant(x: torch.Tensor, mode: str) -> tuple[bool, str]:
    xq, s = ours("quant", mode)(x)
    q_ref, s_ref = lmd_quant_fp8(x)
    return check(f"fp8_qdq ue8m0 vs quant_fp8 {mode} {tuple(x.shape)}", {
        "scale": (s, s_ref), "e4m3": (e4m3_of(xq, s), q_ref), "x_qdq": (xq, dequant(q_ref, s_ref))})


def compare_act(gu: torch.Tensor, mode: str) -> tuple[bool, str, float, int]:
    """(bitwise equal, summary line, fraction of BF16 activations that differ, their max ULPs)."""
    y = ours("act", mode)(gu)
    act, exact, out16, s16 = lmd_bf16_activation(gu)
    coarse = ~exact
    pairs = {"bf16_act": (torch.where(exact, y, act), act)}
    if coarse.any():  # below FP16 resolution of the recovery: compare through the same FP16 map
        pairs["fp16_image(coarse)"] = (fp16_image(y, s16)[coarse], out16[coarse])
    ok, line = check(f"swiglu serving vs v4_swiglu_quant BF16 activation {mode} {tuple(gu.shape)}", pairs,
                     note=f"{int(coarse.sum())} elements below the FP16 recovery's resolution")
    n, ulp = diff(*pairs["bf16_act"])
    return ok, line, n / y.numel(), ulp


def compare_act_quant(gu: torch.Tensor, mode: str) -> tuple[bool, str]:
    xq, s = ours("act_quant", mode)(gu)
    q_ref, s_ref = lmd_swiglu_quant(gu)
    return check(f"fp8_qdq(swiglu) vs v4_swiglu_and_quant_fp8 {mode} {tuple(gu.shape)}", {
        "scale": (s, s_ref), "e4m3": (e4m3_of(xq, s), q_ref), "x_qdq": (xq, dequant(q_ref, s_ref))})


# ---------------------------------------------------------------- tests

@needs_lmdeploy
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", QUANT_SHAPES.values(), ids=QUANT_SHAPES.keys())
def test_fp8_qdq_matches_lmdeploy_quant_fp8(shape, mode):
    report(*compare_quant(quant_input(*shape, "cuda"), mode))


@needs_lmdeploy
@pytest.mark.parametrize("mode", ACT_MODES)
@pytest.mark.parametrize("shape", ACT_SHAPES.values(), ids=ACT_SHAPES.keys())
def test_serving_swiglu_matches_lmdeploy_bf16_activation(shape, mode):
    """Compiled (the decomposition takes the serving engine's exp on CUDA, ``serving_exp``) and
    ``compiled_fast_exp`` (``tl.math.exp``): bitwise. Eager computes ATen's accurate ``expf``:
    measured on the H200, 26 of 16,777,216 activations at 8192x2x2048 differ, each by 1 BF16 ULP;
    the bound is 1 ULP on at most 1e-5 of the elements."""
    ok, line, frac, ulp = compare_act(gate_up_input(*shape, "cuda"), mode)
    if mode != "eager" or (ulp > 1 or frac > 1e-5):
        report(ok, line)
    else:
        print(line + f" (accurate exp: {frac:.1e} of the elements within 1 ULP, allowed)")


@needs_lmdeploy
@pytest.mark.parametrize("mode", ACT_MODES)
@pytest.mark.parametrize("shape", ACT_SHAPES.values(), ids=ACT_SHAPES.keys())
def test_swiglu_fp8_qdq_matches_lmdeploy_v4_swiglu_quant(shape, mode):
    report(*compare_act_quant(gate_up_input(*shape, "cuda"), mode))


@needs_lmdeploy
def test_bf16_activation_recovery_is_exact():
    """The FP16-run recovery of the BF16 activation: equal, on the exact elements, to the
    activation that the e4m3 run quantizes (its e4m3 values and scales follow from it)."""
    gu = gate_up_input(64, 512, "cuda", seed=1)
    act, exact, _, _ = lmd_bf16_activation(gu)
    q_ref, s_ref = lmd_swiglu_quant(gu)
    requant_q, requant_s = lmd_quant_fp8(act)  # quant_fp8 and the fused kernel quantize alike
    report(*check("BF16 activation recovery (requantized) vs v4_swiglu_and_quant_fp8", {
        "scale": (requant_s, s_ref), "e4m3": (requant_q, q_ref)},
        note=f"{int((~exact).sum())} elements below the FP16 recovery's resolution"))
