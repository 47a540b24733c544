"""CUDA-graph replay timing: capture once, time each replay with CUDA events, report p50 / max.

The method of the background measurements (forward replay, 50 samples after warm-up), so the
figures are comparable. Warm-up runs eagerly on a side stream first, so Triton autotuning and
lazy initialisation happen before capture.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

__all__ = ["capture", "replay_times_us", "summarize", "replay_stats"]


def capture(fn: Callable[[], object], warmup: int = 3) -> torch.cuda.CUDAGraph:
    """Run ``fn`` ``warmup`` times on a side stream, then capture one call into a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
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


def replay_stats(fn: Callable[[], object], samples: int = 50, warmup: int = 3) -> dict[str, float]:
    """:func:`capture` ``fn`` (``warmup`` eager calls first), then :func:`summarize` ``samples`` replays."""
    return summarize(replay_times_us(capture(fn, warmup=warmup), samples=samples))
