"""KPool indexer ops (GLM-5.3 DSA indexer, no RoPE): ``glm53::kpool_project``,
``glm53::kpool_compress``, ``glm53::kpool_quant_query``, ``glm53::kpool_logits``,
``glm53::kpool_select``, their batch-invariant variants and the family's input checks; the
composite indexer the DSA layer calls is :mod:`inductor_ext.ops.kpool_pipeline`.

Contract: ``docs/DESIGN.md`` §4 "KPool indexer"; numerics: :mod:`inductor_ext.ops.kpool_reference`.
Every op has a plain-torch kernel (the CPU kernel, and the CUDA one of ``kpool_project``); compress,
query quantization, scoring and selection register Triton kernels for CUDA (below) that match it.
Static output shapes (widths from input shapes and int/str arguments) and no host synchronisation,
so the whole pipeline traces into one graph and captures into a CUDA graph. The indexer is frozen
(forward only, integer outputs): no autograd formulas.

Shapes: T tokens of packed documents (``cu_seqlens`` int64 [N+1], batch 1); H indexer heads (32,
64 or 128); D = 128; P pool size; S = T // P pool slots.
"""

from __future__ import annotations

import torch

from inductor_ext import backends, workspace
from inductor_ext.config import KPOOL_PRECISIONS as PRECISIONS
from inductor_ext.config import active_config
from inductor_ext.ops import kpool_reference as ref
from inductor_ext.ops._checks import check_cu_seqlens, eager, input_error, integer, real, tensors
from inductor_ext.ops.batch_invariant import bi_layer_norm, bi_linear
from inductor_ext.ops.ordered import ordered_sum

__all__ = [
    "kpool_project",
    "kpool_project_batch_invariant",
    "kpool_layout",
    "kpool_compress",
    "kpool_quant_query",
    "kpool_logits",
    "kpool_logits_batch_invariant",
    "kpool_select",
    "validate_cu_seqlens",
    "check_choice",
    "check_tensor",
    "check_same_device",
    "check_pool_geometry",
    "check_heads",
    "check_positive_int",
    "FLOAT_DTYPES",
    "INDEXER_EPS",
    "INDEXER_SCALE_FMT",
]

_T = torch.Tensor
_DEVICES = ("cpu", "cuda")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TAILS = ("compact", "fixed")
INDEXER_EPS = 1e-6  # the indexer key LayerNorm's epsilon (GLM-5.3)
INDEXER_SCALE_FMT = "ue8m0"  # the FP8 indexer's scale format (serving's)
HEAD_PROJ = ("model", "fp32")


# ---------------------------------------------------------------------------------------------
# torch.library ops (plain-torch kernels on every device)
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("glm53::kpool_project", mutates_args=(), device_types=_DEVICES)
def _kpool_project_op(
    x: _T, wk: _T, k_norm_weight: _T, k_norm_bias: _T, weights_proj: _T, compress_gate: _T,
    eps: float, head_proj: str,
) -> tuple[_T, _T, _T]:
    """(k [T,D] x.dtype, gate [T,D] x.dtype, w [T,H] fp32); see :func:`kpool_project`."""
    with torch.no_grad():
        return tuple(t.contiguous() for t in ref.project_reference(
            x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, eps, head_proj))


@torch.library.custom_op("glm53::kpool_compress", mutates_args=(), device_types="cpu")
def _kpool_compress_op(k: _T, gate: _T, ape: _T, pool_token: _T, mode: str) -> tuple[_T, _T]:
    """(pool [S,D] bf16|e4m3, scale [S] fp32); see :func:`kpool_compress`."""
    with torch.no_grad():
        return tuple(t.contiguous() for t in ref.compress_reference(k, gate, ape, pool_token, mode))


@torch.library.custom_op("glm53::kpool_quant_query", mutates_args=(), device_types="cpu")
def _kpool_quant_query_op(q: _T, w: _T, scale_fmt: str) -> tuple[_T, _T]:
    """(q8 [T,H,D] e4m3, w_eff [T,H] fp32); see :func:`kpool_quant_query`."""
    with torch.no_grad():
        return tuple(t.contiguous() for t in ref.quant_query_reference(q, w, scale_fmt))


@torch.library.custom_op("glm53::kpool_logits", mutates_args=(), device_types="cpu",
                         tags=(torch.Tag.needs_contiguous_strides,))
def _kpool_logits_op(q: _T, w: _T, pool: _T, pool_scale: _T, precision: str, layout: str) -> _T:
    """Pool scores [M,S] fp32, a strided view of the padded MQA workspace; see :func:`kpool_logits`."""
    with torch.no_grad():
        return ref.logits_reference(q, w, pool, pool_scale, precision, layout)


@torch.library.custom_op("glm53::kpool_select", mutates_args=(), device_types="cpu")
def _kpool_select_op(
    logits: _T, q_lo: _T, q_n: _T, tail_start: _T, tail_len: _T, topk: int, pool_size: int, tail: str,
) -> _T:
    """Selected token ids int32 [M, topk+P-1]; see :func:`kpool_select`."""
    with torch.no_grad():
        return ref.select_reference(logits, q_lo, q_n, tail_start, tail_len, topk, pool_size, tail)


# CUDA back-ends (inductor_ext.backends): Triton (inductor_ext/kernels/kpool/), else the plain-torch
# reference, the fallback logged once.


def _plain(reference):
    def kernel(*args):
        with torch.no_grad():
            out = reference(*args)
        return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out

    return kernel


def _triton(entry: str):
    def load():
        from inductor_ext.kernels import kpool

        return getattr(kpool, entry)

    return load


backends.register_triton("glm53::kpool_compress", _triton("kpool_compress_fwd"), _plain(ref.compress_reference))
backends.register_triton("glm53::kpool_quant_query", _triton("kpool_quant_query_fwd"),
                         _plain(ref.quant_query_reference))
backends.register_triton("glm53::kpool_logits", _triton("kpool_logits_fwd"), _plain(ref.logits_reference))
backends.register_triton("glm53::kpool_select", _triton("kpool_select_fwd"), _plain(ref.select_reference))


# ---------------------------------------------------------------------------------------------
# input checks (static: shapes, dtypes, devices, strings; never data)
# ---------------------------------------------------------------------------------------------


def check_choice(name: str, value, allowed) -> None:
    """``ValueError`` unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise input_error(f"kpool: {name} must be one of {allowed}, got {value!r}")


def check_tensor(name: str, t, *, dims: int | None = None, dtypes=None, shape=None) -> None:
    """``ValueError`` unless ``t`` is a cpu/cuda tensor with the given rank, shape and dtype (each optional)."""
    tensors("kpool", **{name: t})
    if dims is not None and t.dim() != dims:
        raise input_error(f"kpool: {name} must be {dims}-D, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise input_error(f"kpool: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise input_error(f"kpool: {name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device.type not in _DEVICES:
        raise input_error(f"kpool: {name} must be on cpu or cuda, got {t.device}")


def check_same_device(**tensors) -> None:
    """``ValueError`` unless the given tensors (``None`` skipped) share one device."""
    devices = {t.device for t in tensors.values() if t is not None}
    if len(devices) > 1:
        raise input_error(f"kpool: {sorted(tensors)} must be on one device, got {sorted(map(str, devices))}")


def check_heads(heads, source: str) -> None:
    """``ValueError`` unless the indexer's head count (``source`` says where it comes from) is one the
    scorer's workspace supports (:data:`inductor_ext.workspace.SUPPORTED_HEADS`)."""
    if heads not in workspace.SUPPORTED_HEADS:
        raise input_error(f"kpool: heads must be one of {workspace.SUPPORTED_HEADS} (H = {source}), got {heads!r}")


def check_positive_int(name: str, value) -> None:
    """``ValueError`` unless ``value`` is a python int > 0 (not ``bool``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise input_error(f"kpool: {name} must be a positive int, got {value!r}")


def check_pool_geometry(topk, pool_size) -> None:
    """``ValueError`` unless both are positive ints and ``pool_size`` divides ``topk``."""
    check_positive_int("topk", topk)
    check_positive_int("pool_size", pool_size)
    if topk % pool_size:
        raise input_error(f"kpool: topk ({topk}) must be divisible by pool_size ({pool_size})")


def _int64_rows(name: str, t, rows) -> None:
    check_tensor(name, t, dims=1, dtypes=(torch.int64,))
    if t.shape[0] != rows:
        raise input_error(f"kpool: {name} must have {rows} rows, got {t.shape[0]}")


def validate_cu_seqlens(cu_seqlens, num_tokens: int) -> None:
    """``cu_seqlens`` must be int64 [N+1] (N >= 1) and non-decreasing from 0 to T: in eager mode a
    host-synchronising data check, while tracing or capturing a device assertion
    (:func:`~inductor_ext.ops._checks.check_cu_seqlens`)."""
    check_tensor("cu_seqlens", cu_seqlens, dims=1, dtypes=(torch.int64,))
    if cu_seqlens.shape[0] < 2:
        raise input_error(f"kpool: cu_seqlens must hold N+1 >= 2 offsets, got {cu_seqlens.shape[0]}")
    check_cu_seqlens("kpool", cu_seqlens, num_tokens)


# ---------------------------------------------------------------------------------------------
# public wrappers
# ---------------------------------------------------------------------------------------------


def kpool_project(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, *, eps=INDEXER_EPS,
                  head_proj=None):
    """Key, compression gate and head weights of the indexer, ``glm53::kpool_project``.

    Args:
        x: hidden states ``[T, hidden]`` (bf16/fp16/fp32, the model dtype).
        wk: ``[D, hidden]``; compress_gate ``[D, hidden]``; weights_proj ``[H, hidden]`` — x's dtype.
        k_norm_weight, k_norm_bias: LayerNorm affine ``[D]`` (any float dtype).
        eps: LayerNorm epsilon (GLM-5.3: 1e-6).
        head_proj: ``"model"`` (transformers: everything in x's dtype, w = proj(x).float()·H^-0.5)
            or ``"fp32"`` (LayerNorm in FP32 with one cast back; weights_proj as an IEEE FP32
            linear); ``None`` takes ``PrecisionConfig.head_proj`` of the active config.

    Returns:
        ``(k [T,D], gate [T,D])`` in x's dtype and ``w [T,H]`` fp32. Autocast is off inside.
    """
    head_proj = _check_project(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, head_proj, eps)
    out = torch.ops.glm53.kpool_project(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate,
                                        float(eps), head_proj)
    return out[0], out[1], out[2]


def kpool_project_batch_invariant(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, *,
                                  eps=INDEXER_EPS, head_proj=None):
    """:func:`kpool_project` (same arguments, results and rounding points) with its three linears
    batch-invariant ``glm53::bi_linear`` products (FP32 accumulation in fixed K blocks, one
    rounding) and its LayerNorm ``glm53::bi_layer_norm`` (fixed-order FP32 statistics, one
    rounding), so each row is bitwise independent of the other rows of the call, and Inductor calls
    the same kernels as eager (its own LayerNorm reduction would not be ATen's).
    ``PrecisionConfig.batch_invariant``'s indexer (``docs/DESIGN.md`` §9)."""
    head_proj = _check_project(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, head_proj, eps)
    return ref.project_reference(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, float(eps), head_proj,
                                 linear=bi_linear, layer_norm=bi_layer_norm)


def _check_project(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, head_proj, eps) -> str:
    """The projection's input rules; returns ``head_proj`` (``None`` → the active config's)."""
    head_proj = active_config().head_proj if head_proj is None else head_proj
    tensors("kpool", x=x, wk=wk, k_norm_weight=k_norm_weight, k_norm_bias=k_norm_bias, weights_proj=weights_proj,
            compress_gate=compress_gate)
    check_choice("head_proj", head_proj, HEAD_PROJ)
    real("kpool", "eps", eps, gt=0)
    check_tensor("x", x, dims=2, dtypes=FLOAT_DTYPES)
    hidden = x.shape[1]
    check_tensor("wk", wk, dims=2, dtypes=(x.dtype,))
    D = wk.shape[0]
    if D != ref.HEAD_DIM:
        raise input_error(f"kpool: index head dim must be {ref.HEAD_DIM}, got wk of shape {tuple(wk.shape)}")
    check_tensor("wk", wk, shape=(D, hidden))
    check_tensor("compress_gate", compress_gate, dtypes=(x.dtype,), shape=(D, hidden))
    check_tensor("weights_proj", weights_proj, dims=2, dtypes=(x.dtype,))
    if weights_proj.shape[1] != hidden:
        raise input_error(f"kpool: weights_proj must be [H, {hidden}], got {tuple(weights_proj.shape)}")
    check_tensor("k_norm_weight", k_norm_weight, dtypes=FLOAT_DTYPES, shape=(D,))
    check_tensor("k_norm_bias", k_norm_bias, dtypes=FLOAT_DTYPES, shape=(D,))
    check_same_device(x=x, wk=wk, compress_gate=compress_gate, weights_proj=weights_proj,
                      k_norm_weight=k_norm_weight, k_norm_bias=k_norm_bias)
    return head_proj


def kpool_layout(cu_seqlens, num_tokens: int, pool_size: int):
    """Pool slots and per-token causal metadata of packed documents (plain torch, traceable,
    no host sync); see :func:`inductor_ext.ops.kpool_reference.layout_reference`.

    Returns int64 ``(pool_token [S], q_lo [T], q_n [T], tail_start [T], tail_len [T])`` with
    S = T // P: pool p of a document covers its tokens P·p .. P·p+P-1; only complete pools exist;
    pool p is selectable at document position t iff p < (t+1)//P.
    """
    check_positive_int("pool_size", pool_size)
    integer("kpool", "num_tokens", num_tokens, ge=0)
    validate_cu_seqlens(cu_seqlens, num_tokens)
    return ref.layout_reference(cu_seqlens, num_tokens, pool_size)


def kpool_compress(k, gate, ape, pool_token, *, mode):
    """Pool compression, ``glm53::kpool_compress``.

    Args:
        k, gate: ``[T, 128]`` bf16 (normalized keys and compression gate logits).
        ape: ``[P, 128]`` fp32 (or bf16) absolute position embedding inside a pool.
        pool_token: ``[S]`` int64 first token of each pool slot, -1 unused (:func:`kpool_layout`).
        mode: ``"bf16_reference"`` (transformers: probs = softmax_P(gate.float()+ape) rounded to
            bf16, bf16 products, summed), ``"bf16_fp32"`` (FP32 pooling, one bf16 store),
            ``"fp8_ue8m0"`` / ``"fp8_fp32"`` (serving: FP32 pooling → bf16 → Hadamard-128 → bf16
            → e4m3 with a power-of-two or plain FP32 per-pool scale, amax floored at 1e-4).

    Returns:
        ``(pool [S,128], scale [S] fp32)``: pool bf16 (scale 1) or float8_e4m3fn; unused slots are
        zeros with scale 0. A pool token must be -1 or in ``[0, T - P]`` (a pool's P tokens are rows
        of k): checked in eager mode only (it reads the data).
    """
    check_choice("mode", mode, ref.COMPRESS_MODES)
    check_tensor("k", k, dims=2, dtypes=(torch.bfloat16,))
    check_tensor("gate", gate, dtypes=(torch.bfloat16,), shape=k.shape)
    if k.shape[1] != ref.HEAD_DIM:
        raise input_error(f"kpool: k must be [T, {ref.HEAD_DIM}], got {tuple(k.shape)}")
    check_tensor("ape", ape, dims=2, dtypes=FLOAT_DTYPES)
    if ape.shape[1] != ref.HEAD_DIM or ape.shape[0] < 1:
        raise input_error(f"kpool: ape must be [P, {ref.HEAD_DIM}] with P >= 1, got {tuple(ape.shape)}")
    check_tensor("pool_token", pool_token, dims=1, dtypes=(torch.int64,))
    check_same_device(k=k, gate=gate, ape=ape, pool_token=pool_token)
    if eager(pool_token) and pool_token.numel():
        T, P = k.shape[0], ape.shape[0]
        if not bool(((pool_token == -1) | ((pool_token >= 0) & (pool_token <= T - P))).all()):
            raise input_error(f"kpool: pool_token must be -1 or in [0, T-P={T - P}] (a pool's {P} tokens are rows "
                              f"of k [T={T}]), got values in [{pool_token.min().item()}, {pool_token.max().item()}]")
    out = torch.ops.glm53.kpool_compress(k, gate, ape, pool_token, mode)
    return out[0], out[1]


def kpool_quant_query(q, w, *, scale_fmt=INDEXER_SCALE_FMT):
    """FP8 query, ``glm53::kpool_quant_query``: Hadamard-128 (FP32) → bf16 → per (token, head)
    e4m3 with scale ``s = max(amax, 1e-4)/448`` (``"ue8m0"``: rounded up to a power of two,
    ``"fp32"``: as is), folded into the head weight.

    Args: q ``[T, H, 128]`` bf16; w ``[T, H]`` fp32 head weights (already ×H^-0.5).
    Returns: ``(q8 [T,H,128] float8_e4m3fn, w_eff [T,H] fp32 = w·s·128^-0.5)``.
    """
    check_choice("scale_fmt", scale_fmt, ref.SCALE_FMTS)
    check_tensor("q", q, dims=3, dtypes=(torch.bfloat16,))
    if q.shape[2] != ref.HEAD_DIM:
        raise input_error(f"kpool: q must be [T, H, {ref.HEAD_DIM}], got {tuple(q.shape)}")
    check_tensor("w", w, dtypes=(torch.float32,), shape=q.shape[:2])
    check_same_device(q=q, w=w)
    out = torch.ops.glm53.kpool_quant_query(q, w, scale_fmt)
    return out[0], out[1]


def kpool_logits(q, w, pool, pool_scale, *, precision, layout="compact"):
    """MQA pool scores, ``glm53::kpool_logits``.

    Args:
        q: ``[M, H, 128]`` bf16 (``"bf16"``) or float8_e4m3fn (``"fp8"``); H in 32, 64, 128.
        w: ``[M, H]`` fp32 head weights (``"fp8"``: the folded ``w_eff``).
        pool: ``[S, 128]`` bf16 or float8_e4m3fn (same precision as q); pool_scale ``[S]`` fp32.
        precision: ``"bf16"``: score = Σ_h w·relu(q·pool·128^-0.5); ``"fp8"``:
            score = scale[p]·Σ_h w_eff·relu(q8·k8). FP32 accumulation of exact products (the CPU
            kernel); on CUDA the FP8 dots accumulate on the FP8 tensor cores as the serving
            scorer (DeepGEMM ``fp8_mqa_logits``) does, ~1e-4 relative from the FP32 sums
            (:mod:`inductor_ext.kernels.kpool.score`).
        layout: ``"compact"`` | ``"legacy"``: the padded workspace layout (:mod:`inductor_ext.workspace`).

    Returns:
        FP32 ``[M, S]``, a view with row stride ``workspace.mqa_logits_stride(S, layout)`` of one
        storage of ``workspace.mqa_logits_bytes(M, S, H, layout)`` bytes. Not causally masked.
    """
    check_choice("layout", layout, workspace.LAYOUTS)
    _check_logits(q, w, pool, pool_scale, precision)
    return torch.ops.glm53.kpool_logits(q, w, pool, pool_scale, precision, layout)


def kpool_logits_batch_invariant(q, w, pool, pool_scale, *, precision):
    """:func:`kpool_logits`' scores (same arguments but ``layout``) with batch-invariant arithmetic,
    ``PrecisionConfig.batch_invariant``'s scorer: ``q·pool`` per (row, head, pool) as one
    ``glm53::bi_linear`` of BF16 operands (FP8 values are exact in BF16; exact products, FP32
    accumulation in fixed K blocks), ``relu`` (after ``·128^-0.5`` for ``"bf16"``), the head sum
    as an ordered chain (:func:`~inductor_ext.ops.ordered.ordered_sum`), then ``·pool_scale`` for
    ``"fp8"``. Returns contiguous FP32 ``[M, S]``; each element depends only on its row of q and w
    and its pool, never on M or S. Within FP32 rounding of the reference (another summation order)."""
    _check_logits(q, w, pool, pool_scale, precision)
    M, H, D = q.shape
    if pool.shape[0] == 0:  # no complete pool (a document shorter than P)
        return torch.zeros(M, 0, dtype=torch.float32, device=q.device)
    with torch.autocast(device_type=q.device.type, enabled=False):
        s = bi_linear(q.reshape(M * H, D).to(torch.bfloat16), pool.to(torch.bfloat16), out_dtype=torch.float32)
        s = s.view(M, H, pool.shape[0])
        s = torch.relu(s * ref.HEAD_DIM**-0.5) if precision == "bf16" else torch.relu(s)
        out = ordered_sum(w[:, :, None] * s, dim=1)
        return out if precision == "bf16" else out * pool_scale[None, :]


def _check_logits(q, w, pool, pool_scale, precision) -> None:
    check_choice("precision", precision, PRECISIONS)
    qdtype = torch.bfloat16 if precision == "bf16" else torch.float8_e4m3fn
    check_tensor("q", q, dims=3, dtypes=(qdtype,))
    M, H, D = q.shape
    check_heads(H, "q.shape[1]")
    if D != ref.HEAD_DIM:
        raise input_error(f"kpool: q must be [M, H, {ref.HEAD_DIM}], got {tuple(q.shape)}")
    check_tensor("w", w, dtypes=(torch.float32,), shape=(M, H))
    check_tensor("pool", pool, dims=2, dtypes=(qdtype,))
    if pool.shape[1] != D:
        raise input_error(f"kpool: pool must be [S, {D}], got {tuple(pool.shape)}")
    check_tensor("pool_scale", pool_scale, dtypes=(torch.float32,), shape=pool.shape[:1])
    check_same_device(q=q, w=w, pool=pool, pool_scale=pool_scale)


def kpool_select(logits, q_lo, q_n, tail_start, tail_len, *, topk, pool_size, tail="compact", num_tokens=None):
    """Causal group selection and token expansion, ``glm53::kpool_select``.

    Args:
        logits: ``[M, S]`` fp32 pool scores (any strides).
        q_lo, q_n, tail_start, tail_len: ``[M]`` int64 rows of :func:`kpool_layout`.
        topk: selected tokens (multiple of pool_size); pool_size: P.
        tail: ``"compact"`` (tail right after the selected pools, serving order) or ``"fixed"``
            (tail at columns topk .. topk+P-2).
        num_tokens: optional T, the number of tokens the ids index (the op cannot know it).

    In eager mode (it reads the rows: a host synchronisation) the rows must be a layout's: q_lo,
    q_n >= 0, ``q_lo + q_n <= S``, ``0 <= tail_len < P``, a document start ``tail_start - P·q_n
    >= 0`` and, with ``num_tokens``, ``tail_start + tail_len <= num_tokens`` (every id < T);
    ``ValueError`` otherwise, so no id beyond T is emitted.

    Returns:
        int32 ``[M, topk + P - 1]`` global token ids: the P tokens of each of the top
        ``min(topk/P, q_n)`` visible pools (equal scores: lower pool first) in ascending pool
        order, the visible tail tokens, -1 padding. With ``tail="compact"`` a row is ascending
        ids, then -1.
    """
    check_choice("tail", tail, TAILS)
    check_pool_geometry(topk, pool_size)
    check_tensor("logits", logits, dims=2, dtypes=(torch.float32,))
    M = logits.shape[0]
    for name, t in (("q_lo", q_lo), ("q_n", q_n), ("tail_start", tail_start), ("tail_len", tail_len)):
        _int64_rows(name, t, M)
    check_same_device(logits=logits, q_lo=q_lo, q_n=q_n, tail_start=tail_start, tail_len=tail_len)
    if num_tokens is not None:
        integer("kpool", "num_tokens", num_tokens, ge=0)
    if eager(q_lo, q_n, tail_start, tail_len) and M:
        _check_select_rows(logits.shape[1], q_lo, q_n, tail_start, tail_len, pool_size, num_tokens)
    return torch.ops.glm53.kpool_select(logits, q_lo, q_n, tail_start, tail_len, topk, pool_size, tail)


def _check_select_rows(S, q_lo, q_n, tail_start, tail_len, P, num_tokens) -> None:
    """The data rules of :func:`kpool_select`'s rows (eager mode only: reads them)."""
    doc_start = tail_start - P * q_n
    ok = (q_lo >= 0) & (q_n >= 0) & (q_lo + q_n <= S) & (tail_len >= 0) & (tail_len < P) & (doc_start >= 0)
    if num_tokens is not None:
        ok &= tail_start + tail_len <= num_tokens
    bad = (~ok).nonzero()
    if bad.numel():
        r = int(bad[0, 0])
        bound = f"{num_tokens}" if num_tokens is not None else "T"
        raise input_error(
            f"kpool: kpool_select rows must be a layout's (q_lo, q_n >= 0, q_lo + q_n <= S={S}, 0 <= tail_len < "
            f"P={P}, tail_start - P*q_n >= 0, tail_start + tail_len <= num_tokens={bound}); row {r} has q_lo="
            f"{int(q_lo[r])}, q_n={int(q_n[r])}, tail_start={int(tail_start[r])}, tail_len={int(tail_len[r])}")
