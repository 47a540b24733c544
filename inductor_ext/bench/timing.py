"""CUDA-graph replay timing: capture once, time each replay with CUDA events, report p50 / max.

Every benchmark times this way (by default 50 replays after warm-up), so their figures are
comparable. Warm-up runs eagerly on a side stream first, so Triton autotuning and lazy
initialisation happen before capture. A replay of one call includes the graph's launch and
the kernel's ramp-up and tail (5-10 µs on the H200); for kernels of a few tens of µs,
``calls > 1`` captures that many calls back to back and reports the time per call, the cost a
kernel has between its neighbours in a real step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["capture", "replay_times_us", "summarize", "replay_stats", "spin", "timed"]


def capture(fn: Callable[[], object], warmup: int = 3, calls: int = 1) -> torch.cuda.CUDAGraph:
    """Run ``fn`` ``warmup`` times on a side stream, then capture ``calls`` calls into a CUDA graph."""
    if calls < 1:
        raise ValueError(f"capture: calls must be >= 1, got {calls}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def replay_times_us(graph: torch.cuda.CUDAGraph, samples: int = 50, warmup: int = 5) -> list[float]:
    """Microseconds of ``samples`` single replays, each bracketed by CUDA events."""
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def summarize(times_us: list[float]) -> dict[str, float]:
    """``{"p50_us", "max_us", "samples"}`` of a list of replay times."""
    return {"p50_us": statistics.median(times_us), "max_us": max(times_us), "samples": len(times_us)}


def replay_stats(fn: Callable[[], object], samples: int = 50, warmup: int = 3, calls: int = 1) -> dict[str, float]:
    """:func:`capture` ``calls`` calls of ``fn`` (``warmup`` eager calls first), then :func:`summarize`
    ``samples`` replays, each divided by ``calls``."""
    times = replay_times_us(capture(fn, warmup=warmup, calls=calls), samples=samples)
    return summarize([t / calls for t in times])


def spin(fn: Callable[[], object], seconds: float = 0.3) -> None:
    """Call ``fn`` for about ``seconds`` of wall time, so that the GPU's clocks have ramped up
    before the first timed replay (on an idle H200 a first timed copy takes ~52 µs instead of 38)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str = "cuda") -> tuple[object, float]:
    """``(fn(), microseconds)``: CUDA events around the call on ``device="cuda"``, the wall clock
    otherwise."""
    if device != "cuda":
        start = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - start) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) * 1e3
