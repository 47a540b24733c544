"""Workspace planning for the KPool indexer's MQA scorer, from static shapes only.

The scorer writes FP32 logits ``[rows, pools]`` into the storage layout of DeepGEMM's
``fp8_mqa_logits`` at the commit serving engines pin (``docs/DESIGN.md`` §4):

- query rows are padded to a multiple of ``bq = 128 // heads`` (heads 32, 64, 128 → bq 4, 2, 1);
- ``"compact"`` layout: row stride ``align(pools, 256)`` columns;
- ``"legacy"`` layout (absolute columns plus 256 guard columns): row stride
  ``align(pools + 256, 64)`` columns;
- backing storage ``ceil(rows / bq) * bq * stride * 4`` bytes.

:func:`score_chunk_rows` picks the query-row chunk whose logits storage fits a byte budget, so the
scorer's workspace is bounded before capture (no ``.item()``, no lazy allocation). Example that
must hold: 4096 tokens, 1024 pools, 32 heads, legacy layout, 1 MiB — 256 rows would take
1,310,720 bytes; the planner returns 204 rows = 1,044,480 bytes.

The chunk returned is always a multiple of ``bq`` unless it covers every row: storage is padded
up to ``bq`` rows anyway, so ``M`` rows with ``M % bq != 0`` cost as much as the next multiple,
and a mid-sequence chunk that is not a multiple would waste padding in every chunk.
"""

from __future__ import annotations

import dataclasses

import torch

from inductor_ext.config import MQA_LAYOUTS as LAYOUTS

__all__ = [
    "LAYOUTS",
    "SUPPORTED_HEADS",
    "LogitsPlan",
    "logits_view",
    "mqa_logits_bytes",
    "mqa_logits_stride",
    "mqa_row_block",
    "score_chunk_rows",
]

SUPPORTED_HEADS = (32, 64, 128)
_FP32_BYTES = 4
_MMA_ROWS = 128  # query rows × heads per MMA block of the scorer
_COMPACT_ALIGN = 256
_LEGACY_GUARD = 256
_LEGACY_ALIGN = 64


def _align(n, a):
    # works on ints and SymInts (fake kernels call it with symbolic sizes)
    return (n + a - 1) // a * a


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise ValueError(f"workspace: {name} must be an int, got {type(value).__name__}")
    if isinstance(value, int) and value < minimum:
        raise ValueError(f"workspace: {name} must be >= {minimum}, got {value}")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"workspace: layout must be one of {LAYOUTS}, got {layout!r}")


def mqa_row_block(heads: int) -> int:
    """Query-row padding block ``bq = 128 // heads``; heads must be one of 32, 64, 128."""
    if heads not in SUPPORTED_HEADS:
        raise ValueError(f"workspace: heads must be one of {SUPPORTED_HEADS} (bq = 128 / heads), got {heads!r}")
    return _MMA_ROWS // heads


def mqa_logits_stride(pools, layout: str):
    """Row stride, in FP32 columns, of the logits storage for ``pools`` key columns.

    ``"compact"``: ``align(pools, 256)``; ``"legacy"``: ``align(pools + 256, 64)``.
    """
    _check_layout(layout)
    _check_int("pools", pools, 0)
    if layout == "compact":
        return _align(pools, _COMPACT_ALIGN)
    return _align(pools + _LEGACY_GUARD, _LEGACY_ALIGN)


def _padded_rows(rows, bq):
    return (rows + bq - 1) // bq * bq


def mqa_logits_bytes(rows: int, pools: int, heads: int, layout: str) -> int:
    """Bytes of the FP32 logits storage the MQA scorer needs for ``rows`` query rows.

    Args:
        rows: query rows M (>= 0).
        pools: key columns N (pools scored, >= 0).
        heads: indexer heads H, one of 32, 64, 128.
        layout: ``"compact"`` or ``"legacy"``.

    Returns:
        ``ceil(M / bq) * bq * stride * 4`` with ``bq = 128 / H`` and the layout's row stride.
    """
    _check_int("rows", rows, 0)
    bq = mqa_row_block(heads)
    return _padded_rows(rows, bq) * mqa_logits_stride(pools, layout) * _FP32_BYTES


def score_chunk_rows(rows: int, pools: int, heads: int, layout: str, budget_bytes: int) -> int:
    """Largest query-row chunk whose logits storage fits ``budget_bytes``.

    Returns ``min(rows, floor(budget / (4 * stride * bq)) * bq)``: a multiple of ``bq`` unless the
    chunk covers all ``rows`` (then the one chunk is padded to ``bq`` inside the same bound).
    ``rows == 0`` returns 0. Raises ``ValueError`` when not even one block of ``bq`` rows fits.
    """
    _check_int("rows", rows, 0)
    _check_int("budget_bytes", budget_bytes, 1)
    bq = mqa_row_block(heads)
    row_bytes = mqa_logits_stride(pools, layout) * _FP32_BYTES
    if row_bytes == 0:  # no key columns: nothing is stored, one chunk covers every row
        return rows
    fit = budget_bytes // (row_bytes * bq) * bq
    if fit == 0:
        raise ValueError(
            f"workspace: budget_bytes={budget_bytes} is below one block of bq={bq} rows "
            f"({bq * row_bytes} bytes for {pools} pools, {layout} layout)"
        )
    return min(rows, fit)


@dataclasses.dataclass(frozen=True)
class LogitsPlan:
    """The scorer's logits workspace for one call, planned from static shapes.

    Attributes:
        rows: query rows T of the whole call.
        pools: key columns N (pool slots).
        heads: indexer heads H (32, 64, 128).
        layout: ``"compact"`` or ``"legacy"``.
        budget_bytes: bound on one chunk's logits storage.

    Derived: ``bq``, ``stride`` (FP32 columns per stored row), ``chunk_rows`` (rows per chunk,
    :func:`score_chunk_rows`), ``chunks`` (``(start, stop)`` row ranges), ``chunk_bytes``.
    """

    rows: int
    pools: int
    heads: int
    layout: str
    budget_bytes: int

    def __post_init__(self) -> None:
        score_chunk_rows(self.rows, self.pools, self.heads, self.layout, self.budget_bytes)

    @property
    def bq(self) -> int:
        """Row block: rows are padded to a multiple of 128 / heads."""
        return mqa_row_block(self.heads)

    @property
    def stride(self) -> int:
        """Logits row stride in FP32 elements for this layout."""
        return mqa_logits_stride(self.pools, self.layout)

    @property
    def chunk_rows(self) -> int:
        """Query rows scored per chunk so one chunk fits the budget."""
        return score_chunk_rows(self.rows, self.pools, self.heads, self.layout, self.budget_bytes)

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` row ranges covering all rows, ``chunk_rows`` at a time."""
        step = self.chunk_rows
        if step == 0:
            return ()
        return tuple((s, min(s + step, self.rows)) for s in range(0, self.rows, step))

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one full chunk's logits storage."""
        return mqa_logits_bytes(self.chunk_rows, self.pools, self.heads, self.layout)

    def allocate(self, rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """FP32 logits view ``[rows, pools]`` with row stride :attr:`stride`, backed by one padded
        storage of ``mqa_logits_bytes(rows, ...)`` bytes (contents uninitialised)."""
        return logits_view(rows, self.pools, self.heads, self.layout, device)


def logits_view(rows, pools, heads: int, layout: str, device) -> torch.Tensor:
    """One padded FP32 storage ``[ceil(rows/bq)*bq, stride]`` and its ``[rows, pools]`` view.

    SymInt-friendly (the fake kernel of ``glm53::kpool_logits`` calls it with symbolic sizes).
    """
    bq = mqa_row_block(heads)
    stride = mqa_logits_stride(pools, layout)
    storage = torch.empty(_padded_rows(rows, bq), stride, dtype=torch.float32, device=device)
    return storage[:rows, :pools]
