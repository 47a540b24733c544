"""KDA (Kimi delta attention): constants, input checks, residual layouts and the plain-torch
reference kernels of ``glm53::kda_chunk`` / ``kda_chunk_bwd`` / ``kda_recurrent``.

A leaf module: the op definitions (:mod:`inductor_ext.ops.kda`), the fake kernels and the GPU
kernels import it; it imports no kernel.

Contract (``docs/DESIGN.md`` §4). q, k ``[B,T,H,K]``; v ``[B,T,H,V]``; g ``[B,T,H,K]`` float32
log-decay (finite, ≤ 0, already activated); beta ``[B,T,H]`` in [0, 1] (the layer's sigmoid; the
serving engine's too; any β in [0, 2] keeps ``I − β k kᵀ`` non-expansive, but only [0, 1] is the
contract); scale a finite number > 0; optional initial_state float32 ``[N,H,K,V]``; optional
cu_seqlens int64 ``[N+1]`` for packed documents (then B = 1), non-decreasing from 0 to T. q and k
are L2-normalized inside the op, ``x / sqrt(Σx² + 1e-6)``. Per token::

    S' = Diag(exp g_t) S_{t-1};  S_t = S' + β_t k_t (v_t − S'ᵀ k_t)ᵀ;  o_t = S_tᵀ (scale · q_t)

Precision ``"bf16"``: q, k, v, beta are rounded to BF16 on entry and the intermediates are rounded
where flash-linear-attention's chunk_kda rounds them (normalized q/k, Aqk, Akk⁻¹, w, u, kg, per-chunk
h, v_new). ``"fp32"``: q, k, v, beta are promoted to FP32 before the L2 norm and every intermediate
stays FP32. o is returned in v's dtype, the final state in FP32, gradients in their input's dtype.

Besides (o, final_state), ``kda_chunk`` returns the residuals its backward reads, in the layout of
flash-linear-attention's kernels: qn, kn (normalized q/k), q_rstd, k_rstd ``[B,T,H]`` FP32,
g_cumsum (chunk-local cumulative g in log2 units, FP32), Aqk and Akk⁻¹ ``[B,T,H,64]`` (row = token,
column = position inside its chunk). Chunks of 64 tokens start at every document start.
With ``residuals=False`` (forward only: nothing requires a gradient) these seven are empty
(``[0]``, same dtypes): a forward-only call neither keeps them alive nor pays to define Aqk's
entries above each chunk's diagonal, which flash-linear-attention leaves unwritten.
Under ``"fp32"`` with K, V ≤ 128 (:func:`fp32_kernels_apply`) CUDA runs the own FP32-grade Triton
kernels (``inductor_ext.kernels.kda_fp32``) and the residuals change layout, on every device
(:func:`fp32_residual_shapes`): qn, kn, q_rstd, k_rstd, g_cumsum are empty (the backward recomputes
them); Aqk is chunk-major ``[S,H,64,64]`` and Akk ``[S,H,2,64,64]`` holds each chunk's A⁻¹ and its
k̂–k̂ decay products, FP32, S = :func:`chunk_slots`. The CPU kernel returns zeros there (its
backward recomputes everything). Wider heads run flash-linear-attention's kernels on FP32 inputs
(TF32 dots, logged once).
"""
from __future__ import annotations

import math

import torch

from inductor_ext.config import KDA_PRECISIONS as PRECISIONS
from inductor_ext.ops._checks import check_cu_seqlens_values, input_error, real, tensors

# the op's precision argument: the config's values, plus "fp32_causal", which the layers pass for
# kda="fp32" under PrecisionConfig.batch_invariant: the same FP32 arithmetic (the reference kernels
# are one and the same), on CUDA with the chunk kernel's row-causal decay path, so that a
# row's result depends on that row and the earlier rows of its chunk only (docs/DESIGN.md §9)
FP32_PRECISIONS = ("fp32", "fp32_causal")
OP_PRECISIONS = (*PRECISIONS, "fp32_causal")


def kda_chunk_path(config) -> str:
    """The ``kda_chunk`` precision argument that runs ``config.kda`` (a
    :class:`~inductor_ext.PrecisionConfig`) as the config asks: ``"fp32_causal"`` for FP32 under
    ``batch_invariant``, else ``config.kda``."""
    return "fp32_causal" if config.batch_invariant and config.kda == "fp32" else config.kda

__all__ = [
    "CHUNK",
    "FP32_KERNEL_MAX_DIM",
    "L2_EPS",
    "PRECISIONS",
    "OP_PRECISIONS",
    "FP32_PRECISIONS",
    "kda_chunk_path",
    "kda_chunk_reference",
    "kda_chunk_reference_kernel",
    "kda_chunk_bwd_reference_kernel",
    "kda_recurrent_reference",
    "drop_residuals",
    "fp32_kernels_apply",
    "fp32_residual_shapes",
    "returned_residuals",
    "chunk_count",
    "chunk_slots",
    "validate_kda_inputs",
    "check_kda_values",
]

CHUNK = 64
L2_EPS = 1e-6
MAX_HEAD_DIM = 256
FP32_KERNEL_MAX_DIM = 128  # head-dim limit of the own FP32 Triton kernels (inductor_ext.kernels.kda_fp32)
_LOG2E = 1.0 / math.log(2.0)


# ---------------------------------------------------------------------------------------------
# input checks
# ---------------------------------------------------------------------------------------------


def validate_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, precision, scale=None) -> float | None:
    """Static checks (types, shapes, dtypes, devices, precision, ``scale`` a finite number > 0 when
    given); raise ``ValueError`` naming the rule. Returns ``scale`` as a float (``None`` stays)."""
    tensors("kda", optional=("initial_state", "cu_seqlens"), q=q, k=k, v=v, g=g, beta=beta,
            initial_state=initial_state, cu_seqlens=cu_seqlens)
    if scale is not None:
        scale = real("kda", "scale", scale, gt=0)
    if precision not in OP_PRECISIONS:
        raise input_error(f"kda precision must be one of {OP_PRECISIONS}, got {precision!r}")
    if q.dim() != 4:
        raise input_error(f"kda: q must be [B,T,H,K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise input_error(f"kda: k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise input_error(f"kda: v must be [B,T,H,V] with B,T,H = {B},{T},{H}, got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise input_error(f"kda: g must be [B,T,H,K] = {tuple(q.shape)}, got {tuple(g.shape)}")
    if beta.shape != q.shape[:3]:
        raise input_error(f"kda: beta must be [B,T,H] = {tuple(q.shape[:3])}, got {tuple(beta.shape)}")
    if K > MAX_HEAD_DIM:
        raise input_error(f"kda: head dim K must be <= {MAX_HEAD_DIM}, got {K}")
    floats = (torch.bfloat16, torch.float32)
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if t.dtype not in floats:
            raise input_error(f"kda: {name} must be bfloat16 or float32, got {t.dtype}")
    if k.dtype != q.dtype:
        raise input_error(f"kda: q and k must share a dtype, got {q.dtype} and {k.dtype}")
    if g.dtype != torch.float32:
        raise input_error(f"kda: g (log-decay) must be float32, got {g.dtype}")
    named = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if cu_seqlens is not None:
        if cu_seqlens.dtype != torch.int64 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise input_error(
                f"kda: cu_seqlens must be a 1-D int64 tensor of N+1 >= 2 offsets, got "
                f"{cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
            )
        if B != 1:
            raise input_error(f"kda: batch must be 1 when cu_seqlens packs documents, got B={B}")
        named["cu_seqlens"] = cu_seqlens
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None:
        expected = (N, H, K, v.shape[-1])
        if initial_state.dtype != torch.float32 or tuple(initial_state.shape) != expected:
            raise input_error(
                f"kda: initial_state must be float32 [N,H,K,V] = {expected}, got "
                f"{initial_state.dtype} {tuple(initial_state.shape)}"
            )
        named["initial_state"] = initial_state
    devices = {t.device for t in named.values()}
    if len(devices) != 1:
        raise input_error(f"kda: all tensors must be on one device, got {sorted(map(str, devices))}")
    if q.device.type not in ("cpu", "cuda"):
        raise input_error(f"kda: tensors must be on cpu or cuda, got {q.device}")
    return scale


def check_kda_values(g, beta, cu_seqlens, T: int) -> None:
    """Data checks (host synchronising, so the public wrappers run them only in eager mode):
    a finite gate ``g <= 0`` (a decay, ``exp(g) <= 1``), ``0 <= beta <= 1`` (the layer's sigmoid
    write strength; NaN refused) and sorted, in-range ``cu_seqlens`` that start at 0 and end at T."""
    g_finite, g_decay, beta_ok = torch.stack(
        (torch.isfinite(g).all(), (g <= 0).all(), ((beta >= 0) & (beta <= 1)).all())).tolist()
    if not g_finite:
        raise input_error("kda: g (log-decay) must be finite")
    if not g_decay:
        raise input_error(f"kda: g (log-decay) must be <= 0 (a decay exp(g) <= 1), got max {g.max().item()}")
    if not beta_ok:
        raise input_error("kda: beta must lie in [0, 1] (the write strength, a sigmoid), got values in "
                          f"[{beta.min().item()}, {beta.max().item()}]")
    if cu_seqlens is not None:
        check_cu_seqlens_values("kda", cu_seqlens, T)


# ---------------------------------------------------------------------------------------------
# CPU reference kernels (plain torch; also the CUDA fallback without flash-linear-attention)
# ---------------------------------------------------------------------------------------------


def _l2norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rstd = torch.rsqrt(x.float().square().sum(-1) + L2_EPS)
    return x.float() * rstd[..., None], rstd


def _chunk_document(qn, kn, v, g, beta, scale, state, rnd):
    """The chunk algorithm over one document: every argument FP32, ``[B,L,H,·]``; state ``[B,H,K,V]``.

    ``rnd`` rounds a stored intermediate (to BF16 and back for precision "bf16", identity for
    "fp32"). Returns o, the final state and this document's g_cumsum / Aqk / Akk⁻¹ residuals.
    """
    B, L, H, K = qn.shape
    padded = -(-L // CHUNK) * CHUNK
    if padded != L:
        # a partial last chunk runs zero-padded to CHUNK rows: its rows see the rows after them only
        # through exact zeros, and with the full chunk's shapes every row's bits are those it has
        # inside a longer document (MKL rounds 1-3-row products differently; the decode's chunk
        # replay relies on it, graphs/kda_replay.py); the final state is the same value
        pad = lambda x: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, padded - L))  # noqa: E731
        o, state, gcum, aqk, akk = _chunk_document(*(pad(x) for x in (qn, kn, v, g, beta)), scale, state, rnd)
        return o[:, :L], state, gcum[:, :L], aqk[:, :L], akk[:, :L]
    outs, gcums, aqks, akks = [], [], [], []
    for s in range(0, L, CHUNK):
        c = min(CHUNK, L - s)
        q_c, k_c, v_c, g_c = (x[:, s:s + c].transpose(1, 2) for x in (qn, kn, v, g))  # [B,H,c,·]
        b_c = beta[:, s:s + c].transpose(1, 2)[..., None]  # [B,H,c,1]
        gc = g_c.cumsum(2)
        lower = torch.ones(c, c, dtype=torch.bool, device=qn.device).tril()
        # decay[i,j,:] = exp(gc_i - gc_j) for j <= i; masked before exp so j > i cannot overflow
        diff = gc[..., :, None, :] - gc[..., None, :, :]
        decay = diff.masked_fill(~lower[..., None], float("-inf")).exp()
        aqk = rnd(scale * (q_c[..., :, None, :] * k_c[..., None, :, :] * decay).sum(-1))
        kk = (k_c[..., :, None, :] * k_c[..., None, :, :] * decay).sum(-1) * b_c
        eye = torch.eye(c, dtype=qn.dtype, device=qn.device)
        akk = rnd(torch.linalg.solve_triangular(eye + kk.tril(-1), eye, upper=False, unitriangular=True))
        u = rnd(akk @ rnd(v_c * b_c))
        w = rnd(akk @ rnd(k_c * b_c * gc.exp()))
        kg = rnd(k_c * (gc[..., -1:, :] - gc).exp())
        h = rnd(state)
        v_new = rnd(u - w @ h)
        o_c = scale * (rnd(q_c * gc.exp()) @ h) + aqk @ v_new
        state = state * gc[..., -1, :, None].exp() + kg.transpose(-1, -2) @ v_new
        outs.append(o_c)
        gcums.append(gc * _LOG2E)
        aqks.append(torch.nn.functional.pad(aqk, (0, CHUNK - c)))
        akks.append(torch.nn.functional.pad(akk, (0, CHUNK - c)))
    cat = lambda xs: torch.cat(xs, 2).transpose(1, 2)  # noqa: E731  [B,H,L,·] -> [B,L,H,·]
    return cat(outs), state, cat(gcums), cat(aqks), cat(akks)


def _documents(T: int, cu_seqlens):
    if cu_seqlens is None:
        return [(0, T)]
    # the kernel reads the offsets anyway: a compiled call whose offsets miss T fails here, never
    # returning an output of another length than the fake's (T rows)
    check_cu_seqlens_values("kda", cu_seqlens, T)
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def kda_chunk_reference(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision):
    """Plain-torch chunk algorithm (chunk 64); differentiable, so its VJP is the reference backward.

    Returns the 9 outputs of ``glm53::kda_chunk`` (see the module docstring).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    if precision == "bf16":
        q, k, v, beta = (x.to(torch.bfloat16) for x in (q, k, v, beta))
        rnd = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
        store = torch.bfloat16
    else:
        rnd = lambda x: x  # noqa: E731
        store = torch.float32
    qn, q_rstd = _l2norm(q)
    kn, k_rstd = _l2norm(k)
    qn, kn = rnd(qn), rnd(kn)
    vf, bf = v.float(), beta.float()
    docs = _documents(T, cu_seqlens)
    N = len(docs) if cu_seqlens is not None else B
    h0 = initial_state if initial_state is not None else q.new_zeros(N, H, K, V, dtype=torch.float32)
    parts, finals = [], []
    for n, (bos, eos) in enumerate(docs):
        state = h0[n:n + 1] if cu_seqlens is not None else h0
        sl = slice(bos, eos)
        if eos == bos:
            finals.append(state)
            continue
        o, state, gcum, aqk, akk = _chunk_document(
            qn[:, sl], kn[:, sl], vf[:, sl], g[:, sl], bf[:, sl], scale, state, rnd
        )
        parts.append((o, gcum, aqk, akk))
        finals.append(state)
    o, gcum, aqk, akk = (torch.cat(xs, 1) for xs in zip(*parts)) if parts else (
        vf.new_zeros(B, 0, H, V), g.new_zeros(B, 0, H, K), *(g.new_zeros(B, 0, H, CHUNK),) * 2
    )
    final = torch.cat(finals, 0)
    return (
        o.to(out_dtype),
        final,
        qn.to(store),
        kn.to(store),
        q_rstd,
        k_rstd,
        gcum,
        aqk.to(store),
        akk.to(store),
    )


def kda_recurrent_reference(q, k, v, g, beta, scale, initial_state, cu_seqlens, compute_dtype=torch.float32):
    """Serving semantics: the token recurrence with the state and all math in ``compute_dtype``
    (FP32 = serving; FP64 gives an accuracy reference), inputs promoted before the L2 norm.
    Differentiable. Returns (o in v's dtype, final state in ``compute_dtype`` ``[N,H,K,V]``)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = v.dtype
    q, k, v, g, beta = (x.to(compute_dtype) for x in (q, k, v, g, beta))
    qn = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + L2_EPS)
    kn = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + L2_EPS)
    docs = _documents(T, cu_seqlens)
    N = len(docs) if cu_seqlens is not None else B
    h0 = q.new_zeros(N, H, K, V) if initial_state is None else initial_state.to(compute_dtype)
    lengths = {eos - bos for bos, eos in docs}
    if cu_seqlens is not None and len(lengths) == 1 and T > 0:
        # documents of one length (a decode step, equal prompts): one recurrence batched over them
        L = lengths.pop()
        o, final = _recurrence(*(x.reshape(N, L, *x.shape[2:]) for x in (qn, kn, v, g, beta)), h0, scale)
        return o.reshape(B, T, H, V).to(out_dtype), final
    outs, finals = [], []
    for n, (bos, eos) in enumerate(docs):
        S = h0[n:n + 1] if cu_seqlens is not None else h0
        o, S = _recurrence(qn[:, bos:eos], kn[:, bos:eos], v[:, bos:eos], g[:, bos:eos], beta[:, bos:eos], S, scale)
        outs.append(o)
        finals.append(S)
    return torch.cat(outs, 1).to(out_dtype), torch.cat(finals, 0)


def _recurrence(qn, kn, v, g, beta, S, scale):
    """The token loop over ``[b, L, H, *]`` from state ``S [b, H, K, V]`` → (o ``[b, L, H, V]``, S)."""
    outs = []
    for t in range(qn.shape[1]):
        S = S * g[:, t, :, :, None].exp()
        kt = kn[:, t]
        delta = v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * kt, delta)
        outs.append(torch.einsum("bhk,bhkv->bhv", scale * qn[:, t], S))
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)  # L = 0
    return o, S


def _kda_chunk_reference_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision, do, dht):
    def forward(q_, k_, v_, g_, beta_, h0_):
        o, final = kda_chunk_reference(q_, k_, v_, g_, beta_, scale, h0_, cu_seqlens, precision)[:2]
        return o, final

    N = (cu_seqlens.shape[0] - 1) if cu_seqlens is not None else q.shape[0]
    h0 = initial_state
    if h0 is None:
        h0 = q.new_zeros(N, q.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
    # torch.func.vjp, unlike torch.autograd, works below the autograd key where kernels run.
    # Known limit: it fails under an active Python dispatch mode (e.g. opcheck's schema and
    # fake-tensor cross-checks), so the CPU backward cannot run inside one.
    (o, final), vjp = torch.func.vjp(forward, q, k, v, g, beta, h0)
    dht = torch.zeros_like(final) if dht is None else dht
    return vjp((do.to(o.dtype), dht))


# ---------------------------------------------------------------------------------------------
# residual layouts shared by the op, its fake and the CUDA kernels
# ---------------------------------------------------------------------------------------------


def drop_residuals(out: tuple) -> tuple:
    """``(o, final_state, *residuals)`` with each residual replaced by an empty tensor of its dtype."""
    return (*out[:2], *(r.new_empty(0) for r in out[2:]))


def fp32_kernels_apply(q: torch.Tensor, v: torch.Tensor, precision: str) -> bool:
    """Whether precision "fp32" runs the own FP32-grade kernels on CUDA (head dims K, V ≤ 128; wider
    heads take flash-linear-attention's kernels on FP32 inputs, TF32 dots). Whenever this holds,
    the op's residuals have the layout of :func:`fp32_residual_shapes`, on every device."""
    return precision in FP32_PRECISIONS and q.shape[-1] <= FP32_KERNEL_MAX_DIM and v.shape[-1] <= FP32_KERNEL_MAX_DIM


def chunk_count(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    """Length of the fixed chunk list of the CUDA kernels (fla's and the FP32 ones): ``B·ceil(T/64)``,
    or ``ceil(T/64) + N - 1`` when cu_seqlens packs N documents (an upper bound from static shapes:
    no host synchronisation). 0 when T = 0."""
    B, T = q.shape[:2]
    per_row = -(-T // CHUNK)
    return B * per_row if cu_seqlens is None else per_row + cu_seqlens.shape[0] - 2


def chunk_slots(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> int:
    """S = max(:func:`chunk_count`, 1): the first dim of the FP32 kernels' scratch and residuals."""
    return max(chunk_count(q, cu_seqlens), 1)


def fp32_residual_shapes(q: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[tuple[int, ...]]:
    """Shapes of the seven residuals when :func:`fp32_kernels_apply`: five empty, then chunk-major Aqk
    ``[S,H,64,64]`` and (A⁻¹, k̂–k̂ products) ``[S,H,2,64,64]``, all FP32."""
    S, H = chunk_slots(q, cu_seqlens), q.shape[2]
    return [(0,)] * 5 + [(S, H, CHUNK, CHUNK), (S, H, 2, CHUNK, CHUNK)]


def returned_residuals(out: tuple, q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
                       precision: str, residuals: bool) -> tuple:
    """``out`` = ``(o, final_state, *seven residuals)`` as the plain-torch reference (or the fake)
    computes them, with the residuals the op returns: empty without ``residuals``
    (:func:`drop_residuals`); under :func:`fp32_kernels_apply`, FP32 zeros of
    :func:`fp32_residual_shapes` (the CUDA kernels' layout, which no reference backward reads);
    otherwise ``out`` itself."""
    if not residuals:
        return drop_residuals(out)
    if fp32_kernels_apply(q, v, precision):
        return (*out[:2], *(q.new_zeros(shape, dtype=torch.float32) for shape in fp32_residual_shapes(q, cu_seqlens)))
    return out


def kda_chunk_reference_kernel(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision, residuals):
    with torch.no_grad():
        out = tuple(x.contiguous() for x in kda_chunk_reference(
            q, k, v, g, beta, scale, initial_state, cu_seqlens, precision))
    return returned_residuals(out, q, v, cu_seqlens, precision, residuals)


def kda_chunk_bwd_reference_kernel(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision,
                                    qn, kn, q_rstd, k_rstd, g_cumsum, Aqk, Akk, do, dht):
    grads = _kda_chunk_reference_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, precision, do, dht)
    return tuple(gr.to(x.dtype).contiguous() for gr, x in zip(grads, (q, k, v, g, beta, grads[5])))
