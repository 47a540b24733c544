"""Plain-torch reference kernels of the KPool indexer (``docs/DESIGN.md`` §4, "KPool indexer").

Device-generic (CPU and CUDA run the same code); every function has static output shapes, so the
ops built on them never synchronise with the host. Shapes: T tokens (packed documents, batch 1),
H indexer heads, D = 128 head dim, P pool size, S = T // P pool slots (an upper bound on the
number of complete pools over all documents: Σ floor(L_i/P) <= floor(Σ L_i / P)).

Numerics that must match the serving kernels (LMDeploy ``compress_kpool`` mode="decode",
``rotate_kpool_query``; SGLang ``_hadamard_quantize_fp8``; DeepSeek ``act_quant``):

- pooling, FP32 ("decode" two-pass): m = max_s(gate_s + ape_s); p_s = exp(gate_s + ape_s - m)
  (correctly rounded: FP64 exp, one rounding to FP32; the serving kernel's approximate exp is
  within ~2 ulp of it);
  acc = Σ_s k_s·p_s and den = Σ_s p_s accumulated slot by slot without FMA; pool = acc / den.
- Hadamard-128: radix-2 butterflies of stride 1, 2, ..., 64 in FP32 (low = a+b, high = a-b), then
  ×128^-0.5; orthonormal and symmetric.
- pool FP8: x = bf16(acc/den) → Hadamard → bf16; amax = max(max|x|, 1e-4);
  s = amax · fp32(1/448) (serving multiplies by the reciprocal); ue8m0: s = 2^ceil(log2 s);
  q = e4m3(clamp(x / s, ±448)).
- query FP8: per (token, head), x = bf16(Hadamard(q)); same amax floor, s = amax / 448 (DeepSeek
  ``act_quant`` divides), same ue8m0 rounding; the head weight absorbs s and 128^-0.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inductor_ext.ops.fp8_qdq_reference import FP8_MAX, pow2_ceil
from inductor_ext.ops.packing import segment_of
from inductor_ext.workspace import logits_view

__all__ = [
    "HEAD_DIM",
    "FP8_MAX",
    "AMAX_FLOOR",
    "COMPRESS_MODES",
    "SCALE_FMTS",
    "hadamard128",
    "quantize_e4m3",
    "layout_reference",
    "project_reference",
    "compress_reference",
    "quant_query_reference",
    "logits_reference",
    "select_reference",
]

HEAD_DIM = 128
AMAX_FLOOR = 1e-4  # serving: tl.maximum(absmax, 1e-4) in compress_kpool and act_quant
COMPRESS_MODES = ("bf16_reference", "bf16_fp32", "fp8_ue8m0", "fp8_fp32")
SCALE_FMTS = ("ue8m0", "fp32")
_INV_FP8_MAX = 1.0 / FP8_MAX  # rounded to FP32 when it multiplies an FP32 tensor, as in Triton


def _no_autocast(device: torch.device):
    return torch.autocast(device_type=device.type, enabled=False)


def hadamard128(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Hadamard transform of the last dim (128) in FP32: 7 butterfly stages
    (stride 1 → 64; low half a+b, high half a-b) then ×128^-0.5. Input any float dtype; FP32 out."""
    y = x.float()
    lead = y.shape[:-1]
    stride = 1
    while stride < HEAD_DIM:
        pairs = y.reshape(*lead, HEAD_DIM // (2 * stride), 2, stride)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, HEAD_DIM)
        stride *= 2
    return y * HEAD_DIM**-0.5


def quantize_e4m3(x: torch.Tensor, scale_fmt: str, reciprocal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) e4m3 quantization of FP32 ``x [..., 128]``.

    amax floored at 1e-4; scale ``amax·fp32(1/448)`` when ``reciprocal`` (pool path) else
    ``amax/448`` (query path); ``"ue8m0"`` rounds it up to a power of two, exactly, from the FP32
    bits (:func:`~inductor_ext.ops.fp8_qdq_reference.pow2_ceil`). Returns
    ``(q float8_e4m3fn [..., 128], scale fp32 [...])``.
    """
    amax = x.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    scale = amax * _INV_FP8_MAX if reciprocal else amax / FP8_MAX
    if scale_fmt == "ue8m0":
        scale = pow2_ceil(scale)
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def layout_reference(cu_seqlens: torch.Tensor, num_tokens: int, pool_size: int):
    """Pool-slot and per-token metadata for packed documents, vectorised (no host sync).

    Pools restart at each document start; only complete pools exist. Pool slots are packed
    document after document: slot ``pool_cum[d] + p`` holds pool p of document d.

    Returns int64 tensors:
        pool_token [S]: global id of the first token of each slot's pool, -1 for unused slots;
        q_lo [T]: first slot of the token's document;
        q_n [T]: selectable pools, ``(pos + 1) // P`` with pos the position inside its document;
        tail_start [T]: first token of the visible incomplete pool, ``doc_start + P·q_n``;
        tail_len [T]: visible tail tokens, ``pos + 1 - P·q_n`` (0 .. P-1).
    """
    cu = cu_seqlens.to(torch.int64)
    dev = cu.device
    P = pool_size
    S = num_tokens // P
    tok = torch.arange(num_tokens, device=dev, dtype=torch.int64)
    doc = segment_of(cu, tok)
    doc_start = cu[doc]
    pos = tok - doc_start
    q_n = torch.div(pos + 1, P, rounding_mode="floor")
    # complete pools of each document, cumulated: [N+1] tensors only (a slice of N documents would
    # specialize a compiled graph on N == 1)
    lengths = torch.where(torch.arange(cu.shape[0], device=dev) == 0, 0, cu - torch.roll(cu, 1))
    pool_cum = torch.div(lengths, P, rounding_mode="floor").cumsum(0)
    q_lo = pool_cum[doc]
    slot = torch.arange(S, device=dev, dtype=torch.int64)
    slot_doc = segment_of(pool_cum, slot)
    first = cu[slot_doc] + P * (slot - pool_cum[slot_doc])
    pool_token = torch.where(slot < pool_cum[-1], first, torch.full_like(first, -1))
    tail_start = doc_start + P * q_n
    tail_len = tok + 1 - tail_start
    return pool_token, q_lo, q_n, tail_start, tail_len


def _layer_norm_in_weight_dtype(k, weight, bias, eps: float):
    """``F.layer_norm`` of k in the dtype of weight and bias, rounded once to k's dtype."""
    return F.layer_norm(k.to(weight.dtype), (k.shape[-1],), weight, bias, eps).to(k.dtype)


def project_reference(x, wk, k_norm_weight, k_norm_bias, weights_proj, compress_gate, eps: float, head_proj: str,
                      linear=F.linear, layer_norm=_layer_norm_in_weight_dtype):
    """k = LayerNorm(x·wkᵀ) [T,D], gate = x·compress_gateᵀ [T,D] (x's dtype) and head weights
    w = (x·weights_projᵀ)·H^-0.5 [T,H] FP32. ``head_proj="model"``: linears and LayerNorm in x's
    dtype (transformers); ``"fp32"``: LayerNorm in FP32 then one cast, weights_proj as an IEEE
    FP32 linear. Autocast is off inside. ``linear``: the product ``linear(x, W)`` (``F.linear``; the
    batch-invariant indexer passes ``ops.bi_linear``). ``layer_norm``: ``layer_norm(k, weight, bias,
    eps)`` in the weight's dtype (at least FP32 for the batch-invariant indexer's ``ops.bi_layer_norm``),
    rounded once to k's dtype."""
    H = weights_proj.shape[0]
    with _no_autocast(x.device):
        kp = linear(x, wk)
        if head_proj == "fp32":
            k = layer_norm(kp, k_norm_weight.float(), k_norm_bias.float(), eps)
            w = linear(x.float(), weights_proj.float()) * H**-0.5
        else:
            k = layer_norm(kp, k_norm_weight.to(kp.dtype), k_norm_bias.to(kp.dtype), eps)
            w = linear(x, weights_proj).float() * H**-0.5
        gate = linear(x, compress_gate)
    return k, gate, w


def _pool_fp32(kk: torch.Tensor, gg: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """Serving "decode" pooling: two passes over the P slots, FP32, no FMA. kk, gg [S,P,D]."""
    P = kk.shape[1]
    scores = [gg[:, s].float() + ape[s].float() for s in range(P)]
    m = scores[0]
    for s in range(1, P):
        m = torch.maximum(m, scores[s])
    acc = torch.zeros_like(m)
    den = torch.zeros_like(m)
    for s in range(P):
        p = torch.exp((scores[s] - m).double()).float()  # correctly rounded, as the CUDA kernel
        den = den + p
        acc = acc + kk[:, s].float() * p
    return acc / den


def compress_reference(k, gate, ape, pool_token, mode: str):
    """Pool compression into S = ``pool_token.shape[0]`` slots.

    Args: k, gate [T,D] (bf16); ape [P,D] (fp32); pool_token [S] int64 (-1 = unused slot).
    Returns ``(pool [S,D], scale [S] fp32)``: bf16 pools with scale 1 for ``"bf16_reference"``
    (transformers: probs rounded to bf16, bf16 products, summed) and ``"bf16_fp32"`` (FP32
    pooling, one store); e4m3 pools with their scale for ``"fp8_ue8m0"`` / ``"fp8_fp32"``.
    Unused slots hold zeros with scale 0.
    """
    T, D = k.shape
    P = ape.shape[0]
    valid = pool_token >= 0
    offsets = torch.arange(P, device=k.device, dtype=torch.int64)
    idx = (pool_token.clamp_min(0)[:, None] + offsets).clamp(0, max(T - 1, 0))
    kk, gg = k[idx], gate[idx]  # [S,P,D]
    if mode == "bf16_reference":
        probs = (gg.float() + ape.float()).softmax(dim=1).to(k.dtype)
        pool = (probs * kk).sum(dim=1)
        scale = torch.ones(pool.shape[0], device=k.device, dtype=torch.float32)
    else:
        x = _pool_fp32(kk, gg, ape)
        if mode == "bf16_fp32":
            pool = x.to(k.dtype)
            scale = torch.ones(pool.shape[0], device=k.device, dtype=torch.float32)
        else:
            x = hadamard128(x.to(torch.bfloat16)).to(torch.bfloat16).float()
            pool, scale = quantize_e4m3(x, mode[len("fp8_"):], reciprocal=True)
    pool = torch.where(valid[:, None], pool, torch.zeros_like(pool))
    scale = torch.where(valid, scale, torch.zeros_like(scale))
    return pool, scale


def quant_query_reference(q, w, scale_fmt: str):
    """FP8 query: bf16(Hadamard(q)) quantized per (token, head); ``w_eff = w·s_q·128^-0.5``.
    q [T,H,D] bf16, w [T,H] fp32 → (q8 [T,H,D] e4m3, w_eff [T,H] fp32)."""
    qr = hadamard128(q).to(torch.bfloat16).float()
    q8, sq = quantize_e4m3(qr, scale_fmt, reciprocal=False)
    return q8, w * sq * HEAD_DIM**-0.5


def logits_reference(q, w, pool, pool_scale, precision: str, layout: str) -> torch.Tensor:
    """Pool scores ``[M, S]`` FP32, written into a padded MQA workspace (strided view).

    ``"bf16"``: Σ_h w[t,h]·relu(q[t,h]·pool[p]·128^-0.5); ``"fp8"``:
    scale[p]·Σ_h w_eff[t,h]·relu(q8[t,h]·k8[p]). FP32 products and accumulation (the CUDA
    FP8 scorer sums on the FP8 tensor cores instead, as serving does: within DeepGEMM's
    normalized error 5e-6 of this). Every slot column is scored (unused slots score 0);
    causality is applied by selection.
    """
    M, H, _ = q.shape
    out = logits_view(M, pool.shape[0], H, layout, q.device)
    with _no_autocast(q.device):
        s = torch.matmul(q.float(), pool.float().t())  # [M,H,S]
        if precision == "bf16":
            s = F.relu(s * HEAD_DIM**-0.5)
            out.copy_(torch.matmul(w.float().unsqueeze(1), s).squeeze(1))
        else:
            s = F.relu(s)
            out.copy_(torch.matmul(w.float().unsqueeze(1), s).squeeze(1) * pool_scale[None, :])
    return out


def select_reference(logits, q_lo, q_n, tail_start, tail_len, topk: int, pool_size: int, tail: str):
    """Causal group selection and token expansion → int32 ``[M, topk + P - 1]``.

    Per row: the top ``min(topk/P, q_n)`` pools among slots ``[q_lo, q_lo + q_n)`` (equal scores:
    lowest slot first), in ascending slot order, each expanded to its P global token ids, then the
    ``tail_len`` visible tail tokens, then -1. ``tail="compact"`` puts the tail right after the
    selected pools (the row is then ascending ids, then -1); ``"fixed"`` at columns ``topk .. topk+P-2``.
    """
    M, S = logits.shape
    P = pool_size
    width = topk + P - 1
    dev = logits.device
    out = torch.full((M, width), -1, dtype=torch.int64, device=dev)
    K = min(topk // P, S)
    nsel = torch.clamp(q_n, max=K)
    if K > 0:
        cols = torch.arange(S, device=dev, dtype=torch.int64)
        visible = (cols >= q_lo[:, None]) & (cols < (q_lo + q_n)[:, None])
        # visible slots first, by descending score, equal scores lowest slot first (two stable
        # sorts); masking invisible slots with -inf instead would let them tie with -inf scores
        order = torch.sort(logits, dim=1, descending=True, stable=True).indices
        by_visibility = torch.sort(visible.gather(1, order).to(torch.int8), dim=1, descending=True, stable=True)
        idx = order.gather(1, by_visibility.indices[:, :K])  # [M,K]
        keep = torch.arange(K, device=dev)[None, :] < nsel[:, None]
        idx = torch.where(keep, idx, S).sort(dim=1).values  # selected slots ascending, unkept last
        first = _slot_first_token(idx, tail_start, q_lo, q_n, P)
        tokens = first[..., None] + torch.arange(P, device=dev)
        tokens = torch.where(keep[..., None], tokens, torch.full_like(tokens, -1))
        out[:, : K * P] = tokens.reshape(M, K * P)
    if P > 1:
        j = torch.arange(P - 1, device=dev, dtype=torch.int64)
        ids = tail_start[:, None] + j
        ids = torch.where(j[None, :] < tail_len[:, None], ids, torch.full_like(ids, -1))
        base = nsel * P if tail == "compact" else torch.full_like(nsel, topk)
        out.scatter_(1, base[:, None] + j, ids)
    return out.to(torch.int32)


def _slot_first_token(idx, tail_start, q_lo, q_n, P):
    # slots of one document are consecutive pools starting at the document start, so
    # first token = doc_start + P·(slot - q_lo), with doc_start = tail_start - P·q_n
    doc_start = tail_start - P * q_n
    return doc_start[:, None] + P * (idx - q_lo[:, None])
