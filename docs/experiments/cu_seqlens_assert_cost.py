"""What the compiled ``cu_seqlens`` assertion (``inductor_ext.ops._checks.check_cu_seqlens``, traced as
``torch._assert_async``) costs on the CPU: a compiled ``kda_chunk`` (fullgraph, precision fp32, two
documents) with the wrapper against the same call without the assertion (the wrapper's static checks,
then the op), and the assertion alone (a graph of ``x + 1`` with and without it). Rounds alternate
the order; medians of the rounds, microseconds or milliseconds per call, one thread.

    python docs/experiments/cu_seqlens_assert_cost.py --backend inductor --tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from inductor_ext import ops
from inductor_ext.ops._checks import check_cu_seqlens
from inductor_ext.ops.kda_reference import validate_kda_inputs


def _median_per_call(fns: dict, args: tuple, rounds: int, calls: int) -> dict[str, float]:
    for f in fns.values():
        for _ in range(3):
            f(*args)
    times = {n: [] for n in fns}
    for r in range(rounds):
        for name, f in (list(fns.items()) if r % 2 == 0 else list(reversed(fns.items()))):
            t0 = time.perf_counter()
            for _ in range(calls):
                f(*args)
            times[name].append((time.perf_counter() - t0) / calls)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    T, H, K = args.tokens, 2, 16
    q, k, v = torch.randn(1, T, H, K), torch.randn(1, T, H, K), torch.randn(1, T, H, K)
    g, beta, cu = -torch.rand(1, T, H, K), torch.rand(1, T, H), torch.tensor([0, T // 3, T])

    def with_assert(q, k, v, g, beta, cu):
        return ops.kda_chunk(q, k, v, g, beta, cu_seqlens=cu, precision="fp32")

    def without_assert(q, k, v, g, beta, cu):
        validate_kda_inputs(q, k, v, g, beta, None, cu, "fp32")
        out = torch.ops.glm53.kda_chunk(q, k, v, g, beta, K ** -0.5, None, cu, "fp32", False)
        return out[0], out[1]

    compiled = {n: torch.compile(f, fullgraph=True, backend=args.backend)
                for n, f in (("with", with_assert), ("without", without_assert))}
    m = _median_per_call(compiled, (q, k, v, g, beta, cu), rounds=7, calls=40)
    print(f"{args.backend} kda_chunk T={T}: with {m['with'] * 1e3:.3f} ms, without {m['without'] * 1e3:.3f} ms "
          f"per call ({100 * (m['with'] / m['without'] - 1):+.1f}%)")

    def alone(x, cu):
        check_cu_seqlens("kda", cu, x.shape[0])
        return x + 1

    compiled = {n: torch.compile(f, fullgraph=True, backend=args.backend)
                for n, f in (("with", alone), ("without", lambda x, cu: x + 1))}
    m = _median_per_call(compiled, (torch.randn(T, K), cu), rounds=9, calls=2000)
    print(f"{args.backend} the assertion alone: {(m['with'] - m['without']) * 1e6:+.1f} us per call "
          f"(with {m['with'] * 1e6:.1f} us, without {m['without'] * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
