"""The TileLang fixed32x2 dkv launch without its reductions, per launch (torch.profiler).

Writes two experiment copies of ``inductor_ext/kernels/sparse_mla/tilelang_backward.py`` next to
this file (``tlb_no_red.py``: the reductions behind a guard that never holds, ``row >= S``;
``tlb_no_conv.py``: also without the fixed-point scaling), then times the bound / fixed32x2 /
float32 launches of the three at T = 8192 and 32768 (h200 geometry, causal random ids).
Run from the repository root on an H200 with tilelang 0.1.15 importable:
``python docs/experiments/dkv_launch_parts.py``. Results: ``docs/sparse-mla.md``.
"""
import importlib
import multiprocessing as mp
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
SPECS = [("inductor_ext.kernels.sparse_mla.tilelang_backward", m) for m in ("bound", "fixed32x2", "float32")]
SPECS += [("tlb_no_red", "fixed32x2"), ("tlb_no_red", "float32"), ("tlb_no_conv", "fixed32x2")]


def write_variants():
    src = pathlib.Path("inductor_ext/kernels/sparse_mla/tilelang_backward.py").read_text()
    src = src.replace("from .tilelang_common import", "from inductor_ext.kernels.sparse_mla.tilelang_common import")
    head, sep, tail = src.partition("    @T.macro\n    def dq_and_dk")
    no_red = head.replace("if row >= 0:", "if row >= n_keys:", 2) + sep + tail  # add_piece's two guards
    no_conv = no_red.replace('T.Cast("int32", fixed(acc_k[i, j], c, T.max(c.ids_sh[par * BI + i], 0)))',
                             'T.Cast("int32", acc_k[i, j])')
    assert no_red.count("if row >= n_keys:") == 2 and no_conv != no_red
    (HERE / "tlb_no_red.py").write_text(no_red)
    (HERE / "tlb_no_conv.py").write_text(no_conv)


def build(spec):
    t0 = time.time()
    if spec == "fwd":
        from inductor_ext.kernels.sparse_mla.tilelang_forward import _kernel
        _kernel(64, 512, 512 ** -0.5, "int32", False)
    else:
        importlib.import_module(spec[0])._kernel(64, 512, 512 ** -0.5, "int32", spec[1], False)
    return f"built {spec} {time.time() - t0:.0f}s"


def main():
    write_variants()
    extra = [("tlb_no_red", "bound"), ("tlb_no_conv", "bound")]
    with mp.get_context("spawn").Pool(9) as pool:
        for line in pool.imap_unordered(build, ["fwd"] + SPECS + extra):
            print(line, flush=True)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from inductor_ext.bench.attn import causal_random_ids
    from inductor_ext.kernels.sparse_mla import tilelang_forward as tlf
    mods = {n: importlib.import_module(n) for n, _ in SPECS}
    for T in (8192, 32768):
        H, D, s = 64, 512, 512 ** -0.5
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(T, H, D, device="cuda", generator=gen).bfloat16()
        kv = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
        ids = causal_random_ids(T, 2051, generator=gen)
        out, lse = tlf.sparse_mla_fwd_tilelang(q, kv, ids, s, D)
        dout, dlse = torch.randn(out.shape, device="cuda", generator=gen).bfloat16(), torch.zeros_like(lse)
        for rnd in range(2):
            for name, mode in SPECS[1:]:
                kw = {"deterministic": False} if mode == "float32" else {}
                f = mods[name].sparse_mla_bwd_tilelang
                f(q, kv, ids, out, lse, dout, dlse, s, **kw)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        f(q, kv, ids, out, lse, dout, dlse, s, **kw)
                    torch.cuda.synchronize()
                times = [e.device_time_total / 1e3 for e in prof.events() if e.name == "main_kernel"]
                print(f"T={T} round {rnd} {name.split('.')[-1]} {mode}: launches ms", [round(t, 3) for t in times],
                      flush=True)
        del q, kv, ids, out, lse, dout
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
