"""KDA chunk replay (graphs/kda_replay.py, ServingDecoder under ``batch_invariant``) against the full
chunk forward: every decoded row must be *bitwise* the row ``kda_chunk`` computes at that position
of the whole document (``docs/DESIGN.md`` §9).

What makes it exact: ``kda_chunk``'s chunks of 64 start at each document's first token (a call with
``initial_state`` continues the document from there), so replaying the open chunk from the FP32
state at its boundary runs the chunk forward's own chunk; and the open chunk zero-padded to 64 rows
gives its rows the full chunk's bits (checked on the op, then through the layer and the decoder).
Run with only its own rows on this CPU it does too since the CPU reference pads a document's partial
last chunk the same way (``kda_reference._chunk_document``).
"""

import copy

import pytest
import torch

from graphs.config import GLM53Config
from graphs.decode import ServingDecoder
from graphs.kda_layer import LinearAttention
from graphs.kda_replay import CHUNK, replay_prefill, replay_step
from graphs.serving import ServingForward
from inductor_ext import PrecisionConfig, ops
from inductor_ext.bench.inputs import build_model
from inductor_ext.ops.packing import document_positions
from tests.support.batch_invariant import DEVICES

KDA = ["bf16", "fp32"]
# crosses the chunk boundaries 64, 128 and 192; the forward's last chunk has 8 rows
T = 200


def _prec(kda: str) -> PrecisionConfig:
    return PrecisionConfig.reference().replace(kda=kda, mla="absorbed", batch_invariant=True)


@pytest.fixture(scope="module")
def attn():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = LinearAttention(GLM53Config.tiny())
    # slow decay (g ≈ -5·σ(-6) ≈ -0.012 per token, not ≈ -2.5 at dt_bias 0): the state carried over a
    # chunk boundary then shows in every row of the next chunk, so a wrong boundary state cannot hide
    layer.forget_gate.dt_bias.data.fill_(-6.0)
    return layer.to(torch.bfloat16).eval().requires_grad_(False)


def _rand(*shape, seed, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _op_inputs(H=2, K=128, L=2 * CHUNK):
    """FP32 q/k/v/beta holding BF16 values (so o comes back in FP32: every bit visible), FP32 g and
    a nonzero initial state."""
    q, k, v = (_rand(1, L, H, K, seed=s).float() for s in (1, 2, 3))
    g = -0.02 * torch.rand(1, L, H, K, generator=torch.Generator().manual_seed(4))
    beta = torch.sigmoid(_rand(1, L, H, seed=5)).float()
    return (q, k, v, g, beta), _rand(1, H, K, K, seed=6, dtype=torch.float32)


def _second_chunk_rows(kda, fill, K):
    """(row c - 1 of the second chunk run on its own with c rows, the same row in the full run) for
    every c; ``fill``: the open chunk zero-padded to 64 rows (the replay's call), else c rows."""
    inputs, h0 = _op_inputs(K=K)
    full = ops.kda_chunk(*inputs, initial_state=h0, precision=kda)[0]
    state = ops.kda_chunk(*(x[:, :CHUNK] for x in inputs), initial_state=h0, precision=kda)[1]
    for c in range(1, CHUNK + 1):
        part = [x[:, CHUNK: CHUNK + c] for x in inputs]
        if fill:
            part = [torch.cat([x, x.new_zeros(1, CHUNK - c, *x.shape[2:])], 1) for x in part]
        yield c, ops.kda_chunk(*part, initial_state=state, precision=kda)[0][0, c - 1], full[0, CHUNK + c - 1]


@pytest.mark.parametrize("K", [32, 128])
@pytest.mark.parametrize("kda", KDA)
def test_padded_chunk_row_independent_of_later_rows(kda, K):
    """What the replay rests on, on the op itself (FP32 outputs, nonzero initial state): row c - 1 of
    a chunk zero-padded after it equals, bitwise, the row inside the full chunk, for every c."""
    assert [c for c, row, ref in _second_chunk_rows(kda, True, K) if not torch.equal(row, ref)] == []


@pytest.mark.parametrize("kda", KDA)
def test_partial_chunk_row_independent_of_chunk_length(kda):
    """The same for the chunk run with only its c rows (a document's last, partial chunk): row c - 1
    must not depend on how many rows the chunk has. MKL rounds a 1-row ``[1,K]@[K,V]`` and a 2- or
    3-row ``[c,c]@[c,V]`` differently from the same rows in a 64-row chunk (FP32 ulps; this failed
    for c = 1..3 before), so the CPU reference runs a partial chunk zero-padded to 64 rows
    (``kda_reference._chunk_document``)."""
    assert [c for c, row, ref in _second_chunk_rows(kda, False, 32) if not torch.equal(row, ref)] == []


def _full_chunk_forward(attn, x, n, prec, h0):
    """The training-form layer core on n packed documents of T tokens: ``[n, T, hidden]``."""
    cu = torch.arange(n + 1, dtype=torch.int64, device=x.device) * T
    qkv = attn.short_conv(attn.qkv_proj(x, prec), document_positions(cu, n * T, x.device))
    out, _ = attn.mix(x, qkv, cu, prec, serving=False, initial_state=h0)
    return qkv, out.view(n, T, -1)


def _replay(attn, x, qkv, n, prompt, prec, h0):
    """Prefill ``prompt`` tokens per sequence, then decode to T: the rows ``[n, T, hidden]``."""
    xs, qs = x.view(n, T, -1), qkv.view(n, T, -1)
    out, cache = replay_prefill(attn, xs[:, :prompt].reshape(n * prompt, -1),
                                qs[:, :prompt].reshape(n * prompt, -1), n, prompt, prec, initial_state=h0)
    rows = [out.view(n, prompt, -1)]
    for t in range(prompt + 1, T + 1):
        o, cache = replay_step(attn, xs[:, t - 1], qs[:, t - 1], t, cache, prec)
        rows.append(o[:, None])
    assert cache["open_qkv"].shape[1] == CHUNK  # the cache never grows past one chunk
    return torch.cat(rows, dim=1)


def _mismatched(a, b):
    """Positions (sequence, token) whose rows differ in any bit."""
    return [(i, j) for i in range(a.shape[0]) for j in range(a.shape[1]) if not torch.equal(a[i, j], b[i, j])]


CASES = {  # (sequences, prompt length, nonzero initial state)
    "1x1": (1, 1, False),  # a prompt shorter than a chunk, 199 steps over the boundaries 64, 128, 192
    "1x64": (1, 64, False),  # a prompt ending on a boundary: the open chunk starts empty
    "3x63_h0": (3, 63, True),  # the first step completes a chunk; 3 packed sequences, initial states
    "3x130": (3, 130, False),  # a prompt over two chunks
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kda", KDA)
@pytest.mark.parametrize("case", list(CASES))
def test_replay_rows_bitwise_full_chunk_forward(attn, kda, case, device):
    """Prefill + one-token steps to 200 tokens, every row bitwise the full forward's (prompts
    shorter and longer than a chunk, on and off a boundary; 3 packed sequences; initial states)."""
    n, prompt, with_h0 = CASES[case]
    prec = _prec(kda)
    attn = copy.deepcopy(attn).to(device)
    x = _rand(n * T, attn.o_proj.out_features, seed=10 + n).to(device)
    h0 = 0.1 * _rand(n, attn.num_heads, attn.head_dim, attn.head_dim, seed=11, dtype=torch.float32).to(device) \
        if with_h0 else None
    qkv, full = _full_chunk_forward(attn, x, n, prec, h0)
    assert _mismatched(_replay(attn, x, qkv, n, prompt, prec, h0), full) == []


@pytest.mark.parametrize("kda", KDA)
def test_decoder_kda_replay_bitwise_training_layer(kda):
    """LinearAttention.prefill / step under batch_invariant (its own conv window, prefill split at
    the chunk boundary, replay steps) on the tiny model's KDA layer, 3 sequences: every row bitwise
    LinearAttention.forward(serving=False) of the whole packed documents."""
    model = build_model(seed=0)
    prec = _prec(kda)
    layer = next(lay for lay in model.layers if lay.kind == "linear_attention")
    attn, n, prompt = layer.self_attn, 3, 100
    x = _rand(n * T, model.config.hidden_size, seed=20)
    cu = torch.arange(n + 1, dtype=torch.int64) * T
    with torch.no_grad():
        full = attn(x, cu, prec).view(n, T, -1)
        xs = x.view(n, T, -1)
        out, _, cache = attn.prefill(xs[:, :prompt].reshape(n * prompt, -1), n, None, prec)
        rows = [out.view(n, prompt, -1)]
        for t in range(prompt + 1, T + 1):
            rows.append(attn.step(xs[:, t - 1], None, cache, prec)[0][:, None])
    assert set(cache) == {"length", "window", "state", "open_qkv", "open_g", "open_beta"}
    assert _mismatched(torch.cat(rows, dim=1), full) == []


def test_decoder_kda_recurrent_cache_without_batch_invariant():
    """batch_invariant=False keeps the recurrent decode: its cache is the state after the last token."""
    model = build_model(seed=0)
    prec = PrecisionConfig.serving_aligned().replace(mla="absorbed")
    attn = next(lay for lay in model.layers if lay.kind == "linear_attention").self_attn
    x = _rand(2 * 5, model.config.hidden_size, seed=30)
    with torch.no_grad():
        _, _, cache = attn.prefill(x, 2, None, prec)
        attn.step(x[:2], None, cache, prec)
    assert set(cache) == {"length", "window", "state"} and cache["length"] == 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kda", KDA)
def test_decoder_logits_bitwise_training_forward(kda, device):
    """True on-policy end to end: under batch_invariant the decoder's next-token logits (3 sequences,
    a 62-token prompt, steps to 65 over the chunk boundary at 64) are bitwise the last-position
    logits of the *training* forward (``serving=False``: KDA through ``kda_chunk``) of the prefixes."""
    model = build_model(seed=0, device=device)
    prec = _prec(kda)
    dec = ServingDecoder(ServingForward(model, prec))
    n, prompt, steps = 3, 62, 3
    seqs = torch.randint(0, model.config.vocab_size, (n, prompt + steps),
                         generator=torch.Generator().manual_seed(40)).to(device)

    def training_last(prefix):
        cu = torch.arange(n + 1, dtype=torch.int64, device=device) * prefix.shape[1]
        hidden = model.final_hidden(prefix.reshape(-1), cu, prec, serving=False)[0]
        return model.lm_head(hidden).view(n, prefix.shape[1], -1)[:, -1]

    with torch.no_grad():
        logits, cache = dec.prefill(seqs[:, :prompt])
        equal = [torch.equal(logits, training_last(seqs[:, :prompt]))]
        for i in range(steps):
            logits, cache = dec.step(seqs[:, prompt + i], cache)
            equal.append(torch.equal(logits, training_last(seqs[:, : prompt + i + 1])))
    assert equal == [True] * (steps + 1)
