"""The transformers call (``graphs/transformers_call.py``) on ``GLM53Model`` and on a transformers
model patched by ``graphs.patch_transformers``, tiny preset, BF16, ``reference()`` with
``kda="fp32"`` (eager; the compiled call: ``test_transformers_patch``).

- ``CausalLMOutputWithPast`` with the legacy call's logits; the legacy call (``model(ids, cu_seqlens)``:
  ``input_ids`` by position and no transformers keyword) unchanged: a bare tensor.
- A document packed by ``position_ids`` bitwise equal to the same document alone (both models):
  every op restarts at a document start, and on CPU these GEMMs gave each row the same bits
  whatever the row count (as ``test_parity``'s packed-documents test).
- ``labels``: the loss is transformers' ``ForCausalLMLoss`` of the returned logits, bitwise, and the
  FP32 cross-entropy of the shifted pairs; ``token_logprobs`` (``position_ids=``) equals
  ``log_softmax`` of the logits gathered (relative L2 2e-6: FP32 log-softmax arithmetic apart, the
  logits are the same BF16 lm_head output), bitwise between the two models.
- int32 ``cu_seqlens`` and flash-attn's ``cu_seq_lens_q``; every refusal names its rule.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.loss.loss_utils import ForCausalLMLoss
from transformers.modeling_outputs import CausalLMOutputWithPast

from graphs import GLM53Config, GLM53Model, patch_transformers
from inductor_ext import PrecisionConfig
from tests.support.fp64 import assert_rel_l2
from tests.support.hf import tiny_hf_model

PREC = PrecisionConfig.reference().replace(kda="fp32")
V = GLM53Config.tiny().vocab_size
LENGTHS = (13, 30, 21)
T = sum(LENGTHS)
TOKENS = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(2))
POS = torch.cat([torch.arange(n) for n in LENGTHS])[None]
CU = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
LABELS = TOKENS.clone()
LABELS[0, CU[1:-1]] = -100  # a document's first token is not predicted from the previous document
LABELS[0, 5] = -100


@pytest.fixture(scope="module")
def models():
    hf = patch_transformers(tiny_hf_model(), precision=PREC)
    return {"patched": hf, "glm53": GLM53Model.from_hf(hf, precision=PREC)}


@pytest.fixture(scope="module")
def packed(models):
    """Each model's output for the packed batch, labels included."""
    with torch.no_grad():
        return {name: m(input_ids=TOKENS, position_ids=POS, labels=LABELS) for name, m in models.items()}


NAMES = ("patched", "glm53")


def test_returns_causal_lm_output_and_legacy_call_unchanged(models, packed):
    glm = models["glm53"]
    with torch.no_grad():
        legacy = glm(TOKENS[0], CU)
        assert isinstance(legacy, torch.Tensor) and isinstance(glm(TOKENS, cu_seqlens=CU[[0, -1]]), torch.Tensor)
        assert isinstance(glm(input_ids=TOKENS), CausalLMOutputWithPast)  # input_ids by name: transformers
        for name in NAMES:
            out = packed[name]
            assert isinstance(out, CausalLMOutputWithPast) and out.logits.shape == (1, T, V)
            torch.testing.assert_close(out.logits[0], legacy, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        one = glm(TOKENS, return_dict=True)
        assert isinstance(one, CausalLMOutputWithPast) and one.loss is None
        torch.testing.assert_close(one.logits, glm(TOKENS), rtol=0, atol=0)
        logits, = glm(TOKENS, return_dict=False)
        loss, logits2 = models["patched"](input_ids=TOKENS, labels=LABELS, return_dict=False)
        torch.testing.assert_close(logits2, logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_document_packed_by_position_ids_equals_it_alone(models, packed, name):
    logits = packed[name].logits
    with torch.no_grad():
        for s, e in zip(CU[:-1].tolist(), CU[1:].tolist()):
            alone = models[name](input_ids=TOKENS[:, s:e]).logits
            torch.testing.assert_close(logits[:, s:e], alone, rtol=0, atol=0, msg=lambda m: f"{s}:{e}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_labels_loss_is_shifted_cross_entropy_in_fp32(packed, name):
    out = packed[name]
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    torch.testing.assert_close(out.loss, ForCausalLMLoss(out.logits, LABELS, V), rtol=0, atol=0)
    keep = LABELS[0, 1:] != -100
    manual = F.cross_entropy(out.logits[0, :-1][keep].float(), LABELS[0, 1:][keep])
    torch.testing.assert_close(out.loss, manual, rtol=1e-6, atol=0)


def test_documents_by_cu_seqlens_int32_flash_kwargs_and_all_ones_mask(models, packed):
    for name in NAMES:
        m, want = models[name], packed[name].logits
        with torch.no_grad():
            for kwargs in (dict(cu_seqlens=CU.int()), dict(cu_seqlens=CU), dict(cu_seq_lens_q=CU.int(), max_length_q=30),
                           dict(position_ids=POS[0], attention_mask=torch.ones(1, T, dtype=torch.int64))):
                got = m(input_ids=TOKENS, **kwargs).logits
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda msg: f"{name} {list(kwargs)}: {msg}")


@pytest.mark.parametrize("name", NAMES)
def test_refusals_name_their_rule(models, name):
    m = models[name]
    mask = torch.ones(1, T, dtype=torch.int64)
    mask[0, -3:] = 0
    bad = [
        (dict(attention_mask=mask), "attention_mask must be None or all ones.*position_ids"),
        (dict(use_cache=True), "use_cache=True is not supported"),
        (dict(past_key_values=object()), "cache are not supported"),
        (dict(position_ids=POS + 1), "first token must have position 0"),
        (dict(position_ids=torch.cat([POS[:, :20], POS[:, 21:], torch.zeros(1, 1, dtype=torch.int64)], 1)),
         "count up by one inside a document"),
        (dict(position_ids=POS[:, :-1]), r"position_ids must be \[T\] or \[1, T\]"),
        (dict(labels=LABELS[:, :-1]), "labels must be integer token ids of input_ids' shape"),
        (dict(cu_seqlens=CU.float()), "cu_seqlens must be a 1-D int64"),
        (dict(output_attentions=True), "output_attentions=True is not supported"),
    ]
    with torch.no_grad():
        for kwargs, match in bad:
            with pytest.raises(ValueError, match=match):
                m(input_ids=TOKENS, **kwargs)
        with pytest.raises(ValueError, match="input_ids must be int64"):
            m(input_ids=TOKENS.int(), return_dict=True)
        m(input_ids=TOKENS, use_cache=False, output_attentions=False, logits_to_keep=0)  # unset options pass


def test_token_logprobs_of_the_patched_model(models, packed):
    targets = F.pad(LABELS[..., 1:], (0, 1), value=-100)
    lp = {n: models[n].token_logprobs(TOKENS, targets, position_ids=POS) for n in NAMES}
    torch.testing.assert_close(lp["patched"], lp["glm53"], rtol=0, atol=0)
    valid = targets != -100
    logp = torch.log_softmax(packed["patched"].logits.float(), dim=-1)
    want = torch.where(valid, logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0], 0.0)
    assert_rel_l2("logprobs", lp["patched"].detach(), want, 2e-6)
    torch.testing.assert_close(-lp["patched"][valid].mean(), packed["patched"].loss, rtol=1e-5, atol=0)
    with torch.no_grad():
        by_cu = models["patched"].token_logprobs(TOKENS, targets, CU.int())
    torch.testing.assert_close(by_cu, lp["patched"].detach(), rtol=0, atol=0)
