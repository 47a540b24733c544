"""The tiny GLM-5.3 model with ``PrecisionConfig.batch_invariant``: a document's logits and mHC
streams are bitwise the same alone and inside a pack of five documents (the plain path is not:
shown on the same inputs), the model compiles into one graph whose linears are ``glm53::bi_*``,
and its numbers stay within BF16 noise of the plain path."""

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from graphs import GLM53Config, GLM53Model, modules
from inductor_ext import PrecisionConfig
from tests.support.batch_invariant import DEVICES

LENGTHS = (3, 13, 30, 5, 21)  # the first document is the one compared
SEEDS = range(4)
BASES = {"reference_absorbed": PrecisionConfig.reference().replace(mla="absorbed"),
         "serving_aligned": PrecisionConfig.serving_aligned()}


def _alone_and_packed(prec: PrecisionConfig, seed: int, device: str = "cpu"):
    torch.manual_seed(seed)
    model = GLM53Model(GLM53Config.tiny(), precision=prec).to_dtype(torch.bfloat16).eval().to(device)
    docs = [torch.randint(0, 256, (n,)).to(device) for n in LENGTHS]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device=device)
    n = LENGTHS[0]
    with torch.no_grad():
        alone = model(docs[0], torch.tensor([0, n], device=device), output_hidden_states=True)
        packed = model(torch.cat(docs), cu, output_hidden_states=True)
    return [alone[0], *alone[1]], [packed[0][:n], *(h[:n] for h in packed[1])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("base", sorted(BASES))
def test_one_document_alone_equals_its_rows_in_a_pack(base, device):
    for seed in SEEDS:
        alone, packed = _alone_and_packed(BASES[base].replace(batch_invariant=True), seed, device)
        for i, (a, p) in enumerate(zip(alone, packed)):
            assert torch.equal(a, p), f"{base} seed {seed}: {'logits' if i == 0 else f'streams {i}'} differ"


def _unchanged_in_the_pack(prec: PrecisionConfig, device: str = "cpu") -> list[bool]:
    """Per seed: whether the document's logits and streams are bitwise the same alone and packed."""
    return [all(torch.equal(a, p) for a, p in zip(*_alone_and_packed(prec, seed, device))) for seed in SEEDS]


def _row_count_dependent_linear(x, weight, bias=None, *, out_dtype=None):
    """A planted non-invariant linear: one FP32 product for a call of fewer than 8 rows, else a
    split K of 4 pieces whose partial products are stored in x's dtype (a split-K GEMM's choice by
    shape), one rounding to the output."""
    if x.reshape(-1, x.shape[-1]).shape[0] < 8:
        y = torch.nn.functional.linear(x.float(), weight.float())
    else:
        y = sum(torch.nn.functional.linear(xc.float(), wc.float()).to(x.dtype).float()
                for xc, wc in zip(x.chunk(4, -1), weight.chunk(4, -1)))
    y = y if bias is None else y + bias.float()
    return y.to(out_dtype or x.dtype)


def test_the_comparison_catches_a_row_count_dependent_linear(monkeypatch):
    """The comparison above can fail: with a planted linear whose K order depends on the call's
    row count, the document's rows change in the pack (on any CPU)."""
    monkeypatch.setattr(modules.ops, "bi_linear", _row_count_dependent_linear)
    prec = BASES["serving_aligned"].replace(batch_invariant=True)
    same = _unchanged_in_the_pack(prec)
    assert not any(same), same


@pytest.mark.parametrize("device", DEVICES)
def test_the_plain_path_is_not_batch_invariant_on_these_inputs(device):
    """Without batch invariance some seed's rows change in the pack. Whether they do depends on the
    device's GEMM kernels: a CPU whose BLAS happens to keep these small shapes invariant skips."""
    same = _unchanged_in_the_pack(BASES["serving_aligned"], device)
    if device == "cpu" and all(same):
        pytest.skip("this CPU's BLAS keeps these shapes batch invariant (the planted test shows the comparison fails)")
    assert not all(same), "the plain path happened to be invariant: the test above would prove nothing"


def test_within_bf16_noise_of_the_plain_path():
    torch.manual_seed(0)
    model = GLM53Model(GLM53Config.tiny()).to_dtype(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (40,))
    cfg = PrecisionConfig.serving_aligned()
    with torch.no_grad():
        model.precision = cfg
        plain = model(ids).double()
        model.precision = cfg.replace(batch_invariant=True)
        invariant = model(ids).double()
    rel = ((invariant - plain).norm() / plain.norm()).item()
    assert 0 < rel < 1e-2, rel


def test_compiles_into_one_graph_of_batch_invariant_ops():
    torch.manual_seed(0)
    model = GLM53Model(GLM53Config.tiny(), precision=PrecisionConfig.serving_aligned().replace(
        batch_invariant=True)).to_dtype(torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    counter = CompileCounterWithBackend(backend)
    fwd = torch.compile(model, backend=counter, fullgraph=True)
    ids, cu = torch.randint(0, 256, (24,)), torch.tensor([0, 10, 24])
    fwd(ids, cu).float().square().mean().backward()
    fwd(ids, cu)
    assert counter.frame_count == 1
    calls = [node for node in graphs[0].graph.nodes if node.op == "call_function"]
    targets = {str(node.target) for node in calls}
    assert {"glm53.bi_linear", "glm53.bi_grouped_linear", "glm53.bi_rms_norm", "glm53.bi_row_sum"} <= targets
    assert not targets & {"glm53.mhc_pre", "glm53.mhc_post", "glm53.kda_recurrent", "glm53.kpool_project",
                          "glm53.kpool_logits"}
    plain = [node for node in calls if "linear" in str(node.target) and "glm53" not in str(node.target)]
    assert plain == []  # the indexer's projections too
    assert sum(p.grad is not None for p in model.parameters()) >= len(list(model.parameters())) - 16


def test_needs_the_absorbed_form():
    with pytest.raises(ValueError, match="mla='absorbed'"):
        PrecisionConfig(batch_invariant=True)
    with pytest.raises(ValueError, match="must be a bool"):
        PrecisionConfig(mla="absorbed", batch_invariant=1)
