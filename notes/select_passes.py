"""Counting passes of ``kpool_select``'s threshold search, simulated in numpy (issue 3).

Mirrors the probe sequence of ``inductor_ext/kernels/kpool_select_triton.py``: uint32 keys, the
bracket [min, max], a first probe from the row's mean and deviation, a second one Newton step
of the normal model from its count (NEWTON_OVERSHOOT times over), then count-interpolated keys
with a key bisection after every interpolation that did not halve the bracket's count; a pass ends the search when
exactly nsel scores reach its probe. Prints mean / max passes against plain key bisection for
synthetic score distributions, and for sampled rows of real scores when given the file that
``.devsnap/kpsel9.py`` saves on the H200 (``{"logits", "q_lo", "q_n"}``, torch.save)::

    python notes/select_passes.py [pipe_rows.pt]
"""

from __future__ import annotations

import sys
from statistics import NormalDist

import numpy as np

NSEL, NEWTON_OVERSHOOT = 512, 0.2


def keys(x):
    b = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    return np.where(b < 0, -(b & 0x7FFFFFFF), b) + 2**31


def score(k):
    k = int(k) - 2**31
    return np.array([(-k) | -(2**31) if k < 0 else k], np.int64).astype(np.int32).view(np.float32)[0]


def passes(x, nsel=NSEL, guess=True):
    kx = keys(x)
    lo, hi, c_lo, n_above = int(kx.min()), int(kx.max()), len(x), 0
    mean, dev = float(x.mean()), float(x.std())
    z = NormalDist().inv_cdf(1 - (nsel - 0.5) / len(x))
    g = np.float32(mean + dev * z)
    slope = (1 + NEWTON_OVERSHOOT) * dev / (len(x) * NormalDist().pdf(z))  # scores per count near g
    probe = min(max(int(keys(g)), lo + 1), hi) if guess else lo + ((hi - lo + 1) >> 1)
    step, halved, n = 0, True, 0
    while lo < hi:
        c = int((kx >= probe).sum())
        n += 1
        was, up = c_lo - n_above, c >= nsel
        if up:
            lo, c_lo = probe, c
            hi = probe if c == nsel else hi
        else:
            hi, n_above = probe - 1, c
        if not guess:
            nxt = lo + ((hi - lo + 1) >> 1)
        elif step == 0:
            nxt = int(keys(np.float32(g + (c - nsel + (0.5 if up else -0.5)) * slope)))
        elif halved:
            nxt = lo + int(np.float32(hi - lo) * np.float32((c_lo - nsel) / (c_lo - n_above)))
        else:
            nxt = lo + ((hi - lo + 1) >> 1)
        halved = step == 0 or not halved or 2 * (c_lo - n_above) <= was
        probe = min(max(nxt, lo + 1), hi)
        step += 1
    assert (kx >= lo).sum() == nsel or (kx > lo).sum() < nsel <= (kx >= lo).sum()
    return n


def main():
    rng = np.random.default_rng(0)
    relu_sum = lambda n: (np.maximum(rng.standard_normal((n, 32)), 0) * rng.random(32)).sum(1)  # noqa: E731
    sets = {
        "normal": lambda n: rng.standard_normal(n),
        "ReLU sum": relu_sum,
        "log-normal": lambda n: np.exp(3 * rng.standard_normal(n)),
        "uniform": lambda n: rng.random(n),
        "exponential": lambda n: rng.exponential(size=n),
        "50 integers": lambda n: rng.integers(0, 50, n),
    }
    rows = {name: [make(n).astype(np.float32) for n in (4096, 2048, 1024) for _ in range(15)]
            for name, make in sets.items()}
    if len(sys.argv) > 1:
        import torch

        d = torch.load(sys.argv[1])
        logits, q_lo, q_n = d["logits"].numpy(), d["q_lo"].numpy(), d["q_n"].numpy()
        rows["real rows"] = [logits[r, q_lo[r]:q_lo[r] + q_n[r]] for r in range(len(logits)) if q_n[r] > NSEL]
    print("| scores | rows | bisection passes (mean / max) | probes (mean / max) |\n| --- | --- | --- | --- |")
    for name, xs in rows.items():
        b = np.array([passes(x, guess=False) for x in xs])
        p = np.array([passes(x) for x in xs])
        print(f"| {name} | {len(xs)} | {b.mean():.1f} / {b.max()} | {p.mean():.1f} / {p.max()} |")


if __name__ == "__main__":
    main()
