"""The two DSA attention forms (``PrecisionConfig.mla``): decompressed (transformers) and absorbed
(serving, ``ops.sparse_mla``) are the same function in exact arithmetic; in BF16 they round at
different points. Each is measured against the FP32 model (the same weights, the same token ids)
and against each other, relative to the BF16 noise floor of the decompressed form."""

import pytest
import torch

import inductor_ext
from graphs import GLM53Config, GLM53Model
from graphs.dsa_layer import IndexedAttention
from graphs.modules import cast_model
from graphs.sparse_attention import MAX_MASK_TOKENS, sparse_attention
from inductor_ext import PrecisionConfig

REF = PrecisionConfig.reference()
ABS = REF.replace(mla="absorbed")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _layer(cfg, dtype):
    torch.manual_seed(0)
    layer = IndexedAttention(cfg, 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    return cast_model(layer, dtype)


def test_dsa_layer_forms_agree_within_bf16_noise(record_property):
    cfg = GLM53Config.tiny()
    T = 96
    x = torch.randn(T, cfg.hidden_size)
    cu = torch.tensor([0, 40, 96])
    fp32, bf16 = _layer(cfg, torch.float32), _layer(cfg, torch.bfloat16)
    with torch.no_grad():
        _, ids = bf16(x.bfloat16(), cu, None, REF)  # one selection for every run
        fp32.indexer = bf16.indexer = None  # as shared-indexer layers, every form attends over `ids`
        exact = fp32(x, cu, ids, REF)[0]
        dec = bf16(x.bfloat16(), cu, ids, REF)[0]
        absorbed = bf16(x.bfloat16(), cu, ids, ABS)[0]
        absorbed_fp32 = fp32(x, cu, ids, ABS)[0]
    floor = _rel(dec, exact)
    record_property("rel_l2", {"decompressed": floor, "absorbed": _rel(absorbed, exact),
                               "absorbed_vs_decompressed": _rel(absorbed, dec),
                               "absorbed_fp32_vs_exact": _rel(absorbed_fp32, exact)})
    assert _rel(absorbed_fp32, exact) < 1e-5  # the same function: FP32 forms agree to FP32 rounding
    assert _rel(absorbed, exact) <= 2 * floor and _rel(absorbed, dec) <= 3 * floor, (floor, _rel(absorbed, exact))


@pytest.mark.slow
def test_six_layer_model_logits_agree_within_bf16_noise(record_property):
    cfg = GLM53Config.tiny(
        num_hidden_layers=6,
        layer_types=("linear_attention", "indexed_attention", "indexed_attention") * 2,
        mlp_layer_types=("dense", "sparse", "sparse") * 2,
        indexer_types=("full", "full", "shared") * 2,
    )
    torch.manual_seed(0)
    model = GLM53Model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (80,))
    cu = torch.tensor([0, 50, 80])
    with torch.no_grad():
        with inductor_ext.precision(REF.replace(kda="fp32")):
            exact = model(ids, cu)  # FP32 weights and activations, decompressed
        bf16 = cast_model(model, torch.bfloat16)
        with inductor_ext.precision(REF):
            dec = bf16(ids, cu)
        with inductor_ext.precision(ABS):
            absorbed = bf16(ids, cu)
    floor = _rel(dec, exact)
    record_property("rel_l2", {"decompressed": floor, "absorbed": _rel(absorbed, exact),
                               "absorbed_vs_decompressed": _rel(absorbed, dec)})
    assert _rel(absorbed, exact) <= 2 * floor, (floor, _rel(absorbed, exact))


def test_decompressed_form_refuses_lengths_past_its_mask_limit():
    T = MAX_MASK_TOKENS + 1
    q = torch.zeros(T, 1, 4)
    ids = torch.zeros(T, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match='mla="absorbed"'):
        sparse_attention(q, q, q, ids, scale=1.0)
