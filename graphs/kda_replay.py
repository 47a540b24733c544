"""KDA chunk replay: the batch-invariant serving decode of a KDA layer (``docs/DESIGN.md`` §9).

``kda_chunk`` cuts every document into chunks of :data:`CHUNK` = 64 tokens from the document's
start (from its first token in the call: a call with ``initial_state`` continues the document, and
its chunks start at the call's first token). A decode step therefore reproduces the chunk forward's
row of its token by running the same op on the same chunk: the decoder keeps, per sequence, the
FP32 state at the last chunk boundary and the open chunk's :meth:`LinearAttention.mix` inputs (the
layer input ``x`` and the post-conv q/k/v rows, model dtype), and a step runs ``mix`` (``kda_chunk``
at ``prec.kda``, never ``kda_recurrent``) on the open chunk from the boundary state, keeping the
new token's row. The step that completes a chunk (document length a multiple of 64) advances the
boundary state to that run's final state, which is the full forward's state after the chunk (same
op, same inputs, same chunk).

The open chunk is run *zero-padded to all 64 rows*, never as a partial chunk: row i of a chunk
reads the rows after i only through exact zeros (the causal decay mask, the triangular solve), so
its bits do not depend on what those rows hold, but they do depend on the chunk's row count on the
CPU: MKL's product of a 1-row ``[1, K] @ [K, V]`` (the state terms ``w @ h`` and ``q·e^g @ h``) and
of a 2- or 3-row lower-triangular ``[c, c] @ [c, V]`` round differently from the same rows inside 64
(a few FP32 ulps, ~1e-5 relative). A padded chunk has the full chunk's shapes, hence its row i
(the CPU reference pads a document's own last, partial chunk the same way; the CUDA kernels always
run 64-row tiles). Past the new row the padded run's rows and final state are
unused; the buffers are zeroed when a chunk completes.

Cost per step: ``mix`` over 64 rows per sequence (O(chunk), against O(1) for the recurrence).
Cache per sequence: the boundary state ``[H, K, V]`` FP32 plus ``[64, hidden]`` and
``[64, 3·H·K]`` model-dtype buffers.
"""

from __future__ import annotations

import torch

from graphs.kda_layer import LinearAttention
from inductor_ext import PrecisionConfig
from inductor_ext.ops.kda_reference import CHUNK

__all__ = ["CHUNK", "replay_prefill", "replay_step"]


def _mix(attn: LinearAttention, x, qkv, prec, state):
    """``mix`` (chunk form) of n packed documents of ``length`` rows each: ``x``, ``qkv`` ``[n, length, ·]``."""
    n, length = x.shape[:2]
    cu = torch.arange(n + 1, dtype=torch.int64, device=x.device) * length
    out, final = attn.mix(x.reshape(n * length, -1), qkv.reshape(n * length, -1), cu, prec, serving=False,
                          initial_state=state)
    return out.view(n, length, -1), final


def replay_prefill(attn: LinearAttention, x: torch.Tensor, qkv: torch.Tensor, n: int, length: int,
                   prec: PrecisionConfig, initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The chunk forward of n packed documents of ``length`` tokens (``x [n·length, hidden]``, post-conv
    ``qkv [n·length, 3·H·K]``, optional FP32 ``initial_state [n, H, K, V]``) → (out ``[n·length, hidden]``,
    replay cache ``{"state", "open_x", "open_qkv"}``). Two calls: the complete chunks (the state at
    the last boundary comes out of it), then the open chunk, padded like a step's."""
    b = CHUNK * (length // CHUNK)  # the last chunk boundary
    xs, qs = x.view(n, length, -1), qkv.view(n, length, -1)
    state, outs = initial_state, []
    if b:
        out, state = _mix(attn, xs[:, :b], qs[:, :b], prec, state)
        outs.append(out)
    if state is None:
        state = x.new_zeros(n, attn.num_heads, attn.head_dim, attn.head_dim, dtype=torch.float32)
    open_x, open_qkv = xs.new_zeros(n, CHUNK, xs.shape[-1]), qs.new_zeros(n, CHUNK, qs.shape[-1])
    open_x[:, : length - b], open_qkv[:, : length - b] = xs[:, b:], qs[:, b:]
    if length > b:
        outs.append(_mix(attn, open_x, open_qkv, prec, state)[0][:, : length - b])
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return out.reshape(n * length, -1), {"state": state, "open_x": open_x, "open_qkv": open_qkv}


def replay_step(attn: LinearAttention, x: torch.Tensor, qkv: torch.Tensor, length: int, cache: dict,
                prec: PrecisionConfig) -> tuple[torch.Tensor, dict]:
    """One new token per sequence (``x [n, hidden]``, post-conv ``qkv [n, 3·H·K]``), each now at
    document position ``length - 1`` → (its chunk-forward output row ``[n, hidden]``, ``cache``
    updated in place and returned)."""
    c = (length - 1) % CHUNK + 1  # rows of the open chunk, the new token included
    cache["open_x"][:, c - 1] = x
    cache["open_qkv"][:, c - 1] = qkv
    out, final = _mix(attn, cache["open_x"], cache["open_qkv"], prec, cache["state"])
    if c == CHUNK:  # the chunk is complete: its final state is the next boundary state
        cache["state"] = final
        cache["open_x"].zero_()
        cache["open_qkv"].zero_()
    return out[:, c - 1].contiguous(), cache
