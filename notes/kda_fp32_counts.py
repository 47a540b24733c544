"""Arithmetic (not measured) per-(chunk, head) MACs and HBM bytes of the FP32 KDA kernels' stages at
K = V = 128, 64-token chunks, FP32 intermediates; inputs q, k, v, beta, do and the gradients dq, dk, dv,
dbeta in FP32 or BF16 (g and dg stay FP32); times at T = 16384, H = 64 (16384 pairs) for 395 TFLOP/s TF32
(three MMAs per _dot3) and 4.3 TB/s. Re-reads of the same tile by several programs (the state pass's
two V-block programs, K4b's four K-slices) are counted as HBM bytes: L2 hits are not separated. Prints
the tables of notes/kda-fp32-kernels.md, session 18 (session 17: the forward ran the solve kernel and its
state pass read u; session 15-16: g read a second time by the chunk kernel's Σ|g| bound; session 14: the
solve inside the chunk kernel;
session 13: FP32 inputs only; session 12: a two-pass finish kernel; session 11: one chunk-gradient kernel)."""
C, K, V = 64, 128, 128
S = 4  # K-slices of 32 keys
V_BLOCKS = 2  # forward state-pass programs per head (block_v 64)


def tile(r, c):
    return r * c  # elements of an [r, c] tile


# stage: (MACs, FP32 elements read, input elements read, FP32 elements written, input-dtype elements written)
# the solve kernel (the backward's): A⁻¹ read by each of its four 64-column programs (L2 hits not separated),
# the right-hand side βk̂e^{gc} read and overwritten by w, v and beta read (beta by the two u programs), u written
SOLVE = (C * C * (K + V), tile(C, K) + 4 * tile(C, C), tile(C, V) + 2 * C, tile(C, K) + tile(C, V), 0)
FORWARD = {
    # both launches, keeping A: norms and slices (q, k, g, beta); qg, kgᵀ,
    # the right-hand side βk̂e^{gc}, Aqk, A⁻¹ and the k̂–k̂ products, e^{gc_last}, the norms; decay
    # products 2·C·C·K MACs (the inverse's elimination, about 0.2 M more, is not counted)
    "K1 chunk kernel, keeping A": (2 * C * C * K, tile(C, K), 2 * tile(C, K) + C,
                                   3 * tile(C, K) + 3 * tile(C, C) + K + 2 * C, 0),
    # per V-block program R = βk̂e^{gc}, qg, kgᵀ, A⁻¹, Aqk, e^{gc_last}; v (its columns) and beta; o written.
    # Products R·h, qg·h, kgᵀ·v_new (C·K·V each) and A⁻¹·(βv − R·h), Aqk·v_new (C·C·V each)
    "K2 state pass with o, solving v_new (two V-block programs)": (
        3 * C * K * V + 2 * C * C * V, V_BLOCKS * (3 * tile(C, K) + 2 * tile(C, C) + K),
        tile(C, V) + V_BLOCKS * C, 0, tile(C, V)),
}
BACKWARD = {
    "K1 kept A (qg, kgT, w's right-hand side)": (0, tile(C, K), 2 * tile(C, K) + C, 3 * tile(C, K) + K + 2 * C, 0),
    "K1b solve kernel (w, u)": SOLVE,
    "K2 state pass, split": (2 * C * K * V, tile(C, K) * 2 + tile(C, V) + K, 0, tile(K, V) + tile(C, V), 0),
    "K3 state pass backwards": (C * C * V + 3 * C * K * V, tile(C, C) + tile(K, C) + 2 * tile(C, K) + K,
                                tile(C, V), tile(K, V) + tile(C, V), 0),
    "K4a WY backward (dv, dP, dbw)": (3 * C * C * V + C * K * V + 2 * C * C * K,
                                      2 * tile(C, C) + 3 * tile(C, V) + tile(K, V) + tile(C, K), 2 * tile(C, V) + C,
                                      2 * tile(C, C) + tile(C, K) + C, tile(C, V)),
    "K4b per K-slice (dq, dk, dgc)": (2 * C * K * V + 4 * C * C * K,
                                      tile(C, K) + 2 * C + 2 * tile(K, V) + S * (tile(C, V) + 2 * tile(C, C)) + tile(C, K),
                                      2 * tile(C, K) + S * tile(C, V),
                                      3 * tile(C, K) + S * 3 * C, 0),  # dq̂, dk̂, dgc; per slice dβ's share, q̂·dq̂, k̂·dk̂
    "finish, one pass (dg, norms, dbeta)": (0, 2 * C + 2 * tile(C, K) + tile(C, K) + (1 + 3 * S) * C, 2 * tile(C, K),
                                            tile(C, K), 2 * tile(C, K) + C),
}
PAIRS = 16384  # (chunk, head) pairs at T = 16384, H = 64


def table(title, stages):
    print(f"\n{title}\n\n| stage | MACs | bytes, FP32 inputs | bytes, BF16 inputs | tensor cores | HBM, FP32 / BF16 inputs |")
    print("| --- | --- | --- | --- | --- | --- |")
    tot = [0, 0, 0]
    for name, (mac, rd32, rd_in, wr32, wr_in) in stages.items():
        b32 = 4 * (rd32 + rd_in + wr32 + wr_in)
        b16 = 4 * (rd32 + wr32) + 2 * (rd_in + wr_in)
        tot = [tot[0] + mac, tot[1] + b32, tot[2] + b16]
        print(f"| {name} | {mac / 1e6:.2f} M | {b32 / 1024:.0f} KB | {b16 / 1024:.0f} KB | "
              f"{mac * 6 * PAIRS / 395e12 * 1e3:.2f} ms | {b32 * PAIRS / 4.3e12 * 1e3:.2f} / {b16 * PAIRS / 4.3e12 * 1e3:.2f} ms |")
    print(f"| total | {tot[0] / 1e6:.2f} M | {tot[1] / 1024:.0f} KB | {tot[2] / 1024:.0f} KB | "
          f"{tot[0] * 6 * PAIRS / 395e12 * 1e3:.2f} ms | {tot[1] * PAIRS / 4.3e12 * 1e3:.2f} / {tot[2] * PAIRS / 4.3e12 * 1e3:.2f} ms |")


table("Forward (keeping A)", FORWARD)
table("Backward (reading A)", BACKWARD)
