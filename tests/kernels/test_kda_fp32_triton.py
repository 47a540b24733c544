"""The FP32-accurate KDA kernels in Triton (``inductor_ext.kernels.kda_fp32``: ``forward``, and
``backward``) against the independent FP64 token recurrence of
``tests/support/fp64.py`` and its FP64 VJP.

CPU: Triton's interpreter (``TRITON_INTERPRET=1 python -m pytest tests/kernels/test_kda_fp32_triton.py``),
small geometries, each run twice: with the interpreter's own FP32 matmul for every ``tl.dot``, and
with every dot's operands truncated to TF32 the way a tensor core reads FP32 registers. The
kernels' ``dot3`` splits each operand into a TF32 high part and the remainder and runs three such
dots (the low·low one dropped); a dot not split that way fails the bound (one state dot at plain
``tf32``: 4e-5). BF16 stores are rounded to nearest even as on the GPU. CUDA (``python -m pytest
-m cuda tests/kernels/test_kda_fp32_triton.py``, not under the interpreter): the H200 geometry H = 64,
K = V = 128.
"""

import inspect
import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from inductor_ext.kernels.kda_fp32 import chunk, chunk_list, forward, gluon_state  # noqa: E402
from inductor_ext.kernels.kda_fp32 import solve as kda_solve  # noqa: E402
from inductor_ext.kernels.kda_fp32.backward import kda_fp32_bwd  # noqa: E402
from inductor_ext.kernels.kda_fp32.forward import kda_fp32_fwd  # noqa: E402
from tests.support.batch_invariant import interpreter_numerics  # noqa: E402
from tests.support.fp64 import TOL, Case, assert_rel_l2, make_inputs, recurrence_fp64, rel_l2, round_bf16, vjp_fp64  # noqa: E402
from tests.support.triton_interpreter import apply_interpreter_shims  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRET:
    apply_interpreter_shims()  # the state pass loops over range(a loaded chunk count)
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (Triton's CPU interpreter)")
ARGS = ("q", "k", "v", "g", "beta")

CASES = [
    Case("packed-37-28-initial-state", (37, 28), heads=2, k_dim=32, v_dim=32, initial_state=True),
    Case("T129-chunk-boundary", (129,), heads=2, k_dim=64, v_dim=64),
    # a document of exactly one chunk, an empty one, V not a power of two
    Case("packed-64-0-45-initial-state", (64, 0, 45), heads=2, k_dim=32, v_dim=24, initial_state=True),
    # the H200 head dims (state held as two 64-row tiles, four 32-column K steps) and an odd K
    Case("T70-K128", (70,), heads=2, k_dim=128, v_dim=128),
    Case("packed-50-40-K96-initial-state", (50, 40), heads=2, k_dim=96, v_dim=48, initial_state=True),
]
ids = [c.name for c in CASES]


# ---------------------------------------------------------------------------------------------
# TF32 tensor-core dots emulated in the interpreter
# ---------------------------------------------------------------------------------------------


def _tf32_trunc(x: np.ndarray) -> np.ndarray:
    """What a TF32 tensor-core input keeps of an FP32 register: the top 19 bits."""
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.fixture(params=["fp32", "tf32"])
def dots(request, monkeypatch):
    """``fp32``: the interpreter's FP32 matmul for every dot; ``tf32``: every ``input_precision="tf32"``
    dot reads its operands truncated to TF32 (FP32 accumulation), as the tensor cores do."""
    if request.param == "tf32":
        from triton.runtime import interpreter
        from triton.runtime.interpreter import TensorHandle

        original = interpreter.InterpreterBuilder.create_dot
        seen = set()

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            name = getattr(input_precision, "name", str(input_precision)).lower()
            seen.add(name)
            if a.data.dtype != np.float32 or b.data.dtype != np.float32 or name == "ieee":
                return original(self, a, b, d, input_precision, max_num_imprecise_acc)
            if name != "tf32":
                raise AssertionError(f"unexpected dot precision {name}")
            out = d.data.astype(np.float32) + np.matmul(_tf32_trunc(a.data), _tf32_trunc(b.data))
            return TensorHandle(out.astype(np.float32), d.dtype.scalar)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
        yield request.param
        assert seen <= {"tf32", "ieee"}, f"a dot ran at precision(s) {sorted(seen - {'tf32', 'ieee'})}"
    else:
        yield request.param


@pytest.fixture
def rne_bf16(monkeypatch):
    """The interpreter casts FP32 to BF16 by truncation; compiled Triton rounds to nearest even
    (``cvt.rn.bf16.f32``). Emulate the hardware so BF16 outputs are judged as they will be stored."""
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.interpreter import TensorHandle

    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return original(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


def _run(inputs, **kw):
    scale = inputs["q"].shape[-1] ** -0.5
    return kda_fp32_fwd(*(inputs[n] for n in ARGS), scale, inputs["initial_state"], inputs["cu_seqlens"], **kw)


def _reference(inputs):
    scale = inputs["q"].shape[-1] ** -0.5
    return recurrence_fp64(*(inputs[n] for n in ARGS), scale, inputs["initial_state"], inputs["cu_seqlens"])


# the interpreter's backward reaches 1.1e-6 (dg) at worst against the FP64 VJP; the stated bound
# on the H200 is TOL["fp32"]["grad"] = 1e-4. 1e-5 here keeps a tenth of a TF32 ulp of headroom
# and fails a single plain-TF32 dot.
GRAD_TOL_INTERPRETER = 1e-5
GRADS = ("q", "k", "v", "g", "beta", "initial_state")


def _cotangents(inputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    N, H, K, V = (inputs["initial_state"].shape if inputs["initial_state"] is not None else
                  (1 if inputs["cu_seqlens"] is None else inputs["cu_seqlens"].numel() - 1,
                   *inputs["q"].shape[2:], inputs["v"].shape[-1]))
    do = torch.randn(inputs["v"].shape, generator=gen).to(inputs["v"].device)
    return do, torch.randn(N, H, K, V, generator=gen).to(inputs["v"].device)


def _run_bwd(inputs, do, dht, **kw):
    scale = inputs["q"].shape[-1] ** -0.5
    return kda_fp32_bwd(*(inputs[n] for n in ARGS), scale, inputs["initial_state"], inputs["cu_seqlens"],
                        do, dht, **kw)


def _check_grads(label, inputs, tol, **kw):
    """Every gradient of the Triton backward against the FP64 VJP (FP32 inputs); dh0 only with an
    initial state. Returns the errors."""
    do, dht = _cotangents(inputs)
    grads = dict(zip(GRADS, _run_bwd(inputs, do, dht, **kw)))
    ref = vjp_fp64(inputs, inputs["q"].shape[-1] ** -0.5, do, dht)
    errs = {n: assert_rel_l2(f"d{n}", grads[n], ref[n], tol) for n in ref}
    print(f"\n[{label}] " + " ".join(f"d{n}={e:.2e}" for n, e in errs.items()))
    return errs


def _check_fp32(label, o, s, o_ref, s_ref):
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    errs = (assert_rel_l2("o", o, o_ref, TOL["fp32"]["o"]),
            assert_rel_l2("final_state", s, s_ref, TOL["fp32"]["state"]))
    print(f"\n[{label}] o={errs[0]:.2e} state={errs[1]:.2e}")


# ---------------------------------------------------------------------------------------------
# interpreter tests
# ---------------------------------------------------------------------------------------------


VARIANTS = {"fused": {}, "split-output": dict(split_output=True)}


@needs_interpreter
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_fp32_inputs_match_fp64_recurrence(case, variant, dots):
    inputs = make_inputs(case, torch.float32)
    o, s = _run(inputs, **VARIANTS[variant])
    _check_fp32(f"{dots} {case.name} {variant}", o, s, *_reference(inputs))


def _chunk_list_reference(cu, n_slots):
    """(document, chunk) per slot and each document's first slot, by plain torch ops."""
    nch = (cu[1:] - cu[:-1] + 63).div(64, rounding_mode="floor")
    first = torch.cumsum(nch, 0) - nch
    rows = [(d, t) for d in range(len(nch)) for t in range(int(nch[d]))]
    rows += [(-1, 0)] * (n_slots - len(rows))
    return torch.tensor(rows, dtype=torch.int32).reshape(n_slots, 2), first.to(torch.int32)


@needs_interpreter
@pytest.mark.parametrize("lengths", [[100], [64, 0, 45], [0, 0], [0, 1, 63, 64, 65, 0], [5000, 0, 1, 3999, 0],
                                     [70 * (i % 3) for i in range(1500)]])
@pytest.mark.parametrize("spare", [0, 7])
def test_chunk_list_kernel_matches_torch(lengths, spare):
    """The chunk kernel's slot list (one Triton kernel): empty documents, documents of one token, an
    exact chunk, 1500 documents (two blocks of the prefix sum), unused trailing slots."""
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    n_slots = sum((n + 63) // 64 for n in lengths) + spare
    chunk_map, first = chunk_list.chunk_list(cu, n_slots)
    ref_map, ref_first = _chunk_list_reference(cu, n_slots)
    assert torch.equal(chunk_map, ref_map) and torch.equal(first, ref_first)


@needs_interpreter
@pytest.mark.parametrize("variant, solves", [("fused", 0), ("split-output", 1)])
def test_only_the_split_forward_runs_the_solve_kernel(variant, solves, monkeypatch):
    """The forward's state pass solves v_new = A⁻¹(βv − R·h) itself: no solve kernel (w, u) unless the
    state pass is split (the backward's form, which reads w and u)."""
    launches = []
    solve = kda_solve.solve_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return solve[grid]

    monkeypatch.setattr(kda_solve, "solve_kernel", Counted())
    inputs = make_inputs(CASES[0], torch.float32)
    _check_fp32(f"solve launches {variant}", *_run(inputs, **VARIANTS[variant]), *_reference(inputs))
    assert len(launches) == solves


@needs_interpreter
def test_state_pass_rejects_a_chunk_pass_of_the_other_form():
    inputs = make_inputs(CASES[0], torch.float32)
    cp = forward.chunk_pass(*(inputs[n] for n in ARGS), 0.1, inputs["cu_seqlens"], block_k=32, block_v=64,
                            warps=4, chunk_maxnreg=None, solve=False)
    final = torch.empty(cp.N, cp.H, cp.K, cp.V)
    with pytest.raises(ValueError, match="split_output needs a solved ChunkPass"):
        forward.state_pass(cp, None, None, final, warps=4, split_output=True)


@needs_interpreter
def test_unpacked_batch_restarts_state_per_sequence(dots):
    """B = 2 without cu_seqlens is the same computation as the two sequences packed."""
    packed = make_inputs(Case("2x70", (70, 70), heads=2, k_dim=32, v_dim=32, initial_state=True), torch.float32)
    batched = {n: packed[n].reshape(2, 70, *packed[n].shape[2:]) for n in ARGS}
    batched.update(initial_state=packed["initial_state"], cu_seqlens=None)
    o, s = _run(batched)
    o_ref, s_ref = _reference(packed)
    _check_fp32(f"{dots} unpacked B=2", o.reshape(o_ref.shape), s, o_ref, s_ref)


@needs_interpreter
@pytest.mark.parametrize("path", ["guarded", "exact-everywhere", "causal", "causal-exact-diagonal"])
def test_steep_gates_take_the_exact_path(path, monkeypatch, dots):
    """Gates of -30 per token in a quarter of the keys put e^{±240} into a 16-token block: those
    blocks must take the exact elementwise path; forcing it everywhere must give the same answer.
    The row-causal path (``causal``) likewise, with its own per-column check, and with every
    diagonal-block column forced onto the exact path."""
    inputs = make_inputs(Case("steep", (100,), heads=2, k_dim=32, v_dim=32, initial_state=True), torch.float32)
    inputs["g"][..., ::4] = -30.0
    inputs["g"][:, 32:80, 1, :] = -0.01  # head 1: rows 32-79 stay on the fast path
    if path.endswith("exact-everywhere") or path.endswith("exact-diagonal"):
        monkeypatch.setattr(chunk, "SPAN", -1.0)
    causal = path.startswith("causal")
    o, s = _run(inputs, causal=causal, **(forward.CAUSAL_LAUNCH if causal else {}))
    _check_fp32(f"{dots} steep gates {path}", o, s, *_reference(inputs))


def _three_gate_regimes():
    """Head 0: gentle gates (every K-slice factored over the whole chunk); head 1: -2 per token (a
    whole-chunk factor would reach e^64, so the slices go by 16-column blocks, whose factors stay
    within e^16); head 2: -30 per token in a quarter of the keys (exact path in those blocks)."""
    inputs = make_inputs(Case("regimes", (100,), heads=3, k_dim=32, v_dim=32, initial_state=True), torch.float32)
    inputs["g"][:, :, 0] *= 0.1
    inputs["g"][:, :, 1] = -2.0
    inputs["g"][:, :, 2, ::4] = -30.0
    return inputs


@needs_interpreter
def test_every_decay_path_matches_fp64(dots):
    inputs = _three_gate_regimes()
    o, s = _run(inputs)
    _check_fp32(f"{dots} three gate regimes", o, s, *_reference(inputs))


@needs_interpreter
def test_bwd_every_decay_path_matches_fp64_vjp(dots):
    _check_grads(f"{dots} bwd three gate regimes", _three_gate_regimes(), GRAD_TOL_INTERPRETER)


@needs_interpreter
@pytest.mark.parametrize("case", CASES[:2], ids=ids[:2])
def test_bf16_inputs_against_rounded_fp64(case, dots, rne_bf16):
    inputs = make_inputs(case, torch.bfloat16)
    o, s = _run(inputs)
    o_ref, _ = _reference(inputs)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    err = assert_rel_l2("o", o, round_bf16(o_ref), TOL["bf16_io"]["fp32"])
    print(f"\n[{dots} bf16 io {case.name}] o={err:.2e}")


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_bwd_fp32_inputs_match_fp64_vjp(case, dots):
    _check_grads(f"{dots} bwd {case.name}", make_inputs(case, torch.float32), GRAD_TOL_INTERPRETER)


@needs_interpreter
def test_bwd_with_the_forwards_a_is_bitwise_the_recomputing_one():
    """``kda_fp32_fwd(..., keep_a=True)`` hands Aqk, A⁻¹ and the k̂–k̂ products to the backward, whose
    chunk kernel then skips recomputing them: same bits as the backward that recomputes."""
    inputs = make_inputs(CASES[0], torch.float32)
    o, s, aqk, ai = _run(inputs, keep_a=True)
    o_plain, s_plain = _run(inputs)
    assert torch.equal(o, o_plain) and torch.equal(s, s_plain)
    do, dht = _cotangents(inputs)
    for a, b in zip(_run_bwd(inputs, do, dht, given_a=(aqk, ai)), _run_bwd(inputs, do, dht)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="given"):
        _run_bwd(inputs, do, dht, given_a=(aqk[:1], ai))


@needs_interpreter
@pytest.mark.parametrize("residuals", [True, False])
def test_op_glue_outputs_match_the_fake_and_alias_nothing(residuals):
    """The CUDA kernel of glm53::kda_chunk / kda_chunk_bwd under "fp32" (run here on CPU tensors):
    outputs of the fake's shapes and dtypes, no two outputs sharing a tensor or storage (a custom
    op's outputs must not alias; the H200 caught a shared empty residual), and the backward through
    the kept residuals equal to the one recomputing them."""
    from fake_impls.kda import kda_chunk_fake
    from inductor_ext.kernels import kda_fp32

    inputs = make_inputs(CASES[0], torch.float32)
    args = (*(inputs[n] for n in ARGS), 0.3, inputs["initial_state"], inputs["cu_seqlens"], "fp32", residuals)
    out = kda_fp32.kda_chunk_fwd(*args)
    with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        fake = kda_chunk_fake(*args)
    assert [(x.shape, x.dtype) for x in out] == [(x.shape, x.dtype) for x in fake]
    assert len({id(x) for x in out}) == len(out)
    storages = [x.untyped_storage().data_ptr() for x in out if x.numel()]
    assert len(set(storages)) == len(storages)
    do, dht = _cotangents(inputs)
    grads = kda_fp32.kda_chunk_bwd(*args[:9], *out[2:], do, dht)
    recomputed = kda_fp32_bwd(*(inputs[n] for n in ARGS), 0.3, inputs["initial_state"], inputs["cu_seqlens"], do, dht)
    for a, b in zip(grads, recomputed):
        assert torch.equal(a, b)


@needs_interpreter
@pytest.mark.parametrize("force_exact", [False, True], ids=["guarded", "exact-everywhere"])
def test_bwd_steep_gates_take_the_exact_path(force_exact, monkeypatch, dots):
    """As the forward's test: blocks with e^{±240} spans must take the exact elementwise backward."""
    inputs = make_inputs(Case("steep", (100,), heads=2, k_dim=32, v_dim=32, initial_state=True), torch.float32)
    inputs["g"][..., ::4] = -30.0
    inputs["g"][:, 32:80, 1, :] = -0.01
    if force_exact:
        monkeypatch.setattr(chunk, "SPAN", -1.0)
    _check_grads(f"{dots} bwd steep gates exact={force_exact}", inputs, GRAD_TOL_INTERPRETER)


@needs_interpreter
def test_bwd_unpacked_batch_and_no_final_state_cotangent(dots):
    """B = 2 without cu_seqlens, dht = None (a zero cotangent), no initial state."""
    inputs = make_inputs(Case("2x70", (70, 70), heads=2, k_dim=32, v_dim=32), torch.float32)
    batched = {n: inputs[n].reshape(2, 70, *inputs[n].shape[2:]) for n in ARGS}
    do, _ = _cotangents(inputs)
    grads = _run_bwd({**batched, "initial_state": None, "cu_seqlens": None}, do.reshape(2, 70, 2, 32), None)
    ref = vjp_fp64(inputs, 32 ** -0.5, do, torch.zeros(2, 2, 32, 32))
    for n, gr in zip(ARGS, grads):
        assert_rel_l2(f"d{n}", gr.reshape(ref[n].shape), ref[n], GRAD_TOL_INTERPRETER)


@needs_interpreter
@pytest.mark.parametrize("case", CASES[:2], ids=ids[:2])
def test_bwd_bf16_inputs_against_rounded_fp64(case, dots, rne_bf16):
    """BF16 q, k, v, beta: gradients in BF16 against the FP64 VJP rounded to BF16."""
    inputs = make_inputs(case, torch.bfloat16)
    do, dht = _cotangents(inputs)
    grads = dict(zip(GRADS, _run_bwd(inputs, do.to(torch.bfloat16), dht)))
    ref = vjp_fp64(inputs, case.k_dim ** -0.5, do.to(torch.bfloat16), dht)
    for n in ref:
        assert grads[n].dtype == (torch.float32 if n in ("g", "initial_state") else torch.bfloat16)
        assert_rel_l2(f"d{n}", grads[n], round_bf16(ref[n]) if grads[n].dtype == torch.bfloat16 else ref[n],
                      TOL["bf16_io"]["fp32"])


@pytest.fixture
def bounds_checked(monkeypatch):
    """Every active lane of every interpreted load and store must fall inside one tensor argument
    of the launch (all of it inside the tensor that holds its first lane, so an overrun into a
    neighbouring buffer counts). The interpreter itself dereferences raw host addresses and would
    read or write past a buffer without complaint; hardware faults. Yields the list of violations."""
    from triton.runtime import interpreter

    extents, bad = [], []
    init_args = interpreter.GridExecutor._init_args_hst

    def _init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        names = list(inspect.signature(self.fn).parameters)
        extents.clear()
        for name, x in [*zip(names, args_hst), *kwargs_hst.items()]:
            if isinstance(x, torch.Tensor):
                extents.append((name, x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()))
        return args_hst, kwargs_hst

    def check(kind, ptrs, mask):
        """Record the access if any active lane leaves the tensor; return the mask without those
        lanes, so that a bad store or load is reported instead of corrupting the test process."""
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        p = np.asarray(ptrs.data).astype(np.uint64)
        active = np.broadcast_to(np.asarray(mask.data, dtype=bool), p.shape)
        if not active.any():
            return mask
        first = int(p[active].flat[0])
        owner = [(n, lo, hi) for n, lo, hi in extents if lo <= first and first + size <= hi]
        inside = (p >= owner[0][1]) & (p + size <= owner[0][2]) if owner else np.zeros(p.shape, dtype=bool)
        if not inside[active].all():
            bad.append((kind, tuple(interpreter.interpreter_builder.grid_idx), owner[0][0] if owner else None))
            return interpreter.TensorHandle(active & inside, mask.dtype)
        return mask

    load, store = interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_masked_store

    def create_masked_load(self, ptrs, mask, other, *a):
        return load(self, ptrs, check("load", ptrs, mask), other, *a)

    def create_masked_store(self, ptrs, value, mask, *a):
        return store(self, ptrs, value, check("store", ptrs, mask), *a)

    monkeypatch.setattr(interpreter.GridExecutor, "_init_args_hst", _init_args_hst)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", create_masked_load)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_store", create_masked_store)
    yield bad


BOUNDS_CASES = [
    # the H200 failure's shape scaled down: unpacked B = 1, K = V = 128, BF16 q/k/v/beta, last chunk partial
    (Case("T130-K128-bf16", (130,), heads=2, k_dim=128, v_dim=128), torch.bfloat16, {}),
    (Case("T130-K128-blocks64", (130,), heads=2, k_dim=128, v_dim=128), torch.float32, dict(block_k=64, block_v=64)),
    (CASES[2], torch.float32, dict(block_k=16, block_v=16)),  # packed, an empty document, V = 24
    (CASES[4], torch.float32, {}),  # packed, K = 96, V = 48, initial state
    (CASES[4], torch.float32, dict(split_output=True)),
    (CASES[2], torch.bfloat16, dict(block_k=16, block_v=16, split_output=True)),
]


@needs_interpreter
@pytest.mark.parametrize("case,dtype,kw", BOUNDS_CASES,
                         ids=[c.name + ("-split" if kw.get("split_output") else "") for c, _, kw in BOUNDS_CASES])
def test_every_access_stays_inside_its_tensor(case, dtype, kw, bounds_checked):
    inputs = make_inputs(case, dtype)
    inputs["g"] = inputs["g"].float()
    _run(inputs, **kw)
    assert not bounds_checked, f"{len(bounds_checked)} out-of-bounds accesses, first: {bounds_checked[:3]}"


@needs_interpreter
@pytest.mark.parametrize("case,dtype,kw", BOUNDS_CASES[:4], ids=[c.name for c, _, _ in BOUNDS_CASES[:4]])
def test_bwd_every_access_stays_inside_its_tensor(case, dtype, kw, bounds_checked):
    inputs = make_inputs(case, dtype)
    inputs["g"] = inputs["g"].float()
    do, dht = _cotangents(inputs)
    _run_bwd(inputs, do.to(dtype), dht, **kw)
    assert not bounds_checked, f"{len(bounds_checked)} out-of-bounds accesses, first: {bounds_checked[:3]}"


def test_bwd_rejects_a_cotangent_of_the_wrong_shape():
    q = torch.zeros(1, 4, 1, 32)
    with pytest.raises(ValueError, match="do must have o's shape"):
        kda_fp32_bwd(q, q, q, q, torch.zeros(1, 4, 1), 0.1, None, None, torch.zeros(1, 4, 1, 16))


def test_rejects_head_dims_above_128():
    q = torch.zeros(1, 4, 1, 160)
    with pytest.raises(ValueError, match="head dims K, V must be in 1..128"):
        kda_fp32_fwd(q, q, torch.zeros(1, 4, 1, 32), q, torch.zeros(1, 4, 1), 0.1, None, None)



@pytest.mark.parametrize("maxnreg", [0, 16, 256])
def test_rejects_a_register_cap_outside_32_to_255(maxnreg):
    q = torch.zeros(1, 4, 1, 32)
    with pytest.raises(ValueError, match="chunk_maxnreg must be None or 32..255"):
        kda_fp32_fwd(q, q, q, q, torch.zeros(1, 4, 1), 0.1, None, None, chunk_maxnreg=maxnreg)


@pytest.mark.parametrize("knob", ["chunk_bwd_maxnreg", "chunk_bwd_wy_maxnreg"])
def test_bwd_rejects_a_register_cap_outside_32_to_255(knob):
    q = torch.zeros(1, 4, 1, 32)
    with pytest.raises(ValueError, match=f"{knob} must be None or 32..255"):
        kda_fp32_bwd(q, q, q, q, torch.zeros(1, 4, 1), 0.1, None, None, q, **{knob: 256})

# ---------------------------------------------------------------------------------------------
# H200
# ---------------------------------------------------------------------------------------------

H200_CASES = [
    Case("T2048", (2048,), heads=64, k_dim=128, v_dim=128),
    Case("packed-700-1348-initial-state", (700, 1348), heads=64, k_dim=128, v_dim=128, initial_state=True),
]


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET, reason="the H200 geometry is for compiled kernels, not the interpreter")
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", H200_CASES, ids=[c.name for c in H200_CASES])
def test_cuda_h64_k128_fp32_and_bf16_inputs(case, variant):
    inputs = make_inputs(case, torch.float32, device="cuda")
    o, s = _run(inputs, **VARIANTS[variant])
    _check_fp32(f"cuda {case.name} {variant}", o, s, *_reference(inputs))
    bf16 = {n: (x.to(torch.bfloat16) if n in ("q", "k", "v", "beta") else x) for n, x in inputs.items()}
    o16, _ = _run(bf16, **VARIANTS[variant])
    err = rel_l2(o16, round_bf16(_reference(bf16)[0]))
    print(f"[cuda bf16 io {case.name}] o={err:.2e}")
    assert err <= TOL["bf16_io"]["fp32"], f"o (bf16 inputs): {err:.3e}"


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET, reason="the H200 geometry is for compiled kernels, not the interpreter")
@pytest.mark.parametrize("case", H200_CASES, ids=[c.name for c in H200_CASES])
def test_cuda_bwd_h64_k128_grads_within_1e4_of_fp64_vjp(case):
    _check_grads(f"cuda bwd {case.name}", make_inputs(case, torch.float32, device="cuda"), TOL["fp32"]["grad"])


GLUON_CASES = [
    Case("packed-700-0-1-1348-initial-state", (700, 0, 1, 1348), heads=8, k_dim=128, v_dim=128, initial_state=True),
    Case("packed-130-64-K96-V96-initial-state", (130, 64), heads=4, k_dim=96, v_dim=96, initial_state=True),
    Case("T2048-K128-V64", (2048,), heads=4, k_dim=128, v_dim=64),
]


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET, reason="Gluon kernels run compiled only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", GLUON_CASES, ids=[c.name for c in GLUON_CASES])
def test_cuda_gluon_state_pass_is_bitwise_the_triton_one(case, dtype, monkeypatch):
    """On Hopper the forward's state pass is gluon_state's kernel: the same products as the Triton
    state kernel in the same order, so o and the final state are bitwise equal; empty, one-token and
    partial documents, an initial state, K and V below 128."""
    if not gluon_state.usable(torch.device("cuda"), 128, 64, False):
        pytest.skip("the Gluon state pass needs a Hopper GPU")
    inputs = make_inputs(case, torch.float32, device="cuda")
    inputs = {n: (x.to(dtype) if n in ("q", "k", "v", "beta") else x) for n, x in inputs.items()}
    o, s = _run(inputs)
    monkeypatch.setattr(gluon_state, "usable", lambda *a: False)
    o_ref, s_ref = _run(inputs)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref), (
        f"o differs by {(o.double() - o_ref.double()).abs().max().item():.3e}, "
        f"the final state by {(s - s_ref).abs().max().item():.3e}")


@pytest.mark.parametrize("device, bk, bvt, split, expected", [
    ("cpu", 128, 64, False, False), ("cuda", 64, 64, False, False), ("cuda", 128, 32, False, False),
    ("cuda", 128, 64, True, False)])
def test_gluon_state_pass_only_for_its_geometry(device, bk, bvt, split, expected):
    """The Gluon kernel is chosen only for K in 65..128, 64 V columns per program and o wanted (and
    only on Hopper); every other state pass is the Triton kernel's."""
    assert gluon_state.usable(torch.device(device), bk, bvt, split) is expected


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(INTERPRET, reason="the H200 geometry is for compiled kernels, not the interpreter")
def test_cuda_h64_k128_t16384():
    inputs = make_inputs(Case("T16384", (16384,), heads=64, k_dim=128, v_dim=128), torch.float32, device="cuda")
    o, s = _run(inputs)
    _check_fp32("cuda T16384", o, s, *_reference(inputs))


def _partial_chunk_rows_match(inputs, causal, cuts=(5, 20), **launch) -> list[bool]:
    """For each cut c: are the rows of the second chunk's first c tokens, run alone (zero-padded to
    64, from the first chunk's final state), bitwise the rows of the full 128-token run?"""
    K, dev = inputs["q"].shape[-1], inputs["q"].device
    cu = torch.tensor([0, 64], device=dev)
    rows = lambda lo, hi: [inputs[n][:, lo:hi] for n in ARGS]  # noqa: E731
    full, _ = kda_fp32_fwd(*rows(0, 128), K ** -0.5, None, torch.tensor([0, 128], device=dev), causal=causal, **launch)
    _, boundary = kda_fp32_fwd(*rows(0, 64), K ** -0.5, None, cu, causal=causal, **launch)
    same = []
    for c in cuts:
        padded = [torch.cat([x, x.new_zeros(1, 64 - c, *x.shape[2:])], 1) for x in rows(64, 64 + c)]
        o, _ = kda_fp32_fwd(*padded, K ** -0.5, boundary, cu, causal=causal, **launch)
        same.append(torch.equal(o[:, :c], full[:, 64:64 + c]))
    return same


@needs_interpreter
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "factored"])
@pytest.mark.parametrize("gates", ["gentle", "steep"])
def test_partial_chunk_rows_equal_the_full_chunks_only_on_the_causal_path(causal, gates):
    """What the batch-invariant decode relies on (``graphs/kda_replay.py``, precision "fp32_causal"):
    with ``causal`` the rows of a partial chunk, zero-padded to 64 and run from the boundary state,
    are bitwise the same rows of the full chunk, also where steep gates send columns of a row block
    to the exact path (cut 20 sits inside the block whose later rows fail the check); the default
    factored paths (reference row 32, the whole-chunk span check) make a row depend on the later
    rows of its chunk. Position-independent interpreter dots (``interpreter_numerics``), as a GPU
    MMA's rows are."""
    inputs = make_inputs(Case("two-chunks", (128,), heads=2, k_dim=32, v_dim=32), torch.float32)
    if gates == "steep":
        inputs["g"][:, 64 + 22:, :, ::4] = -8.0  # e^{-8·(j-16)} beyond e^{SPAN} from column 22 on
    with interpreter_numerics(ordered_dot=True):
        same = _partial_chunk_rows_match(inputs, causal, cuts=(5, 20, 30), **forward.CAUSAL_LAUNCH)
    assert all(same) if causal else not any(same), same


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRET, reason="the H200 geometry is for compiled kernels, not the interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_causal_path_partial_chunk_rows_equal_the_full_chunks(dtype):
    inputs = make_inputs(Case("two-chunks-h64", (128,), heads=64, k_dim=128, v_dim=128), dtype, device="cuda")
    inputs["g"][:, 64 + 22:, ::2, ::4] = -8.0  # steep columns on the exact path in half the heads
    for launch in ({}, forward.CAUSAL_LAUNCH):
        assert all(_partial_chunk_rows_match(inputs, causal=True, cuts=(1, 5, 20, 40, 63), **launch)), launch
