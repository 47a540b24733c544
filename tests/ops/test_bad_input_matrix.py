"""Bad input to every public op (``inductor_ext.ops.__all__``): a clear error, compiled or not, never a
silent wrong result (``docs/DESIGN.md`` §6).

Each case is (op, what, inputs, expected): a ``ValueError`` whose message names the argument, a
NaN where the input held one, or a correct empty result. Every case runs eagerly; the static ones
(types, shapes, dtypes, python scalars) also run under ``torch.compile(fullgraph=True,
backend="aot_eager")``, where the exception must still be a ``ValueError`` whose message starts
with the op's own (``inductor_ext/ops/_checks.py``: through the fake kernel of
``glm53::input_error``). Every tensor argument of every op is also passed as a Python list once
(the shared non-tensor check). Data checks (finiteness, signs, ids, offsets) are eager only; offsets
that would change an output's length are asserted at run time under compile (the last tests).
"""

import dataclasses
import inspect
from collections.abc import Callable

import pytest
import torch

from inductor_ext import ops

NAN = float("nan")


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=_g(seed)).to(dtype)


# ---------------------------------------------------------------------------------------------
# one valid call per op: {argument name: value}, in signature order
# ---------------------------------------------------------------------------------------------

T, H, K, V = 8, 2, 16, 8  # KDA
N, D = 4, 8  # mHC streams and width
P, HIDDEN, IH = 4, 64, 32  # KPool: pool size, hidden, indexer heads


def _kda(recurrent=False):
    a = {"q": _randn(1, T, H, K), "k": _randn(1, T, H, K, seed=1), "v": _randn(1, T, H, V, seed=2),
         "g": -torch.rand(1, T, H, K, generator=_g(3)), "beta": torch.rand(1, T, H, generator=_g(4))}
    return a if recurrent else {**a, "precision": "fp32"}


def _mhc_pre():
    return {"x": _randn(3, N, D), "fn": _randn((2 + N) * N, N * D, seed=1) * 0.1,
            "base": _randn((2 + N) * N, seed=2), "scale": _randn(3, seed=3)}


def _mhc_post():
    return {"f": _randn(3, D), "residual": _randn(3, N, D, seed=1), "post": torch.rand(3, N, generator=_g(2)),
            "comb": torch.rand(3, N, N, generator=_g(3)), "precision": "fp32"}


def _layout():
    return ops.kpool_layout(torch.tensor([0, 16]), 16, P)


def _kpool_project():
    bf = torch.bfloat16
    return {"x": _randn(T, HIDDEN, dtype=bf), "wk": _randn(128, HIDDEN, dtype=bf, seed=1),
            "k_norm_weight": torch.ones(128), "k_norm_bias": torch.zeros(128),
            "weights_proj": _randn(IH, HIDDEN, dtype=bf, seed=2), "compress_gate": _randn(128, HIDDEN, dtype=bf, seed=3)}


def _kpool_indexer():
    bf = torch.bfloat16
    p = _kpool_project()
    return {"x": _randn(16, HIDDEN, dtype=bf), "q_resid": _randn(16, 32, dtype=bf, seed=5),
            "wq_b": _randn(IH * 128, 32, dtype=bf, seed=6) * 0.2, "wk": p["wk"], "k_norm_weight": p["k_norm_weight"],
            "k_norm_bias": p["k_norm_bias"], "weights_proj": p["weights_proj"], "compress_gate": p["compress_gate"],
            "compress_ape": _randn(P, 128, seed=7), "topk": 8}


def _kpool_select():
    _, q_lo, q_n, tail_start, tail_len = _layout()
    return {"logits": _randn(16, 4), "q_lo": q_lo, "q_n": q_n, "tail_start": tail_start, "tail_len": tail_len,
            "topk": 8, "pool_size": P, "num_tokens": 16}


def _sparse_mla():
    return {"q": _randn(4, 2, 16), "kv": _randn(6, 16, seed=1),
            "token_ids": torch.tensor([[0, 1, 2], [3, -1, 5], [-1, -1, -1], [5, 4, 0]]), "scale": 0.25,
            "return_lse": True}


VALID: dict[str, Callable[[], dict]] = {
    "kda_chunk": _kda,
    "kda_recurrent": lambda: _kda(recurrent=True),
    "fp32_linear": lambda: {"x": _randn(3, 8), "weight": _randn(5, 8, seed=1), "bias": _randn(5, seed=2)},
    "layer_norm_fp32": lambda: {"x": _randn(3, 8)},
    "swiglu": lambda: {"gate": _randn(3, 8), "up": _randn(3, 8, seed=1), "mode": "native"},
    "fp8_qdq": lambda: {"x": _randn(2, 128)},
    "mhc_pre": _mhc_pre,
    "mhc_post": _mhc_post,
    "mhc_pre_batch_invariant": _mhc_pre,
    "mhc_post_batch_invariant": _mhc_post,
    "kpool_project": _kpool_project,
    "kpool_layout": lambda: {"cu_seqlens": torch.tensor([0, 6, 16]), "num_tokens": 16, "pool_size": P},
    "kpool_compress": lambda: {"k": _randn(16, 128, dtype=torch.bfloat16), "gate": _randn(16, 128, dtype=torch.bfloat16),
                               "ape": _randn(P, 128), "pool_token": _layout()[0], "mode": "bf16_fp32"},
    "kpool_quant_query": lambda: {"q": _randn(T, IH, 128, dtype=torch.bfloat16), "w": _randn(T, IH)},
    "kpool_logits": lambda: {"q": _randn(T, IH, 128, dtype=torch.bfloat16), "w": _randn(T, IH),
                             "pool": _randn(4, 128, dtype=torch.bfloat16), "pool_scale": torch.ones(4),
                             "precision": "bf16"},
    "kpool_select": _kpool_select,
    "kpool_indexer": _kpool_indexer,
    "sparse_mla": _sparse_mla,
    "bi_linear": lambda: {"x": _randn(3, 8), "weight": _randn(5, 8, seed=1)},
    "bi_grouped_linear": lambda: {"x": _randn(6, 8), "weight": _randn(2, 4, 8, seed=1),
                                  "offs": torch.tensor([3, 6], dtype=torch.int32)},
    "bi_rms_norm": lambda: {"x": _randn(3, 8), "weight": torch.ones(8)},
    "bi_layer_norm": lambda: {"x": _randn(3, 8)},
    "bi_log_softmax": lambda: {"x": _randn(3, 8)},
    "bi_row_sum": lambda: {"x": _randn(3, 8)},
    "bi_mhc_coefficients": lambda: {"proj": _randn(3, (2 + N) * N), "base": _randn((2 + N) * N, seed=1),
                                    "scale": _randn(3, seed=2)},
    "token_logprobs": lambda: {"hidden": _randn(4, 8), "weight": _randn(10, 8, seed=1),
                               "targets": torch.tensor([0, 9, -100, 3])},
}


# ---------------------------------------------------------------------------------------------
# the cases
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    what: str
    change: Callable[[dict], dict]  # valid arguments -> the bad ones
    error: str | None = None  # a fragment of the ValueError, naming the argument
    check: Callable | None = None  # else: a check of the result
    static: bool = False  # a static rule: also raised under torch.compile(fullgraph=True)

    @property
    def id(self) -> str:
        return f"{self.op}-{self.what}"


def _set(**over):
    return lambda a: {**a, **over}


def _with(fn):
    """A change that edits a copy of the arguments in place (``fn(a)``)."""
    def change(a):
        a = dict(a)
        fn(a)
        return a
    return change


def _nan_at(*rows_heads):
    """out and lse NaN exactly at the (row, head) pairs given (every column), not NaN elsewhere."""
    def check(result):
        out, lse = result
        want = torch.zeros(lse.shape, dtype=torch.bool)
        for t, h in rows_heads:
            want[t, h] = True
        assert out[want].isnan().all() and lse[want].isnan().all(), "NaN must propagate (not a zero row)"
        assert not out[~want].isnan().any() and not lse[~want].isnan().any()
    return check


def _empty(*shapes):
    def check(result):
        result = result if isinstance(result, tuple) else (result,)
        assert [tuple(t.shape) for t in result] == [tuple(s) for s in shapes]
    return check


def _padding_row_zero(result):
    out, lse = result
    assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()


def _nan_in(name, index):
    return _with(lambda a: a[name].__setitem__(index, NAN))


def _non_tensor_cases() -> list[Case]:
    """Every tensor argument of every op, once passed as a Python list: ``ValueError`` naming it;
    the first of each op also under compile."""
    cases = []
    for op, build in VALID.items():
        first = True
        for name, value in build().items():
            if isinstance(value, torch.Tensor):
                cases.append(Case(op, f"{name} as a list", _set(**{name: value.tolist()}),
                                  error=f"{name} must be a tensor, got list", static=first))
                first = False
    return cases


SPECIFIC = [
    # 1. sparse_mla: NaN propagates (never a zero row), a finite positive scale, T = 0, ids
    Case("sparse_mla", "NaN query row gives NaN", _nan_in("q", (1, 0, 3)), check=_nan_at((1, 0))),
    Case("sparse_mla", "NaN in a listed kv row gives NaN", _nan_in("kv", (4, 2)), check=_nan_at((3, 0), (3, 1))),
    Case("sparse_mla", "NaN in kv row 0 reaches only the rows listing it", _nan_in("kv", (0, 7)),
         check=_nan_at((0, 0), (0, 1), (3, 0), (3, 1))),
    Case("sparse_mla", "row without ids stays 0", lambda a: a, check=_padding_row_zero),
    Case("sparse_mla", "scale 1e36", _set(scale=1e36), error="scale must be a finite number > 0", static=True),
    Case("sparse_mla", "scale 0", _set(scale=0.0), error="scale must be a finite number > 0", static=True),
    Case("sparse_mla", "scale -1", _set(scale=-1.0), error="scale must be a finite number > 0", static=True),
    Case("sparse_mla", "scale nan", _set(scale=NAN), error="scale must be a finite number > 0", static=True),
    Case("sparse_mla", "T = 0 gives empty out and lse",
         _set(q=torch.zeros(0, 2, 16), token_ids=torch.zeros(0, 3, dtype=torch.int64)), check=_empty((0, 2, 16), (0, 2))),
    Case("sparse_mla", "id beyond S", _with(lambda a: a["token_ids"].__setitem__((0, 0), 6)),
         error=r"token_ids must be -1 or in \[0, S=6\)"),
    Case("sparse_mla", "kv dtype", _set(kv=_randn(6, 16).double()), error="kv must have q's dtype", static=True),
    # 2. kda_chunk: cu_seqlens must end at T (eager; compiled: test_compiled_cu_seqlens_*)
    Case("kda_chunk", "cu_seqlens ends before T", _set(cu_seqlens=torch.tensor([0, 4, 6])),
         error="cu_seqlens must be non-decreasing from 0 to"),
    Case("kda_chunk", "cu_seqlens of one offset", _set(cu_seqlens=torch.tensor([0])),
         error="cu_seqlens must be a 1-D int64 tensor of N\\+1 >= 2", static=True),
    Case("kda_chunk", "cu_seqlens as a list", _set(cu_seqlens=[0, 8]), error="cu_seqlens must be a tensor, got list",
         static=True),
    Case("kda_chunk", "initial_state as a list", _set(initial_state=[[0.0]]), error="initial_state must be a tensor"),
    # 4. KDA: g <= 0, finite positive scale, beta in [0, 1]
    Case("kda_chunk", "positive log-decay g = +30", _set(g=torch.full((1, T, H, K), 30.0)),
         error=r"g \(log-decay\) must be <= 0"),
    Case("kda_recurrent", "positive log-decay g = +30", _set(g=torch.full((1, T, H, K), 30.0)),
         error=r"g \(log-decay\) must be <= 0"),
    Case("kda_chunk", "g nan", _nan_in("g", (0, 3, 1, 2)), error=r"g \(log-decay\) must be finite"),
    Case("kda_chunk", "scale nan", _set(scale=NAN), error="scale must be a finite number > 0", static=True),
    Case("kda_recurrent", "scale nan", _set(scale=NAN), error="scale must be a finite number > 0", static=True),
    Case("kda_chunk", "scale 0", _set(scale=0.0), error="scale must be a finite number > 0", static=True),
    Case("kda_chunk", "beta 1.5", _set(beta=torch.full((1, T, H), 1.5)), error=r"beta must lie in \[0, 1\]"),
    Case("kda_recurrent", "beta -0.5", _set(beta=torch.full((1, T, H), -0.5)), error=r"beta must lie in \[0, 1\]"),
    Case("kda_chunk", "beta nan", _nan_in("beta", (0, 1, 0)), error=r"beta must lie in \[0, 1\]"),
    Case("kda_chunk", "precision", _set(precision="fp16"), error="kda precision must be one of", static=True),
    # 5. T = 0, offsets, ids, scalars, geometry
    Case("mhc_pre", "T = 0 gives empty outputs", _set(x=torch.zeros(0, N, D)), check=_empty((0, D), (0, N), (0, N, N))),
    Case("mhc_pre_batch_invariant", "T = 0 gives empty outputs", _set(x=torch.zeros(0, N, D)),
         check=_empty((0, D), (0, N), (0, N, N))),
    Case("mhc_post", "T = 0 gives an empty output",
         _set(f=torch.zeros(0, D), residual=torch.zeros(0, N, D), post=torch.zeros(0, N), comb=torch.zeros(0, N, N)),
         check=_empty((0, N, D))),
    Case("mhc_pre", "norm_eps None", _set(norm_eps=None), error="norm_eps must be a finite number > 0", static=True),
    Case("mhc_pre", "sinkhorn_iters 0", _set(sinkhorn_iters=0), error="sinkhorn_iters must be an int >= 1", static=True),
    Case("mhc_post", "comb shape", _set(comb=torch.rand(3, N, N + 1)), error="comb must be", static=True),
    Case("mhc_post_batch_invariant", "precision", _set(precision="fp16"), error="precision must be one of",
         static=True),
    Case("bi_mhc_coefficients", "hc_eps None", _set(hc_eps=None), error="hc_eps must be a finite number >= 0",
         static=True),
    Case("layer_norm_fp32", "eps None", _set(eps=None), error="eps must be a finite number > 0", static=True),
    Case("layer_norm_fp32", "eps nan", _set(eps=NAN), error="eps must be a finite number > 0", static=True),
    Case("layer_norm_fp32", "weight shape", _set(weight=torch.ones(7)), error=r"weight must be \[D=8\]", static=True),
    Case("swiglu", "limit inf", _set(limit=float("inf")), error="limit must be a finite number > 0", static=True),
    Case("fp8_qdq", "last dim 100", _set(x=_randn(2, 100)), error="divisible by the group size 128", static=True),
    Case("fp32_linear", "bias shape", _set(bias=torch.zeros(4)), error=r"bias must be \[out_features=5\]", static=True),
    Case("bi_linear", "K mismatch", _set(weight=_randn(5, 7)), error=r"weight must be \[N >= 1, K=8\]", static=True),
    Case("bi_rms_norm", "eps inf", _set(eps=float("inf")), error="eps must be a finite number > 0", static=True),
    Case("bi_layer_norm", "eps 0", _set(eps=0.0), error="eps must be a finite number > 0", static=True),
    Case("bi_log_softmax", "int dtype", _set(x=torch.ones(3, 8, dtype=torch.int64)), error="x must be bfloat16",
         static=True),
    Case("bi_row_sum", "scalar x", _set(x=torch.tensor(1.0)), error=r"x must be \[\.\.\., D\]", static=True),
    Case("bi_grouped_linear", "offs decreasing", _set(offs=torch.tensor([5, 3], dtype=torch.int32)),
         error="offs must be non-decreasing"),
    Case("token_logprobs", "temperature 0", _set(temperature=0.0), error="temperature must be a finite", static=True),
    Case("token_logprobs", "target beyond V", _set(targets=torch.tensor([0, 10, 1, 2])), error=r"targets must be in \[0, V=10\)"),
    Case("kpool_layout", "pool_size 0", _set(pool_size=0), error="pool_size must be a positive int, got 0", static=True),
    Case("kpool_layout", "cu_seqlens ends before T", _set(cu_seqlens=torch.tensor([0, 6, 12])),
         error="cu_seqlens must be non-decreasing from 0 to"),
    Case("kpool_select", "tail_start past T", _with(lambda a: a["tail_start"].__setitem__(-1, 40)),
         error=r"tail_start \+ tail_len <= num_tokens=16"),
    Case("kpool_select", "tail_len >= P", _with(lambda a: a["tail_len"].__setitem__(2, P)), error="0 <= tail_len < P=4"),
    Case("kpool_select", "tail", _set(tail="middle"), error="tail must be one of", static=True),
    Case("kpool_compress", "pool token past T - P", _with(lambda a: a["pool_token"].__setitem__(3, 14)),
         error=r"pool_token must be -1 or in \[0, T-P=12\]"),
    Case("kpool_compress", "mode", _set(mode="fp16"), error="mode must be one of", static=True),
    Case("kpool_logits", "16 heads", _set(q=_randn(T, 16, 128, dtype=torch.bfloat16), w=_randn(T, 16)),
         error=r"heads must be one of .* \(H = q.shape\[1\]\)", static=True),
    Case("kpool_quant_query", "q dtype", _set(q=_randn(T, IH, 128)), error="q must have dtype", static=True),
    Case("kpool_project", "eps None", _set(eps=None), error="eps must be a finite number > 0", static=True),
    Case("kpool_indexer", "topk not a multiple of P", _set(topk=6), error="topk .6. must be divisible by pool_size",
         static=True),
    Case("kpool_indexer", "16 heads", _set(weights_proj=_randn(16, HIDDEN, dtype=torch.bfloat16)),
         error=r"heads must be one of .* \(H = weights_proj.shape\[0\]\)", static=True),
]

CASES = _non_tensor_cases() + SPECIFIC
STATIC = [c for c in CASES if c.static]


def _call(case: Case):
    fn = getattr(ops, case.op)
    return fn(**case.change(VALID[case.op]()))


def test_every_public_op_has_cases():
    assert set(VALID) == set(ops.__all__)
    assert {c.op for c in STATIC} == set(ops.__all__)


@pytest.mark.parametrize("op", sorted(VALID))
def test_valid_inputs_run(op):
    """The valid call each case starts from runs (so an error is the change's, not the base's)."""
    getattr(ops, op)(**VALID[op]())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_eager(case):
    if case.error is not None:
        with pytest.raises(ValueError, match=case.error) as info:
            _call(case)
        assert str(info.value).startswith(("kda", case.op, "kpool")), str(info.value)
    else:
        case.check(_call(case))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(fn, args: dict):
    """``fn(**args)`` compiled fullgraph with aot_eager: tensors are the graph's inputs, everything
    else (lists included) a constant of the traced code."""
    names = [n for n, v in args.items() if isinstance(v, torch.Tensor)]
    consts = {n: v for n, v in args.items() if n not in names}

    def run(*tensors):
        return fn(**consts, **dict(zip(names, tensors)))

    return lambda: torch.compile(run, fullgraph=True, backend="aot_eager")(*(args[n] for n in names))


@pytest.mark.parametrize("case", STATIC, ids=lambda c: c.id)
def test_compiled_static_check_raises_the_ops_value_error(case, fresh_dynamo):
    run = _compiled(getattr(ops, case.op), case.change(VALID[case.op]()))
    with pytest.raises(ValueError, match=case.error) as info:
        run()
    first = str(info.value).splitlines()[0]
    assert first.startswith(("kda", case.op, "kpool")), f"not the op's own message: {first}"


# ---------------------------------------------------------------------------------------------
# compiled offsets: a runtime assertion, never an output of another length (defect 2)
# ---------------------------------------------------------------------------------------------


def test_compiled_kda_chunk_refuses_cu_seqlens_that_end_before_t(fresh_dynamo):
    a = _kda()
    run = torch.compile(lambda q, k, v, g, beta, cu: ops.kda_chunk(q, k, v, g, beta, cu_seqlens=cu, precision="fp32"),
                        fullgraph=True, backend="aot_eager")
    args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
    o, _ = run(*args, torch.tensor([0, 4, T]))
    assert o.shape == (1, T, H, V)
    with pytest.raises(RuntimeError, match="cu_seqlens must be non-decreasing from 0 to"):
        run(*args, torch.tensor([0, 4, 6]))


def test_compiled_kpool_layout_refuses_cu_seqlens_that_end_before_t(fresh_dynamo):
    run = torch.compile(lambda cu: ops.kpool_layout(cu, 16, P), fullgraph=True, backend="aot_eager")
    assert run(torch.tensor([0, 6, 16]))[1].shape == (16,)
    with pytest.raises(RuntimeError, match="cu_seqlens must be non-decreasing from 0 to"):
        run(torch.tensor([0, 6, 12]))


def test_kda_reference_kernel_refuses_offsets_that_miss_t():
    """The CPU kernel itself (what a compiled CPU graph runs), past the wrapper: never a shorter o."""
    a = _kda()
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing from 0 to"):
        torch.ops.glm53.kda_chunk(a["q"], a["k"], a["v"], a["g"], a["beta"], 0.25, None, torch.tensor([0, 4, 6]),
                                  "fp32", False)


# ---------------------------------------------------------------------------------------------
# the model (graphs): out-of-vocabulary ids, a checkpoint of another architecture (defect 5)
# ---------------------------------------------------------------------------------------------


def test_model_refuses_out_of_vocabulary_ids():
    from graphs import GLM53Config, GLM53Model
    from inductor_ext import PrecisionConfig

    cfg = GLM53Config.tiny()
    model = GLM53Model(cfg, precision=PrecisionConfig.reference())
    for bad in (cfg.vocab_size, -1):
        ids = torch.tensor([1, 2, bad, 3])
        with pytest.raises(ValueError, match=rf"input_ids must be in \[0, vocab_size={cfg.vocab_size}\)"):
            model(ids)
        with pytest.raises(ValueError, match="input_ids must be in"):
            model.token_logprobs(ids, ids.clamp(0, 1))


def test_from_hf_names_another_architecture():
    from transformers import LlamaConfig, LlamaForCausalLM

    from graphs import GLM53Config, GLM53Model

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=32)
    with pytest.raises(ValueError, match="model_type 'llama'.*LlamaConfig") as info:
        GLM53Config.from_hf(cfg)
    assert "glm5_next" in str(info.value)
    with pytest.raises(ValueError, match="expects a transformers glm5_next config"):
        GLM53Model.from_hf(LlamaForCausalLM(cfg))


def _signature_names(op):
    return list(inspect.signature(getattr(ops, op)).parameters)


def test_valid_arguments_are_the_signatures():
    """Each valid call names real parameters (a typo would make every case of the op vacuous)."""
    for op, build in VALID.items():
        assert set(build()) <= set(_signature_names(op)), op
