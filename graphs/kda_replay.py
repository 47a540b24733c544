"""KDA chunk replay: the batch-invariant serving decode of a KDA layer (``docs/DESIGN.md`` §9).

``kda_chunk`` cuts every document into chunks of :data:`CHUNK` = 64 tokens from the document's
start (from its first token in the call: a call with ``initial_state`` continues the document, and
its chunks start at the call's first token). A decode step therefore reproduces the chunk forward's
row of its token by running the same op on the same chunk: the decoder keeps, per sequence, the
FP32 state at the last chunk boundary and the open chunk's KDA inputs (the post-conv q/k/v rows
and the gates), and a step runs the core (``kda_chunk`` at ``prec.kda``, never ``kda_recurrent``) on
the open chunk from the boundary state, keeping the new token's row. The step that completes a
chunk (document length a multiple of 64) advances the boundary state to that run's final state,
which is the full forward's state after the chunk (same op, same inputs, same chunk).

Only the KDA core (``LinearAttention.core``) runs per chunk: the gates (``LinearAttention.gates``)
and the output stage (``LinearAttention.output``: output gate, gated RMSNorm, o_proj) are per token
and batch-invariant, so a step computes them for its new rows only and caches the gates.

The open chunk's core is run *zero-padded to all 64 rows*, never as a partial chunk: row i of a chunk
reads the rows after i only through exact zeros (the causal decay mask, the triangular solve), so
its bits do not depend on what those rows hold, but they do depend on the chunk's row count on the
CPU: MKL's product of a 1-row ``[1, K] @ [K, V]`` (the state terms ``w @ h`` and ``q·e^g @ h``) and
of a 2- or 3-row lower-triangular ``[c, c] @ [c, V]`` round differently from the same rows inside 64
(a few FP32 ulps, ~1e-5 relative). A padded chunk has the full chunk's shapes, hence its row i
(the CPU reference pads a document's own last, partial chunk the same way; the CUDA kernels always
run 64-row tiles). Past the new row the padded run's rows and final state are
unused; the buffers are zeroed when a chunk completes.

Cost per step: the KDA core over 64 rows per sequence (O(chunk), against O(1) for the recurrence),
the projections and gates of one row. Cache per sequence: the boundary state ``[H, K, V]`` FP32,
the open chunk's ``[64, 3·H·K]`` conv output (model dtype), ``[64, H, K]`` FP32 decays ``g`` and
``[64, H]`` write strengths ``beta``.
"""

from __future__ import annotations

import torch

from inductor_ext import PrecisionConfig
from inductor_ext.ops.kda_reference import CHUNK

__all__ = ["CHUNK", "replay_prefill", "replay_step"]


def _core(attn, qkv, g, beta, prec, state):
    """``attn.core`` (chunk form) of n packed documents of ``length`` rows each: ``[n, length, ·]`` inputs."""
    n, length = qkv.shape[:2]
    cu = torch.arange(n + 1, dtype=torch.int64, device=qkv.device) * length
    flat = (t.reshape(n * length, *t.shape[2:]) for t in (qkv, g, beta))
    o, final = attn.core(*flat, cu, prec, serving=False, initial_state=state)
    return o.view(n, length, *o.shape[1:]), final


def replay_prefill(attn, x: torch.Tensor, qkv: torch.Tensor, n: int, length: int,
                   prec: PrecisionConfig, initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """The chunk forward of n packed documents of ``length`` tokens (``x [n·length, hidden]``, post-conv
    ``qkv [n·length, 3·H·K]``, optional FP32 ``initial_state [n, H, K, V]``) → (out ``[n·length, hidden]``,
    replay cache ``{"state", "open_qkv", "open_g", "open_beta"}``). The gates and the output stage
    run once over all rows; the KDA core in two calls: the complete chunks (the state at the last
    boundary comes out of it), then the open chunk, padded like a step's."""
    b = CHUNK * (length // CHUNK)  # the last chunk boundary
    g, beta = attn.gates(x, prec)
    inputs = {"open_qkv": qkv.view(n, length, -1), "open_g": g.view(n, length, *g.shape[1:]),
              "open_beta": beta.view(n, length, -1)}
    state, outs = initial_state, []
    if b:
        o, state = _core(attn, *(t[:, :b] for t in inputs.values()), prec, state)
        outs.append(o)
    if state is None:
        state = x.new_zeros(n, attn.num_heads, attn.head_dim, attn.head_dim, dtype=torch.float32)
    cache = {"state": state}
    for name, t in inputs.items():
        cache[name] = t.new_zeros(n, CHUNK, *t.shape[2:])
        cache[name][:, : length - b] = t[:, b:]
    if length > b:
        o = _core(attn, cache["open_qkv"], cache["open_g"], cache["open_beta"], prec, state)[0]
        outs.append(o[:, : length - b])
    o = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return attn.output(x, o.reshape(n * length, *o.shape[2:]), prec), cache


def replay_step(attn, x: torch.Tensor, qkv: torch.Tensor, length: int, cache: dict,
                prec: PrecisionConfig) -> tuple[torch.Tensor, dict]:
    """One new token per sequence (``x [n, hidden]``, post-conv ``qkv [n, 3·H·K]``), each now at
    document position ``length - 1`` → (its chunk-forward output row ``[n, hidden]``, ``cache``
    updated in place and returned). Only the KDA core runs on the whole open chunk: the gates and
    the output stage are per token (batch-invariant: a row alone is bitwise the row inside the
    chunk), so they run on the new rows alone."""
    c = (length - 1) % CHUNK + 1  # rows of the open chunk, the new token included
    g, beta = attn.gates(x, prec)
    for name, t in (("open_qkv", qkv), ("open_g", g), ("open_beta", beta)):
        cache[name][:, c - 1] = t
    o, final = _core(attn, cache["open_qkv"], cache["open_g"], cache["open_beta"], prec, cache["state"])
    if c == CHUNK:  # the chunk is complete: its final state is the next boundary state
        cache["state"] = final
        for name in ("open_qkv", "open_g", "open_beta"):
            cache[name].zero_()
    return attn.output(x, o[:, c - 1].contiguous(), prec), cache
