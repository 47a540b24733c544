"""Context-parallel metadata of one packed batch: :func:`cp_context` → :class:`CPContext`
(``docs/DESIGN.md`` §8).

The global batch is T packed tokens (batch 1) with int64 document offsets ``cu_seqlens [N+1]``,
split over the W ranks of a process group. The token axis is cut into equal *shards* of L tokens:

- ``"contiguous"``: W shards, L = T / W; rank r holds shard r.
- ``"zigzag"``: 2W shards, L = T / (2W); rank r holds shards r and 2W−1−r (in that order), which
  balances causal work.

A document that crosses a shard boundary is split into *segments*: a local segment is the part of
one document inside one local shard. Segments are numbered in local token order; the local
``cu_seqlens`` of the segments is padded with empty segments at its end to M = the largest segment
count of any rank, so every rank has the same shapes (and compiles the same graph).

Everything is computed once on the host, outside the compiled region, from the GLOBAL
``cu_seqlens`` (equal on every rank, checked by one small all-gather when the context is built).
Inside a compiled region the context is read-only: tensors and static ints/strings only, and the
process group travels by name (``group_name``) so the collectives trace.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch
import torch.distributed as dist

from inductor_ext.parallel.collectives import all_gather_tokens, gather_shards

__all__ = ["CPContext", "cp_context", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True, eq=False)
class CPContext:
    """Context-parallel view of one packed batch on one rank; build it with :func:`cp_context`.

    Static attributes (Python ints/strings, constants of a compiled graph): ``group_name``,
    ``world``, ``rank``, ``layout``, ``num_tokens`` (global T), ``num_docs`` (global N),
    ``shard_len`` (L), ``shards`` (global indices of the local shards, local order),
    ``num_segments`` (M, padded segment count, equal on every rank).

    Tensors (int64 unless stated, on the device of the context):

    - ``cu_seqlens [N+1]``: the global document offsets.
    - ``positions [T_local]``: global index of every local token (T_local = len(shards)·L).
    - ``doc_ids [T_local]``: global document of every local token.
    - ``doc_positions [T_local]``: position of every local token inside its document.
    - ``local_cu_seqlens [M+1]``: offsets of the local segments (0 … T_local, padded at the end
      with empty segments).
    - ``seg_continues [M]`` bool: the segment continues a document from the previous global shard
      (only the first segment of a local shard can).
    - ``seg_doc [M]``: global document of each segment (−1 for padding).
    - ``seg_doc_end [M]`` bool: the document ends inside this segment (this rank owns its final state).
    - ``shard_first_seg``, ``shard_last_seg`` ``[n_local]``: local segment index of the first and
      last segment of each local shard.
    - ``shard_global [n_local]``: global shard index of each local shard; ``shard_start
      [n_local]``: its first global token; ``shard_doc_start [n_local]``: the start of the
      document holding that first token.
    - ``shard_continues [S]`` bool, S = number of global shards: global shard j's first segment
      continues a document from shard j−1. ``shard_carries [S]`` bool: shard j's LAST segment
      started before shard j (the document spans the whole shard), so the state entering shard j
      flows through it.
    - ``shard_order [S]``: row of global shard j in a rank-major all-gather of per-shard rows.
    - ``doc_state_slot [N]``: row of document d's final state in a rank-major all-gather of the
      per-segment final states ``[W·M]`` (``W·M`` for an empty document: a zero row appended).
    """

    group_name: str
    world: int
    rank: int
    layout: str
    num_tokens: int
    num_docs: int
    shard_len: int
    shards: tuple[int, ...]
    num_segments: int
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor
    doc_positions: torch.Tensor
    local_cu_seqlens: torch.Tensor
    seg_continues: torch.Tensor
    seg_doc: torch.Tensor
    seg_doc_end: torch.Tensor
    shard_first_seg: torch.Tensor
    shard_last_seg: torch.Tensor
    shard_global: torch.Tensor
    shard_start: torch.Tensor
    shard_doc_start: torch.Tensor
    shard_continues: torch.Tensor
    shard_carries: torch.Tensor
    shard_order: torch.Tensor
    doc_state_slot: torch.Tensor

    @property
    def local_tokens(self) -> int:
        """Tokens on this rank: ``len(shards) · shard_len``."""
        return len(self.shards) * self.shard_len

    @property
    def num_shards(self) -> int:
        """Global shard count: W (contiguous) or 2W (zigzag)."""
        return self.world * len(self.shards)

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The local tokens of a global tensor: ``x`` with ``dim`` of length T → length T_local
        (static narrows; zigzag concatenates the two local shards). No communication."""
        if x.shape[dim] != self.num_tokens:
            raise ValueError(f"CPContext.shard: dim {dim} must hold the global T={self.num_tokens} tokens, "
                             f"got shape {tuple(x.shape)}")
        parts = [x.narrow(dim, j * self.shard_len, self.shard_len) for j in self.shards]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def unshard(self, x_local: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """All-gather the local tokens of every rank back into global token order (``dim``:
        T_local → T). One all-gather (:func:`~inductor_ext.parallel.collectives.all_gather_tokens`);
        differentiable, its backward a sum reduce-scatter."""
        if x_local.shape[dim] != self.local_tokens:
            raise ValueError(f"CPContext.unshard: dim {dim} must hold the T_local={self.local_tokens} local "
                             f"tokens, got shape {tuple(x_local.shape)}")
        return all_gather_tokens(x_local, self.group_name, self.world, len(self.shards), dim)

    def gather_shards(self, x: torch.Tensor) -> torch.Tensor:
        """Per-local-shard rows ``x [n_local, ...]`` of every rank in global shard order
        ``[S, ...]`` (one all-gather; differentiable)."""
        order = None if self.layout == "contiguous" else self.shard_order
        return gather_shards(x, self.group_name, self.world, order)


def _shard_segments(cu: list[int], start: int, end: int):
    """Segments of the global token range [start, end): (seg_start, seg_end, doc, continues)."""
    first = bisect.bisect_right(cu, start) - 1
    last = bisect.bisect_right(cu, end - 1) - 1
    out = []
    for d in range(first, last + 1):
        s, e = max(cu[d], start), min(cu[d + 1], end)
        if e > s:
            out.append((s, e, d, cu[d] < s))
    return out


def _local_error(cu_seqlens, layout: str, world: int, align: int, segments) -> str | None:
    """The ValueError message this rank's arguments deserve, or None (no collective here)."""
    if segments is not None and (isinstance(segments, bool) or not isinstance(segments, int) or segments < 1):
        return f"cp_context: segments must be a positive int or None, got {segments!r}"
    if layout not in LAYOUTS:
        return f"cp_context: layout must be one of {LAYOUTS}, got {layout!r}"
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        return f"cp_context: align must be a positive int, got {align!r}"
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int64 or cu_seqlens.dim() != 1 \
            or cu_seqlens.shape[0] < 2:
        return "cp_context: cu_seqlens must be a 1-D int64 tensor of N+1 >= 2 document offsets"
    cu = cu_seqlens.tolist()
    T = cu[-1]
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or T < 1:
        return f"cp_context: cu_seqlens must be non-decreasing from 0 to T >= 1, got {cu}"
    shards = world * (1 if layout == "contiguous" else 2)
    if T % (shards * align):
        return (f"cp_context: layout {layout!r} over {world} ranks cuts T={T} into {shards} equal shards whose "
                f"length must be a multiple of {align} tokens (the KPool pool size), so T must be divisible "
                f"by {shards}·{align} = {shards * align}")
    return None


def cp_context(cu_seqlens: torch.Tensor, group=None, layout: str = "contiguous", *, align: int = 4,
               segments: int | None = None, device=None) -> CPContext:
    """Build the context-parallel metadata of one packed batch on this rank (a collective: every
    rank of ``group`` must call it with the same arguments).

    Args:
        cu_seqlens: the GLOBAL int64 document offsets ``[N+1]`` (0 … T, non-decreasing; empty
            documents allowed), equal on every rank.
        group: the ``torch.distributed`` process group (default: the WORLD group).
        layout: ``"contiguous"`` or ``"zigzag"`` (module docstring).
        align: shard length granularity (default 4 = the KPool pool size).
        segments: pad the local segment count M to this value (default: the largest count of any
            rank). A fixed value keeps every tensor shape of the context, hence of a compiled
            graph, constant across batches with the same T and N: no recompilation.
        device: device of the metadata tensors (default: ``cu_seqlens``'s).

    Shard rule: T is cut into S equal shards (S = W contiguous, 2W zigzag) of L = T / S tokens and
    L must be a multiple of ``align``: T % (W·4) == 0 (contiguous) or T % (2W·4) == 0 (zigzag).
    Every shard boundary then lies on the global 4-token grid, which is a pool boundary of every
    document that starts on that grid; a pool of a document starting off the grid may still
    straddle a shard boundary, which is correct because the CP indexer gathers keys and gates into
    global order before pooling. L >= 4 also covers the short convolution's 3-token halo.

    Checks (``ValueError`` naming the rule): torch.distributed initialized; layout known;
    cu_seqlens a valid int64 offset vector; the shard rule; ``cu_seqlens``, layout and align equal
    on every rank (and ``segments``). One ``all_gather_object`` carries every rank's arguments and local verdict, so
    all ranks raise together (none is left waiting in a collective).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("cp_context: torch.distributed is not initialized (call init_process_group first)")
    group = dist.group.WORLD if group is None else group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    error = _local_error(cu_seqlens, layout, world, align, segments)
    mine = (error, layout, align, segments, None if error else cu_seqlens.tolist())
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if error is not None:
        raise ValueError(error)
    for r, (err, *_rest) in enumerate(everyone):
        if err is not None:
            raise ValueError(f"{err} (on rank {r})")
    if any(tuple(other[1:]) != tuple(mine[1:]) for other in everyone):
        raise ValueError("cp_context: cu_seqlens, layout, align and segments must be equal on every rank; got "
                         + "; ".join(f"rank {r}: {o[1]}, align {o[2]}, segments {o[3]}, cu_seqlens {o[4]}"
                                     for r, o in enumerate(everyone)))
    device = cu_seqlens.device if device is None else torch.device(device)
    return _build(cu_seqlens.tolist(), group.group_name, world, rank, layout, device, segments)


def _build(cu: list[int], group_name: str, world: int, rank: int, layout: str, device,
           segments: int | None = None) -> CPContext:
    T, N = cu[-1], len(cu) - 1
    per_rank = 1 if layout == "contiguous" else 2
    S = world * per_rank
    L = T // S

    def shards_of(r: int) -> tuple[int, ...]:
        return (r,) if layout == "contiguous" else (r, 2 * world - 1 - r)

    segs = {j: _shard_segments(cu, j * L, (j + 1) * L) for j in range(S)}
    # per-rank segment lists (local order) and the padded count M
    rank_segs = [[seg for j in shards_of(r) for seg in segs[j]] for r in range(world)]
    M = max(len(s) for s in rank_segs)
    if segments is not None:
        if M > segments:
            raise ValueError(f"cp_context: this batch needs {M} local segments on some rank, more than "
                             f"segments={segments}")
        M = segments
    # where each document's final state lives: (rank, local segment) of its last segment
    slot = [world * M] * N
    for r in range(world):
        for m, (_s, e, d, _c) in enumerate(rank_segs[r]):
            if e == cu[d + 1]:
                slot[d] = r * M + m
    order = [0] * S
    for r in range(world):
        for i, j in enumerate(shards_of(r)):
            order[j] = r * per_rank + i

    mine = shards_of(rank)
    local_cu, cont, seg_doc, doc_end, first_seg, last_seg = [0], [], [], [], [], []
    for j in mine:
        first_seg.append(len(cont))
        for s, e, d, c in segs[j]:
            local_cu.append(local_cu[-1] + e - s)
            cont.append(c)
            seg_doc.append(d)
            doc_end.append(e == cu[d + 1])
        last_seg.append(len(cont) - 1)
    pad = M - len(cont)
    local_cu += [local_cu[-1]] * pad
    cont += [False] * pad
    seg_doc += [-1] * pad
    doc_end += [False] * pad
    positions = [t for j in mine for t in range(j * L, (j + 1) * L)]
    doc_ids = [bisect.bisect_right(cu, t) - 1 for t in positions]

    def i64(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    def flag(values):
        return torch.tensor(values, dtype=torch.bool, device=device)

    return CPContext(
        group_name=group_name, world=world, rank=rank, layout=layout, num_tokens=T, num_docs=N,
        shard_len=L, shards=mine, num_segments=M,
        cu_seqlens=i64(cu),
        positions=i64(positions),
        doc_ids=i64(doc_ids),
        doc_positions=i64([t - cu[d] for t, d in zip(positions, doc_ids)]),
        local_cu_seqlens=i64(local_cu),
        seg_continues=flag(cont),
        seg_doc=i64(seg_doc),
        seg_doc_end=flag(doc_end),
        shard_first_seg=i64(first_seg),
        shard_last_seg=i64(last_seg),
        shard_global=i64(list(mine)),
        shard_start=i64([j * L for j in mine]),
        shard_doc_start=i64([cu[bisect.bisect_right(cu, j * L) - 1] for j in mine]),
        shard_continues=flag([segs[j][0][3] for j in range(S)]),
        shard_carries=flag([segs[j][-1][3] for j in range(S)]),
        shard_order=i64(order),
        doc_state_slot=i64(slot),
    )
