"""Arithmetic (not measured) per-(chunk, head) MACs and HBM bytes of the FP32 KDA backward stages at
K = V = 128, 64-token chunks, FP32 tiles; times at T = 16384, H = 64 (16384 pairs) for 395 TFLOP/s TF32
(three MMAs per _dot3) and 4.3 TB/s. Re-reads of the same tile by several programs (K4b's four K-slices
read do, v_new and dP each) are counted as HBM bytes: L2 hits are not separated. Prints the table of
notes/kda-fp32-kernels.md, session 13 (session 12: a two-pass finish kernel, which re-read q, k, d q̂ and
d k̂; session 11: one chunk-gradient kernel, 16-column blocks)."""
C, K, V = 64, 128, 128
f = 4
t = lambda r, c: r * c * f  # bytes of an FP32 [r, c] tile
S = 4  # K-slices of 32 keys
stages = {
 "K1 kept A (qg, kgT, w, u)": (2 * C * C * K, t(C, K) * 4 + C * f + t(C, C), t(C, K) * 4 + K * f + 2 * C * f),
 "K2 state pass, split": (2 * C * K * V, t(C, K) * 2 + t(C, V) + K * f, t(K, V) + t(C, V)),
 "K3 state pass backwards": (C * C * V + 3 * C * K * V, t(C, C) + t(K, C) + 2 * t(C, K) + t(C, V) + K * f, t(K, V) + t(C, V)),
 "K4a WY backward (dv, dP, dbw)": (3 * C * C * V + C * K * V + 2 * C * C * K,
                                   2 * t(C, C) + 2 * t(C, V) + 3 * t(C, V) + t(K, V) + t(C, K) + C * f,
                                   t(C, V) + 2 * t(C, C) + t(C, K) + C * f),
 "K4b per K-slice (dq, dk, dgc)": (2 * C * K * V + 4 * C * C * K,
                                   3 * t(C, K) + 2 * C * f + 2 * t(K, V) + S * (2 * t(C, V) + 2 * t(C, C)) + t(C, K),
                                   3 * t(C, K) + S * 3 * C * f),  # dq̂, dk̂, dgc; per slice dβ's share, q̂·dq̂, k̂·dk̂
 "finish, one pass (dg, norms, dbeta)": (0, 2 * t(C, K) + 2 * C * f + 2 * t(C, K) + t(C, K) + (1 + 3 * S) * C * f,
                                         3 * t(C, K) + C * f),
}
pairs = 16384  # (chunk, head) pairs at T = 16384, H = 64
tot_m = tot_b = 0
for name, (mac, rd, wr) in stages.items():
    b = rd + wr
    tot_m += mac; tot_b += b
    tc = mac * 2 * 3 * pairs / 395e12 * 1e3  # tf32x3 = three TF32 MMAs
    hb = b * pairs / 4.3e12 * 1e3
    print(f"| {name} | {mac/1e6:.2f} M | {rd/1024:.0f} / {wr/1024:.0f} KB | {tc:.2f} ms | {hb:.2f} ms |")
print(f"| total | {tot_m/1e6:.2f} M | {tot_b/1024:.0f} KB | {tot_m*6*pairs/395e12*1e3:.2f} ms | {tot_b*pairs/4.3e12*1e3:.2f} ms |")
