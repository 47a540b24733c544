"""Bad input to the KDA ops raises ValueError naming the broken rule."""

import pytest
import torch

from inductor_ext import ops

B, T, H, K, V = 1, 8, 2, 16, 8


def good(**over):
    args = {
        "q": torch.randn(B, T, H, K), "k": torch.randn(B, T, H, K), "v": torch.randn(B, T, H, V),
        "g": -torch.rand(B, T, H, K), "beta": torch.rand(B, T, H),
        "initial_state": None, "cu_seqlens": None,
    }
    args.update(over)
    return args


def call(fn=ops.kda_chunk, precision="fp32", **over):
    a = good(**over)
    kw = {"precision": precision} if fn is ops.kda_chunk else {}
    return fn(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
              cu_seqlens=a["cu_seqlens"], **kw)


CASES = {
    "q rank": ({"q": torch.randn(T, H, K)}, "q must be"),
    "k shape": ({"k": torch.randn(B, T, H, K + 1)}, "k must have q's shape"),
    "v shape": ({"v": torch.randn(B, T + 1, H, V)}, "v must be"),
    "g shape": ({"g": -torch.rand(B, T, H, K - 1)}, "g must be"),
    "beta shape": ({"beta": torch.rand(B, T)}, "beta must be"),
    "K > 256": ({"q": torch.randn(B, T, H, 288), "k": torch.randn(B, T, H, 288),
                 "g": -torch.rand(B, T, H, 288)}, "K must be <= 256"),
    "q dtype": ({"q": torch.randn(B, T, H, K).half(), "k": torch.randn(B, T, H, K).half()}, "q must be bfloat16 or float32"),
    "q/k dtypes differ": ({"k": torch.randn(B, T, H, K).bfloat16()}, "q and k must share a dtype"),
    "g dtype": ({"g": -torch.rand(B, T, H, K).bfloat16()}, "g .* must be float32"),
    "g not finite": ({"g": torch.full((B, T, H, K), float("-inf"))}, "must be finite"),
    "g nan": ({"g": torch.full((B, T, H, K), float("nan"))}, "must be finite"),
    "cu dtype": ({"cu_seqlens": torch.tensor([0, T], dtype=torch.int32)}, "cu_seqlens must be a 1-D int64"),
    "cu unsorted": ({"cu_seqlens": torch.tensor([0, 6, 3, T])}, "non-decreasing"),
    "cu out of range": ({"cu_seqlens": torch.tensor([0, 4, T + 2])}, "non-decreasing from 0 to T"),
    "cu not from 0": ({"cu_seqlens": torch.tensor([1, T])}, "non-decreasing from 0 to T"),
    "batch > 1 with cu": ({"q": torch.randn(2, T, H, K), "k": torch.randn(2, T, H, K), "v": torch.randn(2, T, H, V),
                           "g": -torch.rand(2, T, H, K), "beta": torch.rand(2, T, H),
                           "cu_seqlens": torch.tensor([0, T])}, "batch must be 1"),
    "state shape": ({"initial_state": torch.zeros(2, H, K, V)}, "initial_state must be float32"),
    "state dtype": ({"initial_state": torch.zeros(B, H, K, V, dtype=torch.bfloat16)}, "initial_state must be float32"),
    "device": ({"initial_state": torch.zeros(B, H, K, V, device="meta")}, "one device"),
}


@pytest.mark.parametrize("fn", [ops.kda_chunk, ops.kda_recurrent], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("over,match", CASES.values(), ids=CASES.keys())
def test_bad_input_raises_value_error(fn, over, match):
    with pytest.raises(ValueError, match=match):
        call(fn, **over)


def test_bad_precision():
    with pytest.raises(ValueError, match="kda precision must be one of"):
        call(precision="fp16")


def test_empty_document_is_allowed():
    o, s = call(cu_seqlens=torch.tensor([0, 3, 3, T]))
    assert o.shape == (B, T, H, V) and s.shape == (3, H, K, V)
    assert torch.equal(s[1], torch.zeros(H, K, V))
