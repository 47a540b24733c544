"""Sparse attention over the token ids the KPool indexer selected (DSA), forward + backward in
the same graph as the rest of the layer.

Both kernels read a boolean selection mask ``[T, T]`` built by a scatter from the ids (static
shapes, no host sync):

- ``"eager"`` (CPU path, transformers numerics): scores ``q·kᵀ·scale`` in the model dtype, masked,
  softmax in FP32 rounded to the model dtype, ``p·v``. Memory O(H·T²).
- ``"flex"``: FlexAttention with a block mask built from the selection mask. Measured on the H200
  (T=8192, 64 heads, dim 256, 2051 keys/query): 7.7 ms forward / 55 ms forward+backward against
  3.6 / 17.6 ms for dense causal SDPA — token-level picks leave no empty blocks, so it is a correct
  single-graph path, not a fast one (a gather kernel is the fast path).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["selection_mask", "sparse_attention", "IMPLS", "MAX_MASK_TOKENS"]

IMPLS = ("eager", "flex")
# the [T, T] mask kernels are kept for parity with transformers, not for length: past this many
# tokens the decompressed form refuses (the absorbed form, ops.sparse_mla, is O(T·topk))
MAX_MASK_TOKENS = 16384


def selection_mask(token_ids: torch.Tensor, num_keys: int) -> torch.Tensor:
    """bool ``[T, num_keys]``: True where key j is among row t's ids (-1 entries ignored)."""
    ids = token_ids.long()
    col = torch.where(ids >= 0, ids, num_keys)  # -1 → a spare column, dropped below
    mask = torch.zeros(ids.shape[0], num_keys + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter(1, col, True)[:, :num_keys]


def _eager(q, k, v, mask, scale):
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # [H, T, d]
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)


@functools.cache
def _fused_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, fullgraph=True, dynamic=False)


def _flex_kernel(device: torch.device):
    """FlexAttention's fused kernel on CUDA, also when the layer runs eagerly: called without
    ``torch.compile`` it runs unfused math that materializes ``[H, T, S]`` scores (out of memory at
    the h200 lengths) and rounds differently from the kernel the compiled layer runs, so eager and
    compiled layers would differ by the attention kernel alone. Inside a compiled graph Dynamo
    inlines the compiled function. On the CPU (tiny shapes) the unfused math is the reference."""
    from torch.nn.attention.flex_attention import flex_attention

    return _fused_flex_attention() if device.type == "cuda" else flex_attention


def _flex(q, k, v, mask, scale):
    from torch.nn.attention.flex_attention import create_block_mask

    T, S = mask.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[q_idx, kv_idx]

    block_mask = create_block_mask(mask_mod, None, None, T, S, device=q.device)
    out = _flex_kernel(q.device)(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=block_mask, scale=scale)
    return out[0].transpose(0, 1)


def sparse_attention(q, k, v, token_ids, *, scale: float, impl: str = "eager") -> torch.Tensor:
    """Attention of each query over its selected keys only.

    Args:
        q: ``[T, H, Dqk]``; k ``[S, H, Dqk]``, v ``[S, H, Dv]`` (one dtype; S keys: T, or the
            global tokens of a context-parallel batch whose T local queries attend over them).
        token_ids: int32/int64 ``[T, W]`` key ids (rows of k) per query, -1 padding (the KPool
            indexer's output: every row holds at least one id).
        scale: softmax scale; impl: ``"eager"`` | ``"flex"`` (see the module docstring).

    Returns:
        ``[T, H, Dv]`` in q's dtype; differentiable in q, k and v.
    """
    if impl not in IMPLS:
        raise ValueError(f"sparse_attention: impl must be one of {IMPLS}, got {impl!r}")
    if q.dim() != 3 or k.dim() != 3 or k.shape[1:] != q.shape[1:] or v.dim() != 3 or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"sparse_attention: q must be [T, H, D], k [S, H, D] and v [S, H, Dv], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if token_ids.dim() != 2 or token_ids.shape[0] != q.shape[0] or token_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_attention: token_ids must be int32/int64 [T={q.shape[0]}, W], got "
                         f"{token_ids.dtype} {tuple(token_ids.shape)}")
    if k.shape[0] > MAX_MASK_TOKENS:
        raise ValueError(f"sparse_attention: the decompressed form builds a [T, T] selection mask and is kept "
                         f"for parity up to {MAX_MASK_TOKENS} tokens, got {k.shape[0]}; use "
                         f"PrecisionConfig(mla=\"absorbed\") (ops.sparse_mla, O(T·topk)) for longer sequences")
    mask = selection_mask(token_ids, k.shape[0])
    return (_eager if impl == "eager" else _flex)(q, k, v, mask, scale)
