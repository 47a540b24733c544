"""``GLM53Model.token_logprobs`` on the tiny preset (BF16): the chunked op on the final hidden state
against the model's own logits → FP32 ``log_softmax`` → gather (the materialized path), plain and
batch-invariant, packed documents, a temperature, ignored positions, entropy and the gradients of
the lm_head weight and the final norm's weight (through the op's hidden gradient)."""

import pytest
import torch

from graphs import GLM53Config, GLM53Model
from inductor_ext import PrecisionConfig
from tests.support.fp64 import assert_rel_l2

LENGTHS = (13, 30, 21)
# the logits are the same BF16 lm_head output on both paths (one vocabulary chunk at V = 256), so
# the values differ by FP32 log-softmax arithmetic only; the gradient by the rounding of the
# materialized path's BF16 logit gradient (the op's backward GEMMs are FP32)
TOL = {"values": 2e-6, "grad": 1e-2}
PRECISIONS = {"reference": PrecisionConfig.reference(),
              "serving_aligned_batch_invariant": PrecisionConfig.serving_aligned().replace(batch_invariant=True)}


def _model_and_batch(prec, seed=0):
    torch.manual_seed(seed)
    model = GLM53Model(GLM53Config.tiny(), precision=prec).to_dtype(torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (sum(LENGTHS),))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    targets = torch.roll(ids, -1)
    targets[cu[1:] - 1] = -100  # a document's last position has no next token
    return model, ids, targets, cu


def _materialized(model, ids, targets, cu, temperature):
    logp = torch.log_softmax(model(ids, cu).float() / temperature, dim=-1)
    valid = targets != -100
    picked = logp.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, picked, 0.0), torch.where(valid, entropy, 0.0)


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_matches_the_models_logits(name):
    model, ids, targets, cu = _model_and_batch(PRECISIONS[name])
    params = {"lm_head.weight": model.lm_head.weight, "norm.weight": model.norm.weight}  # the op's dW and dx
    lp, ent = model.token_logprobs(ids, targets, cu, temperature=0.8, return_entropy=True)
    assert lp.shape == ent.shape == ids.shape and lp.dtype == torch.float32
    grads = torch.autograd.grad(lp.sum() + ent.sum(), list(params.values()))
    want_lp, want_ent = _materialized(model, ids, targets, cu, 0.8)
    want_grads = torch.autograd.grad(want_lp.sum() + want_ent.sum(), list(params.values()))
    assert_rel_l2("logprobs", lp.detach(), want_lp.detach(), TOL["values"])
    assert_rel_l2("entropy", ent.detach(), want_ent.detach(), TOL["values"])
    for pname, got, want in zip(params, grads, want_grads):
        assert_rel_l2(f"grad {pname}", got, want, TOL["grad"])
    assert torch.equal(lp[targets == -100], torch.zeros(len(LENGTHS)))


def test_batch_shape_and_bad_targets():
    model, ids, targets, cu = _model_and_batch(PrecisionConfig.reference())
    with torch.no_grad():
        lp = model.token_logprobs(ids[None], targets[None], cu)
        assert lp.shape == (1, ids.shape[0])
        assert torch.equal(lp[0], model.token_logprobs(ids, targets, cu))
        with pytest.raises(ValueError, match="targets must have input_ids' shape"):
            model.token_logprobs(ids, targets[:-1], cu)
        with pytest.raises(ValueError, match="temperature must be a finite python float > 0"):
            model.token_logprobs(ids, targets, cu, temperature=0.0)
