"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over the GLM-5.3 decoder layers, mixed parameter
dtypes included: :func:`shard_fsdp2` (``docs/DESIGN.md`` §7.1).

transformers keeps the router (``mlp.gate.weight``, ``e_score_correction_bias``), the KDA short
convolution and gates (``conv1d``, ``dt_bias``, ``A_log``) and the mHC ``base``/``scale`` in FP32 in
a BF16 model (:data:`graphs.modules.FP32_PARAMS`), and FSDP2 builds one flat all-gather /
reduce-scatter buffer per ``fully_shard`` call, so it requires one original dtype over the trainable
parameters of each call (``FSDPParamGroup._init_mp_dtypes``: "FSDP expects uniform original
parameter dtype"). Grouping them apart by module is not possible: a group is a set of modules and
holds every parameter directly registered on them, and ``attn_hc`` holds ``fn`` (BF16) beside
``base``/``scale`` (FP32), ``forget_gate`` its BF16 projections beside ``dt_bias``/``A_log``; a
``fully_shard`` on a submodule of a block would also put FSDP's hooks inside the block's compiled
``fullgraph`` region. ``MixedPrecisionPolicy`` casts every parameter of a group to one
``param_dtype``, so an FP32 master copy with ``param_dtype=bfloat16`` would run the router and mHC
coefficients in BF16, not as the serving model does.

So the minority-dtype parameters (here the FP32 ones: a few KB per layer in the tiny model, the
router is the largest at full size) are replicated, as in DDP: each ``fully_shard`` call ignores
them (``ignored_params``), and their gradients are averaged over the mesh by one all-reduce per
backward (a gradient hook per parameter collects this backward's contribution; an autograd-engine
callback all-reduces them all at the end of the backward, in one flat buffer per dtype, and adds the
average to ``.grad``), the same average FSDP's reduce-scatter gives the sharded ones.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["shard_fsdp2"]


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a :class:`graphs.GLM53Model` or of a patched transformers model."""
    from graphs.model import GLM53Model
    from graphs.transformers_patch import _text_model, is_patched

    if isinstance(model, GLM53Model):
        return model.layers
    if not is_patched(model):
        raise ValueError(f"shard_fsdp2: expected a GLM53Model or a model patched by patch_transformers, "
                         f"got {type(model).__name__}")
    return _text_model(model).layers


class _ReplicatedGrads:
    """Averages the gradients of replicated parameters over ``group``: once per backward, in one
    all-reduce per dtype, at the end of the backward (an autograd-engine callback, queued by the
    first gradient that arrives). Each parameter's hook keeps this backward's gradient and passes
    zeros on to ``.grad``; the callback adds the average (zeros where no rank had a gradient stay
    ``None``), so gradient accumulation over several backwards sums averages, as FSDP does."""

    def __init__(self, params: list[nn.Parameter], group):
        self.params, self.group = params, group
        self.pending: dict[int, torch.Tensor] = {}
        self.queued = False
        for i, p in enumerate(params):
            p.register_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            prev = self.pending.get(i)
            self.pending[i] = grad if prev is None else prev + grad
            if not self.queued:
                self.queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._all_reduce)
            return torch.zeros_like(grad)

        return hook

    def _all_reduce(self) -> None:
        pending, self.pending, self.queued = self.pending, {}, False
        world = dist.get_world_size(self.group)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(self.params):
            by_dtype.setdefault(p.dtype, []).append(i)
        for dtype, idx in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):  # the same order on every rank
            parts = [pending[i].reshape(-1) if i in pending else self.params[i].new_zeros(self.params[i].numel())
                     for i in idx]
            has = torch.tensor([float(i in pending) for i in idx], dtype=dtype, device=parts[0].device)
            flat = torch.cat(parts + [has])
            dist.all_reduce(flat, group=self.group)  # SUM: gloo has no AVG
            grads, counts = flat[: -len(idx)], flat[-len(idx):]
            offset = 0
            for j, i in enumerate(idx):
                p = self.params[i]
                g = (grads[offset: offset + p.numel()] / world).view_as(p)
                offset += p.numel()
                if counts[j] == 0:
                    continue
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)


def shard_fsdp2(model: nn.Module, mesh=None, *, reshard_after_forward: bool | None = None) -> nn.Module:
    """FSDP2 ``fully_shard`` on each decoder layer and on the root, the last step of torchtitan's
    order: patch, activation checkpointing, ``torch.compile`` each layer, then this.

    The trainable parameters of the dominant dtype (by element count; BF16 in a BF16 model) are
    sharded, one ``fully_shard`` per decoder layer (whatever module sits in ``layers[i]``: the
    compiled, checkpointed layer) and one on ``model`` (embedding, final norm, lm_head, anything
    else). Trainable parameters of another dtype (the FP32 router, convolution, gates and mHC
    ``base``/``scale`` that transformers keeps in a BF16 model) are replicated: ``ignored_params``
    of every call, their gradients averaged over the mesh by one all-reduce at the end of each
    backward (see :mod:`graphs.fsdp` for why they cannot be grouped apart). Frozen parameters are
    sharded whatever their dtype (FSDP2's dtype rule counts trainable ones only). ``token_logprobs``
    is registered as a forward method of the root, so it all-gathers like ``forward``.

    Gradients of both kinds are the mean over the ranks (FSDP2's default division by the world
    size): the loss each rank backpropagates is its local mean, and equal local batches give the
    global mean's gradient.

    Args:
        model: a :class:`graphs.GLM53Model` or a model patched by
            :func:`graphs.patch_transformers`, its layers already wrapped (checkpointing, compile).
        mesh: a 1-D ``DeviceMesh`` (None: FSDP2's default, all ranks of the default group).
        reshard_after_forward: passed to every ``fully_shard`` call (None: FSDP2's default).

    Returns:
        ``model`` itself (now an ``FSDPModule``), in place.

    Raises:
        ValueError: another model type, or a mesh of more than one dimension.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    layers = _decoder_layers(model)
    if mesh is not None and mesh.ndim != 1:
        raise ValueError(f"shard_fsdp2: a 1-D mesh, got {mesh.ndim} dimensions")
    trainable = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
    numel = Counter()
    for p in trainable:
        numel[p.dtype] += p.numel()
    dominant = numel.most_common(1)[0][0] if numel else None
    replicated = [p for p in trainable if p.dtype != dominant]
    ignored = set(replicated)
    kwargs = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    for layer in layers:
        mine = {p for p in layer.parameters() if p in ignored}
        fully_shard(layer, mesh=mesh, ignored_params=mine or None, **kwargs)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None, **kwargs)
    if hasattr(model, "token_logprobs"):
        register_fsdp_forward_method(model, "token_logprobs")
    if replicated:
        group = None if mesh is None else mesh.get_group()
        model._glm53_replicated_grads = _ReplicatedGrads(replicated, group)
    return model
