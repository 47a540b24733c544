"""inductor_ext.bench.timing on CPU: argument checks and the wall-clock path of ``timed``
(the CUDA-graph replays run on the H200)."""

import time

import pytest

from inductor_ext.bench import timing


def test_capture_rejects_zero_calls():
    with pytest.raises(ValueError, match="calls must be >= 1"):
        timing.capture(lambda: None, calls=0)


def test_timed_on_cpu_returns_the_result_and_wall_microseconds():
    out, us = timing.timed(lambda: time.sleep(0.01) or 7, device="cpu")
    assert out == 7 and 1e4 <= us < 1e6


def test_summarize():
    assert timing.summarize([3.0, 1.0, 2.0]) == {"p50_us": 2.0, "max_us": 3.0, "samples": 3}
