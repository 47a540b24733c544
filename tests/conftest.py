"""Shared test set-up: the ``cuda`` marker skips without a GPU; deterministic seeds; on a GPU, the
recorded flash-linear-attention autotune results are primed into Triton's cache before any test,
and the suite shares one GPU between parallel pytest-xdist workers: every CUDA test holds a shared
lock on a file and returns its cached memory afterwards, a ``gpu_exclusive`` test (one that needs
most of the GPU's memory, e.g. the whole h200 layers) holds the lock exclusively."""

import contextlib
import fcntl
import gc
import json
import pathlib
import tempfile

import pytest
import torch

AUTOTUNE = pathlib.Path(__file__).resolve().parent / "support" / "h200_fla_autotune.json"


def _triton_cache_dir() -> pathlib.Path:
    from triton import knobs  # triton 3.6: the cache directory, TRITON_CACHE_DIR applied

    return pathlib.Path(knobs.cache.dir)


def prime_autotune_cache() -> int:
    """Write the recorded autotune results that Triton's cache lacks; returns how many were written.
    fla autotunes each (dtype, H, K, V, varlen) key for minutes; with these the H200 suite skips it."""
    cache = _triton_cache_dir()
    written = 0
    for rel, result in json.loads(AUTOTUNE.read_text())["files"].items():
        path = cache / rel
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result))
            written += 1
    return written


GPU_LOCK = pathlib.Path(tempfile.gettempdir()) / "glm53-inductor-gpu.lock"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu_exclusive: needs most of the GPU's memory; runs with no other CUDA test")
    if torch.cuda.is_available():
        prime_autotune_cache()


@contextlib.contextmanager
def _gpu_share(exclusive: bool):
    with open(GPU_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            gc.collect()
            torch.cuda.empty_cache()
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _gpu_memory(request):
    if "cuda" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    with _gpu_share("gpu_exclusive" in request.keywords):
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run them on a GPU machine: DEVELOPERS.md)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
