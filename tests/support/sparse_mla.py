"""Test helpers of ``glm53::sparse_mla``: an independent FP64 reference, id generators, cases.

The FP64 reference is a per-query loop written from the contract (DESIGN §4): it gathers the
listed rows of one query, softmaxes with ``torch.logsumexp`` and never touches the op's code.
Its autograd gives the FP64 VJP.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["Case", "CASES", "fp64_sparse_mla", "fp64_vjp", "random_ids", "make_inputs", "bf16_floor",
           "apply_bf16_rounding_shim", "awkward_ids_inputs", "meta_inputs", "H200", "tilelang_gpu", "graph_replay"]

H200 = (9, 0)  # the compute capability the TileLang kernels are built for


def fp64_sparse_mla(q, kv, token_ids, scale: float, d_v: int):
    """``(out [T, H, d_v], lse [T, H])`` in FP64, one query at a time (differentiable in q, kv)."""
    outs, lses = [], []
    for t in range(q.shape[0]):
        row = token_ids[t].long()
        sel = row[row >= 0]
        if sel.numel() == 0:
            outs.append(q.new_zeros(q.shape[1], d_v))
            lses.append(q.new_full((q.shape[1],), float("-inf")))
            continue
        keys = kv[sel]  # [n, D]
        s = scale * (q[t] @ keys.T)  # [H, n]
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.exp(s - lse[:, None]) @ keys[:, :d_v])
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def fp64_vjp(q, kv, token_ids, scale, d_v, dout, dlse):
    """FP64 ``(out, lse, dq, dkv)`` for the loss ``Σ out·dout + Σ_{finite lse} lse·dlse``."""
    q64 = q.detach().double().requires_grad_(True)
    kv64 = kv.detach().double().requires_grad_(True)
    out, lse = fp64_sparse_mla(q64, kv64, token_ids, scale, d_v)
    finite = torch.isfinite(lse)
    loss = (out * dout.double()).sum() + torch.where(finite, lse, 0.0).mul(dlse.double()).sum()
    dq, dkv = torch.autograd.grad(loss, (q64, kv64))
    return out.detach(), lse.detach(), dq, dkv


def random_ids(doc_lengths, width: int, gen: torch.Generator, *, causal=True, pad_anywhere=False,
               single_id_rows=(), empty_rows=(), dtype=torch.int64) -> torch.Tensor:
    """``[T, width]`` ids: query t picks ``min(width, n)`` distinct keys of its document (the
    document's tokens up to t when ``causal``), random order, then -1; ``pad_anywhere`` shuffles each
    row so -1 lands anywhere; rows in ``single_id_rows`` keep one id, rows in ``empty_rows`` none."""
    T = sum(doc_lengths)
    ids = torch.full((T, width), -1, dtype=torch.int64)
    start = 0
    for n_doc in doc_lengths:
        for t in range(start, start + n_doc):
            hi = t + 1 if causal else start + n_doc
            pool = torch.arange(start, hi)
            pick = pool[torch.randperm(pool.numel(), generator=gen)[:width]]
            ids[t, : pick.numel()] = pick
        start += n_doc
    for t in single_id_rows:
        keep = ids[t, 0].item()
        ids[t] = -1
        ids[t, torch.randint(width, (1,), generator=gen).item()] = keep
    for t in empty_rows:
        ids[t] = -1
    if pad_anywhere:
        ids = torch.stack([r[torch.randperm(width, generator=gen)] for r in ids])
    return ids.to(dtype)


@dataclasses.dataclass
class Case:
    """A geometry: documents (packed when several), heads, dims, id width and row shapes."""

    name: str
    docs: tuple[int, ...]
    heads: int
    dim: int
    d_v: int
    width: int
    pad_anywhere: bool = False
    single_id_rows: tuple[int, ...] = ()
    empty_rows: tuple[int, ...] = ()
    id_dtype: torch.dtype = torch.int64


CASES = [
    Case("W70-H4-D64", (37,), heads=4, dim=64, d_v=64, width=70),
    Case("packed-docs-dv48", (13, 22, 7, 1), heads=2, dim=64, d_v=48, width=16),
    Case("T1", (1,), heads=3, dim=64, d_v=64, width=5),
    Case("H1-D512", (9,), heads=1, dim=512, d_v=512, width=12),
    Case("H128-D512-dv448", (6,), heads=128, dim=512, d_v=448, width=33),
    Case("single-id-and-empty-rows", (20,), heads=4, dim=64, d_v=64, width=9, single_id_rows=(5, 11, 19),
         empty_rows=(7,)),
    Case("pad-anywhere-int32", (30,), heads=5, dim=128, d_v=96, width=24, pad_anywhere=True,
         id_dtype=torch.int32),
]


def make_inputs(case: Case, dtype=torch.bfloat16, seed: int = 0, device="cpu") -> dict:
    """Random q [T,H,D], kv [T,D], ids, scale, d_v, dout, dlse for ``case`` (kv rows = the tokens)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(case.docs)
    q = (torch.randn(T, case.heads, case.dim, generator=gen) * 1.5).to(dtype)
    kv = torch.randn(T, case.dim, generator=gen).to(dtype)
    ids = random_ids(case.docs, case.width, gen, pad_anywhere=case.pad_anywhere,
                     single_id_rows=case.single_id_rows, empty_rows=case.empty_rows, dtype=case.id_dtype)
    dout = torch.randn(T, case.heads, case.d_v, generator=gen).to(dtype)
    dlse = torch.randn(T, case.heads, generator=gen) * 0.5
    out = {"q": q, "kv": kv, "token_ids": ids, "scale": case.dim ** -0.5, "d_v": case.d_v,
           "dout": dout, "dlse": dlse}
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def bf16_floor(ref64: torch.Tensor) -> float:
    """Relative L2 between an FP64 result and its BF16 rounding: what a BF16 output cannot beat."""
    return ((ref64.to(torch.bfloat16).double() - ref64).norm() / ref64.norm()).item()


def apply_bf16_rounding_shim() -> None:
    """Triton 3.6's interpreter truncates FP32 -> BF16 casts (its ``_convert_float`` gets no rounding
    mode); the GPU's ``cvt.rn.bf16.f32`` rounds to nearest even. Route FP32 -> BF16 truncations
    through torch's round-to-nearest-even, as on the GPU (idempotent)."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if getattr(interp, "_glm53_bf16_rtne", False):
        return
    truncate = interp.InterpreterBuilder.create_fp_trunc

    def create_fp_trunc(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interp.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return truncate(self, src, dst_type)

    interp.InterpreterBuilder.create_fp_trunc = create_fp_trunc
    interp._glm53_bf16_rtne = True


def awkward_ids_inputs(T, H, D, S, W, id_dtype, seed=0):
    """``(q, kv, ids)`` in BF16 with 30 % padding anywhere and, for T > 3, an empty row, a row of one
    id, a long leading padded span (odd first visited block pair) and, for W > 128, exactly 128
    leading padding ids."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, D, generator=gen) * 2).bfloat16()
    kv = torch.randn(S, D, generator=gen).bfloat16()
    ids = torch.randint(0, S, (T, W), generator=gen)
    ids[torch.rand(T, W, generator=gen) < 0.3] = -1
    if T > 3:
        ids[1] = -1  # an empty row
        ids[2] = -1
        ids[2, W // 2] = 3  # one id in the middle of a padded row
        ids[3, : W - 5] = -1  # a leading padded span (W 200, 2051: the first visited block pair is odd)
    if T > 4 and W > 128:
        ids[4, :128] = -1  # exactly one leading pair of blocks skipped
    return q, kv, ids.to(id_dtype)


def head_major(x: torch.Tensor) -> torch.Tensor:
    """x's values ``[T, H, d]`` in head-major memory (``[H, T, d]`` underneath), as the absorbed
    layer's per-head GEMMs leave the query and the output gradient."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def meta_inputs(T=4, H=64, D=512, S=8, W=5, dtype=torch.bfloat16, ids=torch.int32):
    """``(q, kv, token_ids)`` on the meta device: shapes and dtypes for the kernels' ``supports``."""
    return (torch.empty(T, H, D, dtype=dtype, device="meta"), torch.empty(S, D, dtype=dtype, device="meta"),
            torch.empty(T, W, dtype=ids, device="meta"))


def _tilelang_gpu_ready() -> bool:
    from inductor_ext import backends

    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == H200
            and backends.available("tilelang"))


def tilelang_gpu(test):
    """Skip ``test`` unless an sm_90 GPU and the ``tilelang`` extra are present."""
    import pytest

    return pytest.mark.skipif(not _tilelang_gpu_ready(), reason="needs an sm_90 GPU and the tilelang extra")(test)


def graph_replay(step):
    """The outputs of ``step()`` captured in a CUDA graph (after one call on a side stream, so that
    kernels compile outside the capture) and replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    return captured
