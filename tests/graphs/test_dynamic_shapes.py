"""Any packed length, one compile (``docs/DESIGN.md`` §11): the token count and the document count
are symbolic under ``fullgraph=True``. The whole model under Inductor, forward + backward, serves 12
lengths with 1-6 documents in at most 2 compiles and then 3 more lengths under
``fail_on_recompile``, its logits bitwise the eager model's (``batch_invariant=True``); the layers,
the serving forward, ``mark_dynamic`` and ``dynamic=True`` each give one graph and no break; a
planted specialization (a Python branch on T) breaks the count; the bucket padding keeps the real
tokens' logits bitwise.

The Inductor model is compiled once for the module (two compiles of the whole model take minutes
on 2 cores); the other checks trace with ``aot_eager`` (graph counts and breaks are Dynamo's).
"""

import time

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import inductor_ext
from graphs import GLM53Config, GLM53Model, ServingForward, pad_to_bucket
from graphs.model import DecoderLayer
from graphs.modules import RMSNorm, cast_model
from inductor_ext import PrecisionConfig
from tests.support.batch_invariant import assert_bitwise

LENGTHS = (37, 53, 64, 71, 90, 128, 40, 44, 48, 52, 56, 60)  # 12 lengths, documents 1..6 in turn
MORE = (68, 72, 99)  # then under fail_on_recompile
BI = PrecisionConfig.serving_aligned().replace(batch_invariant=True)


def _batch(T: int, docs: int, seed: int):
    """Random ids ``[T]`` in ``docs`` documents of random lengths (each >= 1)."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted((torch.randperm(T - 1, generator=g)[: docs - 1] + 1).tolist())
    return torch.randint(0, 256, (T,), generator=g), torch.tensor([0, *cuts, T])


def _model(precision=BI):
    torch.manual_seed(0)
    return GLM53Model(GLM53Config.tiny(), precision=precision).to_dtype(torch.bfloat16)


@pytest.fixture(scope="module")
def inductor_run():
    """Per length: (T, documents, compiles so far, seconds of the step, logits, eager logits)."""
    inductor_ext.enable()
    torch._dynamo.reset()
    model = _model()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    rows = []

    def step(i, T):
        ids, cu = _batch(T, 1 + i % 6, seed=i)
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        logits = compiled(ids, cu)
        logits.float().square().mean().backward()
        seconds = time.perf_counter() - start
        with torch.no_grad():
            rows.append((T, cu.numel() - 1, counter.frame_count, seconds, logits.detach(), model(ids, cu)))

    for i, T in enumerate(LENGTHS):
        step(i, T)
    with torch.compiler.set_stance("fail_on_recompile"):
        for i, T in enumerate(MORE, start=len(LENGTHS)):
            step(i, T)
    for T, docs, compiles, seconds, _, _ in rows:
        print(f"T={T} documents={docs}: compiles so far {compiles}, step {seconds:.1f} s")
    return rows


def test_twelve_lengths_at_most_two_compiles_then_none(inductor_run):
    assert {T for T, *_ in inductor_run} == set(LENGTHS) | set(MORE)
    assert {docs for _, docs, *_ in inductor_run} == set(range(1, 7))
    assert inductor_run[len(LENGTHS) - 1][2] <= 2
    assert inductor_run[-1][2] == inductor_run[len(LENGTHS) - 1][2]  # fail_on_recompile held


def test_logits_bitwise_eager_at_every_length(inductor_run):
    for T, docs, _, _, logits, eager in inductor_run:
        assert_bitwise(f"T={T} ({docs} documents)", logits, eager)


def _count(fn, calls, **compile_kwargs) -> tuple[int, int]:
    """(graphs compiled, unique graphs Dynamo counted) of ``fn`` over ``calls`` (arg tuples)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, **compile_kwargs)
    with torch.no_grad():
        for args in calls:
            compiled(*args)
    return counter.frame_count, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _model_calls(lengths=(37, 53, 71, 90, 40, 66)):
    return [_batch(T, 1 + i % 4, seed=i) for i, T in enumerate(lengths)]


def test_a_planted_branch_on_the_length_recompiles(monkeypatch):
    """A Python ``if`` on T inside the forward (here: RMSNorm on odd lengths) specializes the graph:
    the count above fails."""
    inductor_ext.enable()
    forward = RMSNorm.forward

    def planted(self, x, prec=None):
        return forward(self, x * 1.0 if x.shape[0] % 2 else x, prec)

    model = _model()
    assert _count(model, _model_calls())[0] <= 2
    monkeypatch.setattr(RMSNorm, "forward", planted)
    assert _count(model, _model_calls())[0] > 2


@pytest.mark.parametrize("how", ["mark_dynamic", "dynamic=True"])
def test_mark_dynamic_and_dynamic_true_give_one_graph(how):
    inductor_ext.enable()
    model = _model(PrecisionConfig.serving_aligned())
    calls = _model_calls()
    if how == "mark_dynamic":
        for ids, cu in calls:
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(cu, 0)
        _, graphs = _count(model, calls)
    else:
        _, graphs = _count(model, calls, dynamic=True)
    assert graphs == 1


@pytest.mark.parametrize("kind", ["kda", "dsa"])
def test_each_layer_kind_compiles_once_for_every_length(kind):
    inductor_ext.enable()
    cfg = GLM53Config.tiny()
    torch.manual_seed(0)
    layer = cast_model(DecoderLayer(cfg, cfg.first_layer(kind), precision=PrecisionConfig.serving_aligned()),
                       torch.bfloat16)
    calls = []
    for i, T in enumerate((37, 53, 71, 90, 40, 66)):
        _, cu = _batch(T, 1 + i % 4, seed=i)
        calls.append((torch.randn(T, cfg.hc_mult, cfg.hidden_size).to(torch.bfloat16), cu))
    assert _count(layer, calls)[0] <= 2


def test_serving_forward_compiles_once_for_every_length():
    inductor_ext.enable()
    assert _count(ServingForward(_model(PrecisionConfig.serving_aligned())), _model_calls())[0] <= 2


def test_pad_to_bucket_keeps_the_real_tokens_logits_bitwise():
    """One extra document pads 53 tokens to 64; with batch-invariant kernels the 53 real tokens'
    logits are bitwise the unpadded batch's. A length already in its bucket is returned as is."""
    model = _model()
    ids, cu = _batch(53, 3, seed=7)
    padded, pcu, n = pad_to_bucket(ids, cu, 64)
    assert n == 53 and padded.shape == (64,) and pcu.tolist() == [*cu.tolist(), 64]
    with torch.no_grad():
        assert_bitwise("padded to 64", model(padded, pcu)[:n], model(ids, cu))
    same, scu, m = pad_to_bucket(ids[:48], torch.tensor([0, 20, 48]), 16)
    assert m == 48 and same.shape == (48,) and scu.tolist() == [0, 20, 48]
    with pytest.raises(ValueError, match="multiple"):
        pad_to_bucket(ids, cu, 0)
