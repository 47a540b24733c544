"""Independent FP64 references for the KDA tests: the token recurrence and its VJP.

Written for the tests from the contract in DESIGN §4; shares no code with ``inductor_ext``.
"""

from __future__ import annotations

import dataclasses

import torch

# relative-L2 tolerances, one table per precision (see DESIGN §6)
TOL = {
    # FP32 inputs and outputs, precision "fp32", CPU (IEEE FP32 dots)
    "fp32": {"o": 1e-5, "state": 1e-5, "grad": 1e-4},
    # BF16 inputs and outputs, against the FP64 result rounded to BF16
    "bf16_io": {"fp32": 1e-4, "bf16_low": 1e-3, "bf16_high": 1e-2, "ratio": 20.0},
}


@dataclasses.dataclass
class Case:
    """A KDA geometry: document lengths (several = packed via cu_seqlens), heads, dims."""

    name: str
    lengths: tuple[int, ...]
    heads: int
    k_dim: int
    v_dim: int
    initial_state: bool = False

    @property
    def packed(self) -> bool:
        return len(self.lengths) > 1


CASES = [
    Case("packed-37-28", (37, 28), heads=2, k_dim=32, v_dim=24),
    Case("T129-chunk-boundary", (129,), heads=2, k_dim=32, v_dim=32),
    Case("H64-K128-T65", (65,), heads=64, k_dim=128, v_dim=128),
    Case("initial-state-packed", (70, 9), heads=3, k_dim=16, v_dim=20, initial_state=True),
]


def make_inputs(case: Case, dtype: torch.dtype, device="cpu", seed: int = 0) -> dict:
    """Random inputs in the shapes of the op (B=1, T=sum of lengths); gate in [-5, 0]."""
    gen = torch.Generator().manual_seed(seed)
    T, H, K, V = sum(case.lengths), case.heads, case.k_dim, case.v_dim

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    inputs = {
        "q": rnd(1, T, H, K).to(dtype),
        "k": rnd(1, T, H, K).to(dtype),
        "v": rnd(1, T, H, V).to(dtype),
        "g": -5.0 * torch.sigmoid(rnd(1, T, H, K) - 3.0),
        "beta": torch.sigmoid(rnd(1, T, H)).to(dtype),
        "initial_state": rnd(len(case.lengths), H, K, V) * 0.5 if case.initial_state else None,
        "cu_seqlens": torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()]) if case.packed else None,
    }
    return {name: (x.to(device) if x is not None else None) for name, x in inputs.items()}


def recurrence_fp64(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """FP64 token recurrence: S' = Diag(exp g) S; S = S' + β k (v − S'ᵀk)ᵀ; o = Sᵀ(scale·q̂).
    q, k are L2-normalized as x / sqrt(Σx² + 1e-6). Differentiable (its autograd is the FP64 VJP)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    T, H, K, V = q.shape[1], q.shape[2], q.shape[3], v.shape[3]
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].double()
        for t in range(bounds[n], bounds[n + 1]):
            S = g[0, t].exp()[..., None] * S
            err = v[0, t] - torch.einsum("hkv,hk->hv", S, k[0, t])
            S = S + beta[0, t][:, None, None] * k[0, t][..., None] * err[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, scale * q[0, t]))
        finals.append(S)
    return torch.stack(outs)[None], torch.stack(finals)


def vjp_fp64(inputs: dict, scale: float, do, dht):
    """FP64 gradients of (o, final_state) · (do, dht) w.r.t. q, k, v, g, beta (and initial_state)."""
    names = ["q", "k", "v", "g", "beta"] + (["initial_state"] if inputs["initial_state"] is not None else [])
    leaves = {n: inputs[n].detach().double().requires_grad_(True) for n in names}
    args = {**inputs, **leaves}
    o, final = recurrence_fp64(args["q"], args["k"], args["v"], args["g"], args["beta"], scale,
                               args["initial_state"], inputs["cu_seqlens"])
    grads = torch.autograd.grad((o, final), list(leaves.values()), (do.double(), dht.double()))
    return dict(zip(names, grads))


def rel_l2(actual, expected) -> float:
    """‖actual − expected‖ / ‖expected‖ in FP64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def assert_rel_l2(name: str, actual, expected, tol: float) -> float:
    """Assert the relative L2 error of tensor ``name`` is at most ``tol``; returns the error."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if not torch.isfinite(actual).all():
        raise AssertionError(f"{name}: non-finite values")
    err = rel_l2(actual, expected)
    if not err <= tol:
        raise AssertionError(f"{name}: relative L2 {err:.3e} > {tol:.1e}")
    return err


def round_bf16(x):
    return x.to(torch.bfloat16).double()


__all__ = ["TOL", "Case", "CASES", "make_inputs", "recurrence_fp64", "vjp_fp64", "rel_l2",
           "assert_rel_l2", "round_bf16"]
