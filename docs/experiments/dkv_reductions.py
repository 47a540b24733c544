"""Micro-benchmark: the TileLang dkv launch's reductions alone.

One CTA per query row, two consumer warpgroups; per block of 64 listed ids each consumer computes
two [64, 128] dk pieces (ds·q + p·dO by wgmma, as the backward does), rounds them to int32 and adds
them into an [S, 512] int32 accumulator by

- ``pairs``: one 64-bit RED per thread and column pair (the fixed32x2 launch's way);
- ``bulk<C>``: C-column slices staged in shared memory (rows C + 4 ints apart: two wavefronts per
  warp store; two buffers, one for C = 128), one ``cp.reduce.async.bulk .add.s32`` of 4·C bytes
  per valid row;
- ``none``: no reduction (the rest's cost).

Ids: the benchmark's causal random ids (T = 8192, W = 2051). Every mode's sums are compared with
the first's. Run on an H200 with tilelang 0.1.15 importable, from the repository root:
``python docs/experiments/dkv_reductions.py [modes]``; ``--source MODE ...`` writes the generated
CUDA to /tmp instead (no GPU needed).
"""
import functools
import sys
import time
import types

PRELUDE = """
__device__ __forceinline__ void AtomicAddx2(int *ref, const int *val, int memory_order = 0) {
  long long w = (static_cast<long long>(val[1]) << 32) + static_cast<long long>(val[0]);
  atomicAdd(reinterpret_cast<unsigned long long *>(ref), static_cast<unsigned long long>(w));
}
__device__ __forceinline__ void BulkAddS32(int *gmem, const int *smem, int bytes) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.s32 [%0], [%1], %2;"
               :: "l"(gmem), "r"(s), "r"(bytes) : "memory");
}
"""


@functools.cache
def kernel(mode):
    import tilelang
    import tilelang.language as T

    BI, HB, DP, D = 64, 64, 128, 512
    C = int(mode[4:]) if mode.startswith("bulk") else 0
    NB = 1 if C == 128 else 2  # staging buffers per consumer (shared memory)
    n_rows, n_keys, width = T.dynamic("T"), T.dynamic("S"), T.dynamic("W")

    @T.macro
    def consumer(c, g, lt, t, n_blocks):
        for n in T.serial(n_blocks):
            if lt < BI:
                pos = n * BI + lt
                c.ids_sh[g][lt] = T.if_then_else(pos < width, c.Ids[t, T.min(pos, width - 1)], -1)
            T.sync_threads(8 + g, 128)
            for u in (0, 1):
                col0 = (2 * g + u) * DP
                T.wgmma_gemm(c.ds_sh, c.q_s[2 * g + u], c.acc_k[g], clear_accum=True)
                T.wgmma_gemm(c.p_sh, c.do_s[2 * g + u], c.acc_k[g])
                T.wait_wgmma(0)
                for i, j in T.Parallel(BI, DP):
                    c.acc_x[g][i, j] = T.Cast("int32", T.round(c.acc_k[g][i, j] * 3.0))
                if mode == "pairs":
                    for i, j in T.Parallel(BI, DP // 2):
                        row = c.ids_sh[g][i]
                        if row >= 0:
                            T.atomic_addx2(c.Acc[row, col0 + 2 * j], c.acc_x[g][i, 2 * j])
                elif mode == "none":
                    for i, j in T.Parallel(BI, DP // 2):
                        row = c.ids_sh[g][i]
                        if row >= n_keys:
                            T.atomic_addx2(c.Acc[row, col0 + 2 * j], c.acc_x[g][i, 2 * j])
                else:
                    for sl in tuple(range(DP // C)):
                        b = (u * (DP // C) + sl) % NB
                        if lt < BI:
                            T.tma_store_wait(NB - 1)
                        T.sync_threads(8 + g, 128)
                        for i, j in T.Parallel(BI, DP):
                            if j // C == sl:
                                c.stage[g][b][i, j % C] = c.acc_x[g][i, j]
                        T.fence_proxy_async()
                        T.sync_threads(8 + g, 128)
                        if lt < BI:
                            row = c.ids_sh[g][lt]
                            if row >= 0:
                                T.call_extern("handle", "BulkAddS32",
                                              T.access_ptr(c.Acc[row, col0 + sl * C], "rw", C),
                                              T.access_ptr(c.stage[g][b][lt, 0], "r", C), C * 4)
                            T.tma_store_arrive()
            T.sync_threads(8 + g, 128)
        if C:
            if lt < BI:
                T.tma_store_wait(0)

    @T.prim_func
    def main(Ids: T.Tensor([n_rows, width], "int32"), Acc: T.Tensor([n_keys, D], "int32")):
        with T.Kernel(n_rows, threads=256, prelude=PRELUDE) as bx:
            q_s = [T.alloc_shared([HB, DP], "bfloat16") for _ in range(4)]
            do_s = [T.alloc_shared([HB, DP], "bfloat16") for _ in range(4)]
            ds_sh = T.alloc_shared([BI, HB], "bfloat16")
            p_sh = T.alloc_shared([BI, HB], "bfloat16")
            ids_sh = [T.alloc_shared([BI], "int32") for _ in range(2)]
            stage = [[T.alloc_shared([BI, C + 4], "int32") for _ in range(NB)] for _ in range(2 if C else 0)]
            acc_k = [T.alloc_fragment([BI, DP], "float32") for _ in range(2)]
            acc_x = [T.alloc_fragment([BI, DP], "int32") for _ in range(2)]
            t = n_rows - 1 - bx
            tx = T.get_thread_binding()
            for i, j in T.Parallel(BI, HB):
                ds_sh[i, j] = T.Cast("bfloat16", ((i * 7 + j * 3) % 17) * 0.01)
                p_sh[i, j] = T.Cast("bfloat16", ((i * 5 + j) % 13) * 0.01)
            for u in (0, 1, 2, 3):
                for i, j in T.Parallel(HB, DP):
                    q_s[u][i, j] = T.Cast("bfloat16", ((i + j * 11) % 19) * 0.1)
                    do_s[u][i, j] = T.Cast("bfloat16", ((i * 3 + j) % 23) * 0.1)
            T.sync_threads()
            n_blocks = T.ceildiv(T.min(t + 1, width), BI)
            c = types.SimpleNamespace(ids_sh=ids_sh, q_s=q_s, do_s=do_s, ds_sh=ds_sh, p_sh=p_sh, stage=stage,
                                      acc_k=acc_k, acc_x=acc_x, Ids=Ids, Acc=Acc)
            if tx < 128:
                consumer(c, 0, tx, t, n_blocks)
            else:
                consumer(c, 1, tx - 128, t, n_blocks)

    return tilelang.compile(main, target={"kind": "cuda", "arch": "sm_90a"},
                            pass_configs={tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True})


MODES = ("none", "pairs", "bulk32", "bulk64", "bulk128")


def build(mode):
    t0 = time.time()
    try:
        kernel(mode)
        return f"built {mode} {time.time() - t0:.0f}s"
    except Exception as e:  # noqa: BLE001
        return f"FAIL {mode} {type(e).__name__}: {str(e)[-1500:]}"


def main():
    import multiprocessing as mp
    modes = sys.argv[1:] or MODES
    with mp.get_context("spawn").Pool(len(modes)) as pool:
        for line in pool.imap_unordered(build, modes):
            print(line, flush=True)
    import torch

    from inductor_ext.bench.attn import causal_random_ids
    T_ = 8192
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = causal_random_ids(T_, 2051, generator=gen).int().contiguous()
    ref = None
    for mode in modes:
        try:
            k = kernel(mode)
        except Exception:  # noqa: BLE001
            continue
        acc = torch.zeros(T_, 512, dtype=torch.int32, device="cuda")
        k(ids, acc)
        torch.cuda.synchronize()
        if mode != "none":
            ref = acc.clone() if ref is None else ref
            print(mode, "equal to the first:", torch.equal(acc, ref), flush=True)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ts = []
        for _ in range(5):
            e0.record()
            k(ids, acc)
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1))
        print(f"{mode}: ms", [round(x, 3) for x in ts], flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--source"]:
        for mode in sys.argv[2:]:
            open(f"/tmp/redbench_{mode}.cu", "w").write(kernel(mode).get_kernel_source())
            print("source", mode)
    else:
        main()
