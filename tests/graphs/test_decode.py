"""Incremental serving decode (graphs/decode.py) against the full serving re-forward.

Every layer's math in a decode step is the packed forward's restricted to the new token (same
modules, same ops, same FP32 sum orders: the KDA recurrence carries the same FP32 state token by
token, the short conv sums the same terms in the same order, the indexer scores the same pools with
the same causal metadata, per-token modules see the same rows), so the logits must be *bitwise*
equal to the last-position logits of ``ServingForward`` on the packed prefixes (on this CPU build:
MKL's FP32 GEMM rounds differently below 12 rows, so the decoder pads a step to 12 rows, see
``graphs.decode._MIN_ROWS``; the GPU's GEMM heuristics are not covered by this test).
"""

import pytest
import torch

from graphs.decode import DecodeCache, ServingDecoder
from graphs.serving import SERVING_PRECISION, ServingForward
from inductor_ext import PrecisionConfig
from inductor_ext.bench.inputs import build_model, make_prompts
from inductor_ext.report.mismatch import calibrate, rollout

PRECISIONS = {
    "serving_aligned": SERVING_PRECISION,
    "mhc_post_bf16": SERVING_PRECISION.replace(mhc_post="bf16"),  # a mis-aligned serving engine
    # BF16 indexer pools / reference pooling branch (serving caches the latent: MLA absorbed)
    "reference": PrecisionConfig.reference().replace(mla="absorbed"),
    # no row padding (graphs.decode._MIN_ROWS) for 3 sequences: every linear, the indexer included, is invariant
    "batch_invariant": SERVING_PRECISION.replace(batch_invariant=True),
    "batch_invariant_bf16_indexer": PrecisionConfig.reference().replace(mla="absorbed", batch_invariant=True),
}


@pytest.fixture(scope="module")
def model():
    return build_model(seed=0)


def _tokens(vocab, n, length, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=gen, dtype=torch.int64).to(device)


def _full_last(serve, seqs):
    n, length = seqs.shape
    cu = torch.arange(n + 1, dtype=torch.int64, device=seqs.device) * length
    return serve(seqs.reshape(-1), cu).view(n, length, -1)[:, -1]


def _decode_vs_full(serve, prompts, steps):
    """Max |decode − full| of the logits after prefill and after every step (the list)."""
    dec = ServingDecoder(serve)
    seqs = prompts.clone()
    diffs = []
    with torch.no_grad():
        logits, cache = dec.prefill(prompts)
        for i in range(steps.shape[1] + 1):
            full = _full_last(serve, seqs)
            assert logits.shape == full.shape and logits.dtype == full.dtype
            diffs.append(0.0 if torch.equal(logits, full) else (logits.float() - full.float()).abs().max().item())
            if i == steps.shape[1]:
                break
            seqs = torch.cat([seqs, steps[:, i: i + 1]], dim=1)
            logits, cache = dec.step(steps[:, i], cache)
    assert isinstance(cache, DecodeCache) and cache.length == seqs.shape[1]
    return diffs


def _decode_diffs(model, name):
    """3 sequences, 16-token prefill, 12 fixed-token steps on the model's device."""
    device, V = model.lm_head.weight.device, model.config.vocab_size
    serve = ServingForward(model, PRECISIONS[name])
    return _decode_vs_full(serve, _tokens(V, 3, 16, seed=5, device=device), _tokens(V, 3, 12, seed=6, device=device))


@pytest.mark.parametrize("name", list(PRECISIONS))
def test_decode_logits_bitwise_equal_full_reforward(model, name):
    """3 sequences, 16-token prefill, 12 fixed-token steps (crosses 3 pool boundaries; topk/P = 4
    pools, so from 20 tokens on the indexer really selects)."""
    diffs = _decode_diffs(model, name)
    assert diffs == [0.0] * 13, diffs


@pytest.mark.cuda
@pytest.mark.parametrize("name", [n for n in PRECISIONS if n.startswith("batch_invariant")])
def test_cuda_decode_logits_bitwise_equal_full_reforward(name):
    """The test above on CUDA for the batch-invariant configs (the plain ones are not expected to
    hold there: cuBLAS picks kernels by shape)."""
    diffs = _decode_diffs(build_model(seed=0, device="cuda"), name)
    assert diffs == [0.0] * 13, diffs


def test_decode_short_prompt_bitwise(model):
    """A 2-token prompt: shorter than the conv window (3) and than one pool (4), six sequences.
    Bitwise under ``batch_invariant`` (KDA replayed through the chunk kernel): the plain path's
    equality rests on MKL's FP32 GEMM rounding rows alike above ``graphs.decode._MIN_ROWS`` rows,
    which held on AVX-512 machines but not on this AMX one (one logit 2^-7 apart at step 7), so
    the plain path is held to a tolerance."""
    V = model.config.vocab_size
    prompts, steps = _tokens(V, 6, 2, seed=7), _tokens(V, 6, 9, seed=8)
    invariant = ServingForward(model, PrecisionConfig.serving_aligned().replace(batch_invariant=True))
    assert _decode_vs_full(invariant, prompts, steps) == [0.0] * 10
    assert max(_decode_vs_full(ServingForward(model), prompts, steps)) <= 2 ** -5


def test_decode_shares_weights_and_checks_inputs(model):
    dec = ServingDecoder(ServingForward(model))
    assert dec.model is model
    with pytest.raises(ValueError, match="serve must be a ServingForward"):
        ServingDecoder(model)
    with pytest.raises(ValueError, match="prompts must be int64"):
        dec.prefill(torch.zeros(3, 4, dtype=torch.int32))
    _, cache = dec.prefill(_tokens(model.config.vocab_size, 3, 4, seed=1))
    with pytest.raises(ValueError, match=r"tokens must be int64 \[3\]"):
        dec.step(torch.zeros(2, dtype=torch.int64), cache)


def _old_rollout(serve, prompts, new_tokens, seed):
    """The former O(n²) rollout: one full re-forward of the packed sequences per sampled token."""
    gen = torch.Generator().manual_seed(seed + 2)
    seqs, logps = prompts.clone(), []
    n = prompts.shape[0]
    for _ in range(new_tokens):
        cu = torch.arange(n + 1, dtype=torch.int64) * seqs.shape[1]
        logits = serve(seqs.reshape(-1), cu).view(n, seqs.shape[1], -1)[:, -1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=gen)
        seqs = torch.cat([seqs, tok], dim=1)
        logps.append(logp)
    return seqs, torch.stack(logps, dim=1)


def test_rollout_identical_to_full_reforward_rollout():
    """mismatch.rollout (decoder) samples the same tokens with the same log-probs, bitwise, as the
    full re-forward rollout, on the calibrated (peaked) model."""
    model = build_model(seed=0)
    serve = ServingForward(model)
    prompts = make_prompts(model.config.vocab_size, 3, 8, seed=0)
    calibrate(model, prompts, 2.0, serve)
    seqs, logp = rollout(serve, prompts, 10, seed=0)
    ref_seqs, ref_logp = _old_rollout(serve, prompts, 10, seed=0)
    assert torch.equal(seqs, ref_seqs)
    assert torch.equal(logp, ref_logp)


def test_decoder_needs_the_absorbed_form(model):
    """Serving caches the MLA latent: a decompressed-MLA serving precision is refused, by name."""
    with pytest.raises(ValueError, match="mla='absorbed'"):
        ServingDecoder(ServingForward(model, precision=PrecisionConfig.reference()))
