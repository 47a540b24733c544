"""inductor_ext.backends: the back-end registry. A planted back-end that is unavailable or does not
support a call gives way to the next one, the reason logged once per (op, back-end, reason); the
orders of the registered ops (each ending with the reference) and the choices they make for KDA's
precisions and head dims, KPool and sparse MLA with and without their packages."""

import logging

import pytest
import torch

import inductor_ext.ops  # noqa: F401  (registers every op's back-ends)
from inductor_ext import backends
from tests.support.sparse_mla import H200, meta_inputs


@torch.library.custom_op("glm53_test::planted", mutates_args=(), device_types="cpu")
def _planted(x: torch.Tensor, mode: str, width: int) -> torch.Tensor:
    return x.clone()


def _kernel(tag):
    return lambda x, mode, width: tag


def _narrow(x, width, **_):
    return None if width <= 4 else f"needs width <= 4, got {width}"


@pytest.fixture
def plants(monkeypatch, caplog):
    """Three back-ends: ``missing`` (its package does not import), ``narrow`` (width <= 4 only),
    ``reference``; an empty registry and log-once memory for the test."""
    monkeypatch.setitem(backends.PACKAGES, "glm53_absent", "glm53_no_such_module")
    monkeypatch.setitem(backends._DISTRIBUTIONS, "glm53_absent", "glm53-absent")
    monkeypatch.setattr(backends, "_LOGGED", set())
    monkeypatch.setattr(backends, "REGISTRY", {})
    caplog.set_level(logging.WARNING, logger="inductor_ext")
    return dict(
        missing=backends.Backend("missing", "a kernel whose package is absent", lambda: _kernel("missing"),
                                 packages=("glm53_absent",)),
        narrow=backends.Backend("narrow", "a kernel for narrow rows", lambda: _kernel("narrow"), why_not=_narrow),
        reference=backends.reference(_kernel("reference")),
    )


@pytest.fixture
def planted(plants):
    """``glm53_test::planted`` registered with (missing, narrow, reference)."""
    return backends.register("glm53_test::planted", tuple(plants.values()))


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "inductor_ext"]


def test_unavailable_and_unsupported_give_way_logged_once(planted, caplog):
    x = torch.zeros(2)
    assert planted.params == ("x", "mode", "width")
    assert planted.run(x, "a", 4) == "narrow" and planted.run(x, "b", 4) == "narrow"
    missing = ("glm53_absent does not import (ModuleNotFoundError: No module named 'glm53_no_such_module'); "
               "install it: pip install glm53-absent")
    assert _messages(caplog) == [f"glm53_test::planted: back-end 'missing' (a kernel whose package is absent) "
                                 f"skipped: {missing}; using 'narrow' (a kernel for narrow rows)"]
    caplog.clear()
    for _ in range(2):
        assert planted.run(x, "a", 8) == "reference"
        assert backends.select("glm53_test::planted", x=x, mode="a", width=8).name == "reference"
    assert _messages(caplog) == ["glm53_test::planted: back-end 'narrow' (a kernel for narrow rows) skipped: needs "
                                 "width <= 4, got 8; using 'reference' (the plain-torch reference kernel)"]
    caplog.clear()
    assert planted.run(x, "a", 9) == "reference"  # another reason: said once more
    assert [m.split(" skipped: ")[1] for m in _messages(caplog)] == [
        "needs width <= 4, got 9; using 'reference' (the plain-torch reference kernel)"]


def test_backend_answers(plants):
    missing, narrow, reference = plants.values()
    assert not missing.available() and missing.missing().startswith("glm53_absent does not import")
    assert narrow.available() and reference.available() and reference.unconditional and not narrow.unconditional
    assert narrow.supports(x=None, mode="a", width=3) == (True, "")
    assert narrow.supports(x=None, mode="a", width=5) == (False, "needs width <= 4, got 5")
    assert reference.supports(anything=1) == (True, "")
    assert reference.kernel() is reference.kernel()


def test_the_order_can_depend_on_a_string_argument(plants, caplog):
    narrow, reference = plants["narrow"], plants["reference"]
    entry = backends.register("glm53_test::planted", {"fast": (narrow, reference), "plain": (reference,)}, by="mode")
    x = torch.zeros(1)
    assert entry.run(x, "fast", 2) == "narrow" and entry.run(x, "plain", 2) == "reference"
    assert entry.run(x, mode="plain", width=2) == "reference"
    assert not _messages(caplog)  # the back-ends of another mode are not skipped: not logged


def test_register_refuses_an_order_without_an_unconditional_last(plants):
    narrow, reference = plants["narrow"], plants["reference"]
    with pytest.raises(ValueError, match="must end with an unconditional one"):
        backends.OpBackends("glm53_test::planted", ("x",), (reference, narrow))
    with pytest.raises(ValueError, match="must end with an unconditional one"):
        backends.OpBackends("glm53_test::planted", ("x", "mode"), {"a": ()}, by="mode")
    with pytest.raises(ValueError, match="by='precision' is not an argument"):
        backends.OpBackends("glm53_test::planted", ("x", "mode"), {"a": (reference,)}, by="precision")
    with pytest.raises(ValueError, match="unknown package"):
        backends.Backend("x", "x", lambda: None, packages=("deep_gemm",))


def test_every_registered_op_ends_with_its_reference():
    assert {"glm53::sparse_mla", "glm53::sparse_mla_bwd", "glm53::kda_chunk", "glm53::kda_chunk_bwd",
            "glm53::kpool_logits", "glm53::token_logprobs", "glm53::bi_linear"} <= backends.REGISTRY.keys()
    for name, entry in backends.REGISTRY.items():
        orders = [entry.order()] if entry.by is None else [entry.order(**{entry.by: k}) for k in entry._orders]
        assert all(order[-1].name == "reference" for order in orders), name


@pytest.fixture
def packages(monkeypatch):
    """``absent(*names)``: those packages do not import, every other one does; a fresh log-once memory."""
    monkeypatch.setattr(backends, "_LOGGED", set())

    def absent(*names):
        monkeypatch.setattr(backends, "_import", lambda name: (None, "ImportError: absent") if name in names
                            else (object(), None))

    return absent


def _kda(op_name, precision, K=128, V=128):
    q = torch.empty(1, 64, 2, K, device="meta")
    v = torch.empty(1, 64, 2, V, device="meta")
    return backends.select(op_name, q=q, k=q, v=v, g=q, beta=q[..., 0], scale=0.1, initial_state=None,
                           cu_seqlens=None, precision=precision).name


@pytest.mark.parametrize("op_name", ["glm53::kda_chunk", "glm53::kda_chunk_bwd"])
def test_kda_choices(packages, caplog, op_name):
    caplog.set_level(logging.WARNING, logger="inductor_ext")
    packages()
    assert _kda(op_name, "bf16") == "fla" and _kda(op_name, "bf16", 256, 256) == "fla"
    assert _kda(op_name, "fp32") == "triton" and _kda(op_name, "fp32_causal") == "triton"
    assert not _messages(caplog)
    assert _kda(op_name, "fp32", 192, 128) == "fla" and _kda(op_name, "fp32", 192, 128) == "fla"
    assert _messages(caplog) == [
        f"{op_name}: back-end 'triton' (the own FP32 Triton kernels) skipped: head dims K=192, V=128 exceed 128 "
        "(flash-linear-attention's kernels run the FP32 inputs with TF32 dots, ~1e-3 relative error); using 'fla' "
        "(flash-linear-attention's kernels)"]
    packages("fla")
    assert _kda(op_name, "bf16") == "reference" and _kda(op_name, "fp32") == "triton"
    packages("triton")  # fla's kernels never run where the own kernels' residual layout applies
    assert _kda(op_name, "fp32") == "reference" and _kda(op_name, "fp32", 256, 256) == "fla"


def test_kpool_and_sparse_mla_choices(packages, monkeypatch):
    logits = dict(q=None, w=None, pool=None, pool_scale=None, precision="bf16", layout="compact")
    packages()
    assert backends.select("glm53::kpool_logits", **logits).name == "triton"
    packages("triton")
    assert backends.select("glm53::kpool_logits", **logits).name == "reference"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: H200)
    q, kv, ids = meta_inputs()
    args = dict(q=q, kv=kv, token_ids=ids, scale=0.1, d_v=512, deterministic=True)
    assert backends.select("glm53::sparse_mla", **args).name == "reference"
    packages("tilelang")
    assert backends.select("glm53::sparse_mla", **args).name == "triton"
    packages()
    assert backends.select("glm53::sparse_mla", **args).name == "tilelang"
    assert backends.select("glm53::sparse_mla", **{**args, "q": q.float(), "kv": kv.float()}).name == "triton"
