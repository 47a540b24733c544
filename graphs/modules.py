"""Building blocks shared by the GLM-5.3 decoder layers: RMSNorm, mHC, SwiGLU MLP and MoE.

Parameter names follow transformers ``glm5_next`` (``Glm5NextTextRMSNorm``, ``...HyperConnection``,
``...MLP``, ``...MoE``) so a state dict loads directly. Every forward takes the resolved
:class:`~inductor_ext.PrecisionConfig` and passes its fields to the ``glm53`` ops as literals.
Tokens are packed: activations are ``[T, D]``, mHC streams ``[T, N, D]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphs.config import GLM53Config
from inductor_ext import PrecisionConfig, active_config, ops
from inductor_ext.ops.ordered import ordered_sum

__all__ = ["resolve_precision", "linear", "stream_mean", "RMSNorm", "HyperConnection", "MLP",
           "TopkRouter", "Experts", "MoE", "FP32_PARAMS", "cast_model"]

# parameters transformers keeps in FP32 whatever the model dtype (``_keep_in_fp32_modules_strict``)
FP32_PARAMS = ("e_score_correction_bias", "gate.weight", "conv1d", "dt_bias", "A_log",
               "attn_hc.base", "attn_hc.scale", "ffn_hc.base", "ffn_hc.scale")


def resolve_precision(precision: PrecisionConfig | None) -> PrecisionConfig:
    """``precision`` itself, or the active config (read while tracing: a guarded constant)."""
    if precision is None:
        return active_config()
    if not isinstance(precision, PrecisionConfig):
        raise ValueError(f"precision must be a PrecisionConfig or None, got {type(precision).__name__}")
    return precision


def cast_model(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast parameters and floating buffers to ``dtype`` except :data:`FP32_PARAMS` (kept FP32,
    as transformers loads them). Returns ``module``."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.is_floating_point():
            keep = any(key in name for key in FP32_PARAMS)
            t.data = t.data.to(torch.float32 if keep else dtype)
    return module


def linear(layer: nn.Linear, x: torch.Tensor, prec: PrecisionConfig) -> torch.Tensor:
    """``layer(x)``; with ``prec.batch_invariant`` the batch-invariant ``ops.bi_linear`` (fixed K
    order, each row independent of the others in the call) with the same weight and bias."""
    if prec.batch_invariant:
        return ops.bi_linear(x, layer.weight, layer.bias)
    return layer(x)


def stream_mean(streams: torch.Tensor, prec: PrecisionConfig) -> torch.Tensor:
    """Mean over the mHC streams ``[T, N, D]`` → ``[T, D]`` (the final norm's input); with
    ``prec.batch_invariant`` an FP32 :func:`ordered_sum` divided by N, rounded once."""
    if prec.batch_invariant:
        return (ordered_sum(streams.float(), 1) / streams.shape[1]).to(streams.dtype)
    return streams.mean(dim=1)


class RMSNorm(nn.Module):
    """``weight · (x / rms(x))``: normalized in FP32, rounded to x's dtype, then scaled (transformers).
    With ``prec.batch_invariant``: ``ops.bi_rms_norm`` (same formula with a fixed-order sum and an
    IEEE divide for ``x · rsqrt``: at most 1 ulp of x's dtype apart)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, prec: PrecisionConfig) -> torch.Tensor:
        if prec.batch_invariant:
            return ops.bi_rms_norm(x, self.weight, self.variance_epsilon)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * xf.to(x.dtype)


class HyperConnection(nn.Module):
    """mHC coefficients (``glm53::mhc_pre``: stream RMSNorm, projection, Sinkhorn) for N streams."""

    def __init__(self, config: GLM53Config):
        super().__init__()
        n, width = config.hc_mult, (2 + config.hc_mult) * config.hc_mult
        self.fn = nn.Parameter(torch.randn(width, n * config.hidden_size) * 0.02)
        self.base = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.norm_eps, self.hc_eps, self.iters = config.rms_norm_eps, config.hc_eps, config.hc_sinkhorn_iters

    def forward(self, streams: torch.Tensor, prec: PrecisionConfig):
        """streams ``[T, N, D]`` → (sublayer input ``[T, D]``, post ``[T, N]``, comb ``[T, N, N]``);
        with ``prec.batch_invariant`` through ``ops.mhc_pre_batch_invariant``."""
        pre = ops.mhc_pre_batch_invariant if prec.batch_invariant else ops.mhc_pre
        return pre(streams, self.fn, self.base, self.scale, norm_eps=self.norm_eps, hc_eps=self.hc_eps,
                   sinkhorn_iters=self.iters)


class MLP(nn.Module):
    """Clamped SwiGLU MLP; ``glm53::swiglu`` in ``PrecisionConfig.swiglu`` mode; optional FP8
    quantize-dequantize of its input and of the activation (``scale_fmt``: "ue8m0" | "fp32")."""

    def __init__(self, config: GLM53Config, intermediate_size: int | None = None):
        super().__init__()
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor, prec: PrecisionConfig, scale_fmt: str | None = None) -> torch.Tensor:
        if scale_fmt is not None:
            x = ops.fp8_qdq(x, scale_fmt=scale_fmt)
        act = ops.swiglu(linear(self.gate_proj, x, prec), linear(self.up_proj, x, prec), limit=self.limit,
                         mode=prec.swiglu)
        if scale_fmt is not None:
            act = ops.fp8_qdq(act, scale_fmt=scale_fmt)
        return linear(self.down_proj, act, prec)


class TopkRouter(nn.Module):
    """Sigmoid router with correction bias and grouped top-k (FP32), DeepSeek-V3 style."""

    def __init__(self, config: GLM53Config):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(config.n_routed_experts, config.hidden_size) * 0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def forward(self, x: torch.Tensor, prec: PrecisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """x ``[T, D]`` → (expert ids ``[T, top_k]`` int64, FP32 combine weights ``[T, top_k]``).

        transformers ``Glm5NextTextTopkRouter`` semantics: weights are the picked sigmoid scores,
        normalized over the top-k when ``norm_topk_prob``, times ``routed_scaling_factor``.
        With ``prec.batch_invariant``: the FP32 scores through ``ops.bi_linear`` (x upcast in the
        kernel), the group and expert picks by a stable descending sort (among equal scores the
        lower id wins; ``torch.topk`` promises no order among ties) and the normalizing sum in
        top-k order."""
        T, E = x.shape[0], self.weight.shape[0]
        invariant = prec.batch_invariant
        if invariant:
            scores = ops.bi_linear(x, self.weight.float(), out_dtype=torch.float32).sigmoid()
        else:
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        # a group's score is the sum of its two best experts; only the top topk_group groups compete
        group_score = choice.view(T, self.n_group, -1).topk(2, dim=-1).values.sum(-1)
        group_idx = _top_ids(group_score, self.topk_group, invariant)
        keep = torch.zeros_like(group_score).scatter(1, group_idx, 1.0).bool()
        keep = keep[:, :, None].expand(T, self.n_group, E // self.n_group).reshape(T, E)
        idx = _top_ids(choice.masked_fill(~keep, float("-inf")), self.top_k, invariant)
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / ((ordered_sum(w, -1, keepdim=True) if invariant else w.sum(-1, keepdim=True)) + 1e-20)
        return idx, w * self.scaling


def _top_ids(scores: torch.Tensor, k: int, deterministic: bool) -> torch.Tensor:
    """Ids of the ``k`` largest scores per row (any order); ``deterministic``: the first ``k`` of a
    stable descending sort (ties: lower id first)."""
    if deterministic:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return scores.topk(k, dim=-1, sorted=False).indices


def _grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``rows [M, K]`` sorted by group, ``weight [E, N, K]``, ``offs`` group end rows → ``[M, N]``."""
    return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offs)


class Experts(nn.Module):
    """Routed experts as 3-D weights: ``gate_up_proj [E, 2I, D]``, ``down_proj [E, D, I]``."""

    def __init__(self, config: GLM53Config):
        super().__init__()
        E, I, D = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, D) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(E, D, I) * 0.02)
        self.limit = config.swiglu_limit

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, prec: PrecisionConfig,
                scale_fmt: str | None) -> torch.Tensor:
        """x ``[T, D]``, indices ``[T, k]`` (expert ids), weights ``[T, k]`` FP32 →
        ``Σ_j weights[t, j] · expert_{indices[t, j]}(x[t])`` in x's dtype.

        Routed with static shapes (no host sync, no data-dependent shapes; one graph under
        ``fullgraph=True``): the T·k (token, expert) pairs are stable-sorted by expert id, the x
        rows gathered in that order, per-expert end offsets counted by ``searchsorted`` and both
        projections run as ``torch._grouped_mm`` over the groups (an expert no token picked is an
        empty group, its weights get an exact zero gradient). Only the picked experts run:
        6·T·k·D·I forward FLOPs instead of the all-experts 6·T·E·D·I. ``torch._grouped_mm`` takes
        only BF16 under torch.compile (its meta kernel; eager CPU also takes FP32/FP16) and on CUDA
        wants 16-byte aligned strides (D, 2I and I multiples of 8).

        Numerics (forward): for every selected (token, expert) pair the projections are the same
        BF16 matmuls as a per-expert ``F.linear`` (FP32 accumulation, one rounding per element; the
        summation order inside a dot product is the grouped-mm kernel's), SwiGLU and the optional
        FP8 quantize-dequantize act on the same rows (per-row groups of 128). The k expert outputs
        of a token are multiplied by their weight in FP32, summed in FP32 in top-k order and
        rounded once to x's dtype. That is transformers' ``grouped_mm`` experts path (its default;
        its eager loop adds per expert in the model dtype, ~1 ulp of the output apart) and the
        former all-experts form up to the FP32 summation order over the k outputs (a rare 1-ulp
        BF16 flip for k > 2). The sum runs after un-permuting to ``[T, k, D]``, not through
        ``index_add``: deterministic, no atomics on CUDA.
        Backward: expert-weight gradients are per-expert FP32-accumulated sums over that expert's
        rows (order: the kernel's). The x gradient of each pair comes out of the grouped mm
        rounded to BF16, then the k pairs of a token are summed in FP32 and rounded once (the
        all-experts einsum summed all experts in one FP32 contraction: one BF16 rounding less,
        ~0.3 % relative L2 apart; transformers' grouped_mm path adds the k rows in BF16).

        With ``prec.batch_invariant`` both projections are ``ops.bi_grouped_linear`` (each pair's
        row bitwise that of a batch-invariant linear with its expert's weight, whatever the group
        sizes) and the k slots are added in top-k order (:func:`ordered_sum`)."""
        T, K = indices.shape
        E, D = self.gate_up_proj.shape[0], x.shape[-1]
        if scale_fmt is not None:
            x = ops.fp8_qdq(x, scale_fmt=scale_fmt)  # per row: commutes with the row gather below
        sorted_ids, order = torch.sort(indices.reshape(-1), stable=True)  # order[s] = t·k + j
        bounds = torch.arange(1, E + 1, device=indices.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, bounds).to(torch.int32)  # end row of each expert's group
        xs = x[:, None, :].expand(T, K, D).reshape(T * K, D)[order]
        grouped = ops.bi_grouped_linear if prec.batch_invariant else _grouped_mm
        gate, up = grouped(xs, self.gate_up_proj, offs).chunk(2, dim=-1)
        act = ops.swiglu(gate, up, limit=self.limit, mode=prec.swiglu)
        if scale_fmt is not None:
            act = ops.fp8_qdq(act, scale_fmt=scale_fmt)
        y = grouped(act, self.down_proj, offs)
        inverse = torch.empty_like(order).scatter(0, order, torch.arange(T * K, device=order.device))
        y = y[inverse].view(T, K, D)  # back to (token, top-k slot) order
        weighted = y.float() * weights[:, :, None]
        return (ordered_sum(weighted, 1) if prec.batch_invariant else weighted.sum(1)).to(x.dtype)


class MoE(nn.Module):
    """Routed experts + shared expert. ``PrecisionConfig.moe_act`` = "fp8_ue8m0" / "fp8_fp32scale"
    quantize-dequantizes the expert inputs and post-SwiGLU activations (routed and shared) per 128."""

    def __init__(self, config: GLM53Config):
        super().__init__()
        self.experts = Experts(config)
        self.gate = TopkRouter(config)
        self.shared_experts = MLP(config, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor, prec: PrecisionConfig) -> torch.Tensor:
        fmt = {"none": None, "fp8_ue8m0": "ue8m0", "fp8_fp32scale": "fp32"}[prec.moe_act]
        routed = self.experts(x, *self.gate(x, prec), prec, fmt)
        return routed + self.shared_experts(x, prec, fmt)
