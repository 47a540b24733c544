"""mHC: input checks, the coefficient math (shared with the batch-invariant variants of
:mod:`inductor_ext.ops.mhc_batch_invariant`) and the plain-torch reference kernels, forward and
backward, of ``glm53::mhc_pre`` / ``glm53::mhc_post`` (the formulas: :mod:`inductor_ext.ops.mhc`).

A leaf module: the op definitions, their lowering (:mod:`lowerings.mhc`) and the fake kernels import it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from inductor_ext.config import MHC_POST_PRECISIONS as PRECISIONS
from inductor_ext.ops._checks import floats_on_one_device, input_error, integer, real, tensors
from inductor_ext.ops.ordered import ordered_softmax, ordered_sum, positionwise

__all__ = ["PRECISIONS", "mhc_pre_reference", "mhc_post_reference", "mhc_post_fp32", "mhc_pre_backward_reference",
           "mhc_post_backward_reference", "validate_mhc_pre_inputs", "validate_mhc_post_inputs",
           "coefficients_from_projection", "coefficient_vjp", "streams_from_width"]

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
    floats_on_one_device(op, {"x": x, "fn": fn, "base": base, "scale": scale})


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
    floats_on_one_device(op, {"f": f, "residual": residual, "post": post, "comb": comb})


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


def mhc_pre_backward_reference(x, fn, base, scale, norm_eps, hc_eps, iters, dmixed, dpost, dcomb):
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


def mhc_post_backward_reference(f, residual, post, comb, precision, dout):
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
