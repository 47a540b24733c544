"""Spawned-process helpers of the context-parallel tests (``tests/parallel/``): gloo on CPU over
127.0.0.1, one result per rank.

``run_ranks(fn, world, *args)`` starts ``world`` processes with ``torch.multiprocessing`` (spawn),
each initializing a gloo group on a free local TCP port and calling ``fn(rank, world, *args)``;
``fn`` must be a module-level function (the children import it by name) and return a picklable
value (``torch.save``-able). Results come back as a list indexed by rank; an exception in a child
fails the call with the child's traceback; a run past ``timeout`` seconds is killed.

Starting processes dominates the cost on a small CPU (each child imports torch and the package), so
test modules :func:`register` their jobs at import time (pytest imports every module before the
first test runs) and :func:`job_result` runs ALL registered jobs of one world size in a single
spawn, once per pytest session.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks", "register", "session_seconds", "job_result", "one_rank_group", "rel_l2",
           "max_abs", "bitwise"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, fn, world, port, outdir, args):
    started = time.monotonic()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if isinstance(result, dict) and "_seconds" in result:
        result["_seconds"]["_child_total"] = round(time.monotonic() - started, 1)
    torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))


def run_ranks(fn, world: int, *args, timeout: float = 480.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; the per-rank results."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_child, args=(fn, world, free_port(), outdir, args), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"run_ranks: {fn.__name__} on {world} ranks ran past {timeout} s")
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


_JOBS: dict[int, dict[str, tuple]] = {}


def register(world: int, key: str, fn, *args) -> None:
    """Add job ``key`` = ``fn(rank, world, *args)`` to the session's single spawn of ``world`` ranks.
    Every rank runs every job in registration order (so their collectives line up)."""
    _JOBS.setdefault(world, {})[key] = (fn, args)


class JobError:
    """A job that raised in a child: its formatted traceback."""

    def __init__(self, text: str):
        self.text = text


def _run_jobs(rank: int, world: int, jobs: tuple) -> dict:
    import traceback

    out = {"_seconds": {}}
    for key, fn, args in jobs:
        start = time.monotonic()
        try:
            out[key] = fn(rank, world, *args)
        except Exception:  # noqa: BLE001  (reported by job_result in the parent)
            out[key] = JobError(f"rank {rank}, job {key}:\n{traceback.format_exc()}")
        out["_seconds"][key] = round(time.monotonic() - start, 1)
    return out


@functools.cache
def _session(world: int) -> list[dict]:
    jobs = tuple((key, fn, args) for key, (fn, args) in _JOBS.get(world, {}).items())
    # one spawn runs every job of this world size: 480 s, and 120 s more per job past four
    return run_ranks(_run_jobs, world, jobs, timeout=480.0 + 120.0 * max(0, len(jobs) - 4))


def session_seconds(world: int) -> list[dict]:
    """Seconds per job on each rank of the session's spawn (and the child's total)."""
    return [res["_seconds"] for res in _session(world)]


def job_result(world: int, key: str) -> list:
    """Per-rank results of the registered job ``key`` (the session's spawn runs on first use);
    a job that raised on any rank fails here with that rank's traceback."""
    per_rank = [res[key] for res in _session(world)]
    for res in per_rank:
        if isinstance(res, JobError):
            raise AssertionError(res.text)
    return per_rank


@contextlib.contextmanager
def one_rank_group():
    """Inside: a gloo process group of this process alone (an in-memory store), unless one is active
    already; the test is skipped when the active group has more ranks."""
    import pytest

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        if dist.get_world_size() != 1:
            pytest.skip("a process group of another size is active")
        yield
    finally:
        if owned:
            dist.destroy_process_group()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖₂ / ‖b‖₂ in FP64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| in FP64."""
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (so -0.0 differs from 0.0 and equal NaNs match)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
