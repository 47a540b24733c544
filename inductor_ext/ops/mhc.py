"""mHC (manifold-constrained hyper-connections) ops: ``glm53::mhc_pre`` and ``glm53::mhc_post``.

Semantics of transformers ``Glm5NextTextHyperConnection`` and its use in
``Glm5NextTextDecoderLayer`` (N = ``hc_mult`` = 4 streams, ``hc_sinkhorn_iters`` = 20, ``hc_eps`` =
1e-6, the stream RMSNorm uses ``rms_norm_eps``). Parameters carry transformers' names: ``fn``
``[(2+N)·N, N·D]``, ``base`` ``[(2+N)·N]``, ``scale`` ``[3]``.

``mhc_pre(x [..., N, D])``, all in FP32 from x::

    z = flatten(x) · rsqrt(mean(flatten(x)²) + norm_eps)          [..., N·D]
    pre_w, post_w, comb_w = split(z · fnᵀ, [N, N, N·N])
    pre  = σ(pre_w·scale[0] + base_pre) + hc_eps                  [..., N]
    post = 2·σ(post_w·scale[1] + base_post)                       [..., N]
    comb = softmax(comb_w·scale[2] + base_comb, over o) + hc_eps  [..., N(s), N(o)]
    comb ← comb / (colsum + hc_eps); then (iters − 1) × (row, column) normalisations
    mixed = Σ_s pre[s] · x[s]  → x's dtype                        [..., D]

returns ``(mixed, post, comb)`` (post, comb FP32): the sublayer input and the coefficients of
``mhc_post``. Its backward is written out in FP32 (Sinkhorn steps recomputed), each gradient
rounded once to its input's dtype.

``mhc_post(f [..., D], residual [..., N, D], post, comb, precision)``: out ``[..., N, D]`` =
``post[o]·f + Σ_s comb[s,o]·residual[s]``. ``"bf16"``: transformers semantics in the residual's dtype
(post and comb rounded to it, product and matmul rounded, then the sum rounded); its backward is
the chain of autograd formulas transformers gets. ``"fp32"``: computed in FP32, one rounding; the
backward in FP32, one rounding per gradient.

The batch-invariant variants (``PrecisionConfig.batch_invariant``) live in
:mod:`inductor_ext.ops.mhc_batch_invariant`; they share :func:`coefficients_from_projection` and
:func:`coefficient_vjp` with these ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from inductor_ext.config import MHC_POST_PRECISIONS as PRECISIONS
from inductor_ext.config import active_config
from inductor_ext.ops._checks import input_error, integer, real, tensors
from inductor_ext.ops.ordered import ordered_softmax, ordered_sum, positionwise

__all__ = ["mhc_pre", "mhc_post", "PRECISIONS", "mhc_pre_reference", "mhc_post_reference", "mhc_post_fp32",
           "validate_mhc_pre_inputs", "validate_mhc_post_inputs", "coefficients_from_projection",
           "coefficient_vjp", "streams_from_width"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _check_common(op, tensors):
    for name, t in tensors.items():
        if t.dtype not in _FLOATS:
            raise input_error(f"{op}: {name} must be bfloat16, float16 or float32, got {t.dtype}")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise input_error(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    if next(iter(devices)).type not in ("cpu", "cuda"):
        raise input_error(f"{op}: tensors must be on cpu or cuda, got {next(iter(devices))}")


def validate_mhc_pre_inputs(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, op="mhc_pre") -> None:
    """Static checks (types, shapes, dtypes, devices, constants); raise ``ValueError`` naming the rule,
    prefixed with ``op`` (the calling op)."""
    tensors(op, x=x, fn=fn, base=base, scale=scale)
    real(op, "norm_eps", norm_eps, gt=0)
    real(op, "hc_eps", hc_eps, ge=0)
    integer(op, "sinkhorn_iters", sinkhorn_iters, ge=1)
    if x.dim() < 3:
        raise input_error(f"{op}: x must be [..., N, D] with a leading token dim, got {tuple(x.shape)}")
    N, D = x.shape[-2:]
    if tuple(fn.shape) != ((2 + N) * N, N * D):
        raise input_error(f"{op}: fn must be [(2+N)*N, N*D] = {((2 + N) * N, N * D)}, got {tuple(fn.shape)}")
    if tuple(base.shape) != ((2 + N) * N,):
        raise input_error(f"{op}: base must be [(2+N)*N] = [{(2 + N) * N}], got {tuple(base.shape)}")
    if tuple(scale.shape) != (3,):
        raise input_error(f"{op}: scale must be [3] (pre, post, comb), got {tuple(scale.shape)}")
    _check_common(op, {"x": x, "fn": fn, "base": base, "scale": scale})


def validate_mhc_post_inputs(f, residual, post, comb, precision, op="mhc_post") -> None:
    """Static checks (types, precision, shapes, dtypes, devices); raise ``ValueError`` naming the rule,
    prefixed with ``op`` (the calling op)."""
    tensors(op, f=f, residual=residual, post=post, comb=comb)
    if precision not in PRECISIONS:
        raise input_error(f"{op}: precision must be one of {PRECISIONS}, got {precision!r}")
    if residual.dim() < 3:
        raise input_error(f"{op}: residual must be [..., N, D], got {tuple(residual.shape)}")
    lead, (N, D) = tuple(residual.shape[:-2]), residual.shape[-2:]
    for name, t, shape in (("f", f, (*lead, D)), ("post", post, (*lead, N)), ("comb", comb, (*lead, N, N))):
        if tuple(t.shape) != shape:
            raise input_error(f"{op}: {name} must be {shape} to match residual [..., N, D], got {tuple(t.shape)}")
    if f.dtype != residual.dtype:
        raise input_error(f"{op}: f and residual must share a dtype, got {f.dtype} and {residual.dtype}")
    _check_common(op, {"f": f, "residual": residual, "post": post, "comb": comb})


# ---------------------------------------------------------------------------------------------
# reference kernels (plain torch, every device)
# ---------------------------------------------------------------------------------------------


def _coefficients(x, fn, base, scale, norm_eps, hc_eps, iters):
    """FP32 forward up to the coefficients; also returns what the backward needs."""
    flat = x.flatten(-2).float()  # (not reshape(..., -1): ambiguous with no token)
    rstd = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    z = flat * rstd
    pre, post, comb, saved = coefficients_from_projection(F.linear(z, fn.float()), base, scale, hc_eps, iters)
    return pre, post, comb, (flat, rstd, z, saved)


def coefficients_from_projection(proj, base, scale, hc_eps, iters, invariant: bool = False):
    """``(pre, post, comb, saved)`` in FP32 from the projection ``proj = z · fnᵀ`` ``[..., (2+N)·N]``
    (the module docstring's formulas); ``saved`` is what :func:`coefficient_vjp` needs.
    ``invariant``: the short reductions (softmax, Sinkhorn sums) as ordered chains and the
    sigmoids / exp :func:`~inductor_ext.ops.ordered.positionwise`."""
    N = streams_from_width(proj.shape[-1])
    proj = proj.float()
    pre_w, post_w, comb_w = proj.split([N, N, N * N], -1)
    pre_b, post_b, comb_b = base.float().split([N, N, N * N])
    s = scale.float()
    comb_w = comb_w.unflatten(-1, (N, N))
    sigmoid = functools.partial(positionwise, torch.sigmoid) if invariant else torch.sigmoid
    pre_sig = sigmoid(pre_w * s[0] + pre_b)
    post_sig = sigmoid(post_w * s[1] + post_b)
    logits = comb_w * s[2] + comb_b.view(N, N)
    probs = ordered_softmax(logits) if invariant else torch.softmax(logits, dim=-1)
    comb = probs + hc_eps
    steps = []  # (normalised result, denominator, dim) per Sinkhorn step
    for dim in [-2] + [-1, -2] * (iters - 1):
        denom = (ordered_sum(comb, dim, keepdim=True) if invariant else comb.sum(dim=dim, keepdim=True)) + hc_eps
        comb = comb / denom
        steps.append((comb, denom, dim))
    saved = (s, pre_w, post_w, comb_w, pre_sig, post_sig, probs, steps)
    return pre_sig + hc_eps, 2 * post_sig, comb, saved


def coefficient_vjp(saved, dpre, dpost, dcomb):
    """FP32 ``(dproj [..., (2+N)·N], dbase [(2+N)·N], dscale [3])`` of
    :func:`coefficients_from_projection` from its ``saved`` and the outputs' gradients."""
    s, pre_w, post_w, comb_w, pre_sig, post_sig, probs, steps = saved
    dc = dcomb.float()
    for y, denom, dim in reversed(steps):  # y = c / (Σ_dim c + eps)  =>  dc = (dy − Σ_dim dy·y) / denom
        dc = (dc - (dc * y).sum(dim=dim, keepdim=True)) / denom
    dlogit = probs * (dc - (dc * probs).sum(-1, keepdim=True))
    da_pre = dpre.float() * pre_sig * (1 - pre_sig)
    da_post = dpost.float() * 2 * post_sig * (1 - post_sig)
    dproj = torch.cat([da_pre * s[0], da_post * s[1], (dlogit * s[2]).flatten(-2)], -1)
    dscale = torch.stack([(da_pre * pre_w).sum(), (da_post * post_w).sum(), (dlogit * comb_w).sum()])
    dbase = torch.cat([da_pre, da_post, dlogit.flatten(-2)], -1).reshape(-1, dproj.shape[-1]).sum(0)
    return dproj, dbase, dscale


def streams_from_width(width: int) -> int:
    """N from mHC's projection width ``(2+N)·N``; ``ValueError`` if the width is not of that form."""
    n = int(round((1 + width) ** 0.5 - 1))
    if (2 + n) * n != width:
        raise input_error(f"mhc: a projection of width {width} is not (2+N)*N for any N")
    return n


def mhc_pre_reference(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """(mixed in x's dtype ``[..., D]``, post FP32 ``[..., N]``, comb FP32 ``[..., N, N]``)."""
    with torch.autocast(x.device.type, enabled=False):
        pre, post, comb, _ = _coefficients(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
        mixed = (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
    return mixed.contiguous(), post.contiguous(), comb.contiguous()


def _mhc_pre_backward(x, fn, base, scale, norm_eps, hc_eps, iters, dmixed, dpost, dcomb):
    """FP32 VJP of :func:`mhc_pre_reference`: (dx, dfn, dbase, dscale) in the inputs' dtypes."""
    pre, _, _, (flat, rstd, z, saved) = _coefficients(x, fn, base, scale, norm_eps, hc_eps, iters)
    xf, dm = x.float(), dmixed.float()
    dx_direct = pre.unsqueeze(-1) * dm.unsqueeze(-2)
    dpre = (dm.unsqueeze(-2) * xf).sum(-1)
    dh, dbase, dscale = coefficient_vjp(saved, dpre, dpost, dcomb)
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    dfn = rows(dh).t() @ rows(z)
    dz = dh @ fn.float()
    # z = flat · rstd, rstd = (mean(flat²) + eps)^-½  =>  dflat = rstd·dz − flat·rstd³·mean(dz·flat)
    dflat = rstd * dz - flat * rstd.pow(3) * (dz * flat).mean(-1, keepdim=True)
    dx = dflat.view(x.shape) + dx_direct
    return dx.to(x.dtype), dfn.to(fn.dtype), dbase.to(base.dtype), dscale.to(scale.dtype)


def mhc_post_reference(f, residual, post, comb, precision):
    """out ``[..., N, D]`` in residual's dtype = post[o]·f + Σ_s comb[s,o]·residual[s]."""
    dtype = residual.dtype
    with torch.autocast(residual.device.type, enabled=False):
        if precision == "bf16":
            out = post.to(dtype).unsqueeze(-1) * f.unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), residual)
        else:
            out = mhc_post_fp32(f.float(), residual.float(), post.float(), comb.float())
    return out.to(dtype).contiguous()


def mhc_post_fp32(f, residual, post, comb):
    """FP32 ``post[o]·f + Σ_s comb[s,o]·residual[s]``, the stream sum a chain of elementwise adds in
    stream order: eager and Inductor (no FMA contraction under
    ``enable()``) run the same roundings, where a BLAS ``matmul`` picks its own order and FMAs."""
    terms = [comb[..., s, :].unsqueeze(-1) * residual[..., s, :].unsqueeze(-2) for s in range(residual.shape[-2])]
    return post.unsqueeze(-1) * f.unsqueeze(-2) + functools.reduce(torch.add, terms)


def _mhc_post_backward(f, residual, post, comb, precision, dout):
    """VJP of :func:`mhc_post_reference`: (df, dresidual, dpost, dcomb) in the inputs' dtypes."""
    if precision == "bf16":  # the autograd chain of the transformers expression, in its dtype
        dtype = residual.dtype
        p, c = post.to(dtype), comb.to(dtype)
        dpost = (dout * f.unsqueeze(-2)).sum(-1)
        df = (dout * p.unsqueeze(-1)).sum(-2)
    else:
        p, c = post.float(), comb.float()
        dout, f, residual = dout.float(), f.float(), residual.float()
        dpost = (dout * f.unsqueeze(-2)).sum(-1)
        df = (dout * p.unsqueeze(-1)).sum(-2)
    dres = torch.matmul(c, dout)
    dcomb = torch.matmul(residual, dout.transpose(-1, -2))
    return df, dres, dpost, dcomb


# ---------------------------------------------------------------------------------------------
# torch.library ops
# ---------------------------------------------------------------------------------------------

_T = torch.Tensor


@torch.library.custom_op("glm53::mhc_pre", mutates_args=(), device_types=("cpu", "cuda"))
def _mhc_pre_op(x: _T, fn: _T, base: _T, scale: _T, norm_eps: float, hc_eps: float,
            sinkhorn_iters: int) -> tuple[_T, _T, _T]:
    """mHC collapse: (mixed ``[..., D]`` x's dtype, post FP32 ``[..., N]``, comb FP32 ``[..., N, N]``)
    from streams ``x [..., N, D]``. Kernel: :func:`mhc_pre_reference`."""
    return mhc_pre_reference(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)


@torch.library.custom_op("glm53::mhc_post", mutates_args=(), device_types=("cpu", "cuda"))
def _mhc_post_op(f: _T, residual: _T, post: _T, comb: _T, precision: str) -> _T:
    """mHC expansion: ``[..., N, D]`` = post[o]·f + Σ_s comb[s,o]·residual[s] in residual's dtype;
    precision "bf16" | "fp32". Kernel: :func:`mhc_post_reference`."""
    return mhc_post_reference(f, residual, post, comb, precision)


def _pre_setup(ctx, inputs, output):
    x, fn, base, scale, norm_eps, hc_eps, iters = inputs
    ctx.consts = (norm_eps, hc_eps, iters)
    ctx.save_for_backward(x, fn, base, scale)


def _pre_backward(ctx, dmixed, dpost, dcomb):
    x, fn, base, scale = ctx.saved_tensors
    with torch.autocast(x.device.type, enabled=False):
        grads = _mhc_pre_backward(x, fn, base, scale, *ctx.consts, dmixed, dpost, dcomb)
    return (*grads, None, None, None)


def _post_setup(ctx, inputs, output):
    f, residual, post, comb, precision = inputs
    ctx.precision = precision
    ctx.save_for_backward(f, residual, post, comb)


def _post_backward(ctx, dout):
    f, residual, post, comb = ctx.saved_tensors
    with torch.autocast(f.device.type, enabled=False):
        df, dres, dpost, dcomb = _mhc_post_backward(f, residual, post, comb, ctx.precision, dout)
    return (df.to(f.dtype), dres.to(residual.dtype), dpost.to(post.dtype),
            dcomb.to(comb.dtype), None)


_mhc_pre_op.register_autograd(_pre_backward, setup_context=_pre_setup)
_mhc_post_op.register_autograd(_post_backward, setup_context=_post_setup)


def mhc_pre(x, fn, base, scale, *, norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20):
    """mHC coefficients and stream collapse (transformers ``Glm5NextTextHyperConnection``),
    ``glm53::mhc_pre``; FP32 math.

    Args:
        x: streams ``[..., N, D]`` (GLM-5.3: N = 4), bf16, fp16 or fp32.
        fn: ``[(2+N)·N, N·D]``; base: ``[(2+N)·N]``; scale: ``[3]`` (the module's parameters).
        norm_eps: the stream RMSNorm's epsilon (``rms_norm_eps``); hc_eps: ``hc_eps``;
        sinkhorn_iters: ``hc_sinkhorn_iters``.

    Returns:
        ``(mixed, post, comb)``: the sublayer input ``[..., D]`` in x's dtype, post FP32
        ``[..., N]``, comb FP32 ``[..., N, N]`` (doubly stochastic, rows = input streams).
        Differentiable in x, fn, base and scale.
    """
    validate_mhc_pre_inputs(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
    return torch.ops.glm53.mhc_pre(x, fn, base, scale, float(norm_eps), float(hc_eps), sinkhorn_iters)


def mhc_post(f, residual, post, comb, *, precision=None):
    """mHC expansion ``out[o] = post[o]·f + Σ_s comb[s,o]·residual[s]``, ``glm53::mhc_post``.

    Args:
        f: sublayer output ``[..., D]``, residual's dtype.
        residual: the streams fed to :func:`mhc_pre`, ``[..., N, D]``.
        post ``[..., N]``, comb ``[..., N, N]``: from :func:`mhc_pre` (any float dtype).
        precision: ``"bf16"`` (transformers: in residual's dtype, several roundings) or ``"fp32"``
            (FP32, one rounding); ``None`` takes ``PrecisionConfig.mhc_post`` of the active config.

    Returns:
        ``[..., N, D]`` in residual's dtype; differentiable in every tensor input.
    """
    precision = active_config().mhc_post if precision is None else precision
    validate_mhc_post_inputs(f, residual, post, comb, precision)
    return torch.ops.glm53.mhc_post(f, residual, post, comb, precision)
