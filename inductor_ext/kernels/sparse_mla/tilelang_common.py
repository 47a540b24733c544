"""What the TileLang kernels of ``glm53::sparse_mla`` (``tilelang_forward.py``,
``tilelang_backward.py``) share: the geometries they take, their compile call, and the producer's
pieces (:func:`macros`: built per kernel, since a TileLang macro closes over the kernel's symbolic
sizes).

Imports torch only; tilelang is imported when a kernel is compiled.
"""

import types

import torch

__all__ = ["supports", "unsupported", "compile_kernel", "macros", "row_major_inputs", "rows_tensor", "HEADS_PER_CTA",
           "BLOCK", "THREADS"]

HEADS_PER_CTA = 64
BLOCK = 64  # listed ids per gathered block
THREADS = 384  # three warpgroups: two consumers, one producer
_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def unsupported(q: torch.Tensor, kv: torch.Tensor, token_ids: torch.Tensor, d_v: int,
                capability: tuple[int, int]) -> str | None:
    """Why the TileLang kernels do not run the geometry on a device of compute ``capability``, or
    ``None`` when they do: sm_90, BF16 q and kv, ``H`` a multiple of 64, ``D = d_v`` of 256 or 512,
    int32 or int64 ids."""
    H, D = q.shape[1], q.shape[2]
    if tuple(capability) != (9, 0):
        return f"needs an sm_90 device, got compute capability {tuple(capability)}"
    if not q.dtype == kv.dtype == torch.bfloat16:
        return f"needs bfloat16 q and kv, got {q.dtype} and {kv.dtype}"
    if H % HEADS_PER_CTA:
        return f"needs the head count to be a multiple of {HEADS_PER_CTA}, got H={H}"
    if d_v != D or D not in (256, 512):
        return f"needs D = d_v of 256 or 512, got D={D}, d_v={d_v}"
    if token_ids.dtype not in (torch.int32, torch.int64):
        return f"needs int32 or int64 token ids, got {token_ids.dtype}"
    return None


def supports(q: torch.Tensor, kv: torch.Tensor, token_ids: torch.Tensor, d_v: int,
             capability: tuple[int, int]) -> bool:
    """Whether the TileLang kernels run the geometry on a device of compute ``capability``
    (:func:`unsupported` gives the reason when not)."""
    return unsupported(q, kv, token_ids, d_v, capability) is None


def row_major_inputs(*xs: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], bool]:
    """``(tensors, strided)`` for the ``[T, H, D]`` operands that the kernels load by 16-byte
    ``cp.async``: when one of them is not contiguous and every one has unit last stride, its other
    strides multiples of 8 elements below 2^31 and a 16-byte aligned start, all are passed as they
    are (``strided``: the kernel is built with their query and head strides as arguments), so a
    head-major query or gradient is read in place; otherwise contiguous copies (those that need one)."""
    def readable(x):
        *outer, last = x.stride()
        return last == 1 and all(s % 8 == 0 and s < 2**31 for s in outer) and x.data_ptr() % 16 == 0

    if not all(x.is_contiguous() for x in xs) and all(readable(x) for x in xs):
        return xs, True
    return tuple(x.contiguous() for x in xs), False


def rows_tensor(T, n_rows, H: int, D: int, strided: bool, name: str):
    """The kernel parameter type of a ``[T, H, D]`` BF16 operand that the producer copies in by
    16-byte ``cp.async`` (``T``: ``tilelang.language``; ``n_rows``: the kernel's symbolic T):
    contiguous, or with ``strided`` its query and head strides as the symbolic arguments
    ``{name}_t`` / ``{name}_h`` (see :func:`row_major_inputs`)."""
    if strided:
        return T.StridedTensor([n_rows, H, D], [T.dynamic(f"{name}_t"), T.dynamic(f"{name}_h"), 1], "bfloat16")
    return T.Tensor([n_rows, H, D], "bfloat16")


def compile_kernel(main, **kwargs):
    """``tilelang.compile`` of a kernel's ``prim_func`` for sm_90a (``kwargs``: e.g. ``out_idx``)."""
    import tilelang

    # every global index of the kernels is in bounds by construction (ids clamped, positions masked),
    # and TileLang's bounds guard on the gathered rows would turn the cp.async copies into plain loads
    return tilelang.compile(main, target=_TARGET, **kwargs,
                            pass_configs={tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True})


def macros(T, width, n_keys):
    """The producer's macros for a kernel whose id rows are ``width`` long over ``n_keys`` latent
    rows (its symbolic sizes): ``copy16``, ``block_ids``, ``row_span``."""

    @T.macro
    def copy16(dst, src):
        """One 16-byte ``cp.async`` (8 BF16 columns) from global ``src`` to shared ``dst``."""
        T.ptx_cp_async(T.access_ptr(dst, "w", extent=8), T.access_ptr(src, "r", extent=8), 8)

    @T.macro
    def block_ids(row_id, Ids, t, first, p):
        """``row_id[r]`` = the id at position ``first + 16 r + p // 8`` of row ``t`` (a producer
        thread ``p`` of 128 has 4 of a block's 64), or -1 for padding, ids outside ``[0, S)`` and
        positions past the row: independent loads, issued before the producer waits."""
        for r in T.unroll(BLOCK // 16):
            pos = first + r * 16 + p // 8
            row_id[r] = Ids[t, T.min(pos, width - 1)]
            if (pos >= width) | (row_id[r] < 0) | (row_id[r] >= n_keys):
                row_id[r] = -1

    @T.macro
    def row_span(span, lo_hi, Ids, t, tx):
        """``span[0]`` / ``span[1]``: the first valid position of row ``t`` and one past its last
        (``width`` / 0 for a row without one), by all the CTA's threads: blocks outside it are not
        visited."""
        if tx == 0:
            span[0] = width
            span[1] = 0
        T.sync_threads()
        lo_hi[0] = width
        lo_hi[1] = 0
        for w in T.serial(T.ceildiv(width, THREADS)):
            pos = w * THREADS + tx
            if pos < width:
                key = Ids[t, pos]
                if (key >= 0) & (key < n_keys):
                    lo_hi[0] = T.min(lo_hi[0], pos)
                    lo_hi[1] = T.max(lo_hi[1], pos + 1)
        T.atomic_min(span[0], lo_hi[0])
        T.atomic_max(span[1], lo_hi[1])
        T.sync_threads()

    return types.SimpleNamespace(copy16=copy16, block_ids=block_ids, row_span=row_span)
