"""Arithmetic (not measured) per-(chunk, head) MACs and HBM bytes of the FP32 KDA backward stages at
K = V = 128, 64-token chunks, FP32 tiles; times at T = 16384, H = 64 (16384 pairs) for 395 TFLOP/s TF32
(three MMAs per _dot3) and 4.3 TB/s. Prints the table of notes/kda-fp32-kernels.md, session 11."""
C, K, V = 64, 128, 128
f = 4
t = lambda r, c: r * c * f  # bytes of an FP32 [r, c] tile
stages = {
 "K1 kept A (qg, kgT, w, u)": (2 * C * C * K, t(C, K) * 4 + C * f + t(C, C), t(C, K) * 4 + K * f),
 "K2 state pass, split": (2 * C * K * V, t(C, K) * 2 + t(C, V) + K * f, t(K, V) + t(C, V)),
 "K3 state pass backwards": (C * C * V + 3 * C * K * V, t(C, C) + t(K, C) + 2 * t(C, K) + t(C, V) + K * f, t(K, V) + t(C, V)),
 "K4 chunk gradients": (3 * C * C * V + C * K * V + 2 * C * C * K + 2 * C * K * V + 4 * 4 * 4 * 16 * C * (K // 4),
                        2 * t(C, C) + 3 * t(C, V) + t(C, V) + 2 * t(K, V) + t(C, K) + 3 * t(C, K) + t(C, K) + t(C, V) + 2 * t(C, C),
                        t(C, V) + 2 * t(C, C) + t(C, K) + 2 * t(C, K) + t(C, K)),
 "finish (exact blocks, dg, norms)": (0, 3 * t(C, K) + 2 * t(C, K) + t(C, K) + 2 * t(C, K), 3 * t(C, K)),
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
