"""Run a transformers ``glm5_next`` model on this project's layer code, in place (Liger-Kernel's
``apply_liger_kernel_to_*(model=...)`` style): :func:`patch_transformers` (``docs/DESIGN.md`` §7.1).

How the parameters are shared: nothing is copied or re-registered. Each live transformers module
that has a counterpart in :class:`graphs.GLM53Model` (decoder layers, mHC, norms, KDA, MLA, the
indexer, MLP, MoE, router, experts; same module names, same parameter names) gets a new class: a
subclass of (this project's class, its transformers class), named like the transformers class,
plus the plain attributes this project's ``__init__`` sets (read from a ``GLM53Model`` built on the
meta device for the model's config). Its ``forward`` and helper methods are this project's, its
``__init__``, parameters, buffers, hooks and ``isinstance`` / ``_no_split_modules`` identity stay
transformers'. The forwards read every weight through the module's attributes on each call, so
whatever replaces a parameter later (FSDP2's ``fully_shard``, ``checkpoint_wrapper``, ``.to()``) is
what runs. Built-in modules (``nn.Linear``, ``nn.Embedding``, ``nn.Conv1d``, ``nn.LayerNorm``) are
left alone: this project's code calls them as they are.

The top modules get this project's call (:mod:`graphs.transformers_call`): the causal LM (the
conditional-generation class, or a glm5_next ``ForCausalLM``) returns ``CausalLMOutputWithPast``
and has ``token_logprobs`` (:meth:`graphs.GLM53Model.token_logprobs`, ``position_ids=`` too); the
model and text model return ``BaseModelOutputWithPast`` (``last_hidden_state`` the final norm's
output). Text only: images and videos are refused.

Order for a trainer (torchtitan): patch, then wrap each ``model...layers[i]`` in activation
checkpointing, then ``torch.compile(..., fullgraph=True)`` each, then ``fully_shard`` each and the
root (:func:`graphs.shard_fsdp2`, which replicates the FP32 parameters of a BF16 model). The
per-layer call is ``layer(streams [T, N, D], cu_seqlens, prev_ids, precision)``.

The KPool indexer's parameters get no gradient: it returns integer token ids (a top-k selection,
discontinuous in its scores), so no gradient flows back into it; it is frozen, as in serving.
``freeze_indexer=True`` also sets ``requires_grad=False`` on them (optimizers and FSDP then skip
them).
"""

from __future__ import annotations

import torch
from torch import nn

from graphs.config import GLM53Config
from graphs.model import GLM53Model
from graphs.modules import resolve_precision
from graphs.transformers_call import causal_lm_call, check_input_ids, check_options, resolve_documents
from inductor_ext import PrecisionConfig

__all__ = ["patch_transformers", "is_patched"]

_SUPPORTED = ("Glm5NextForConditionalGeneration", "Glm5NextModel", "Glm5NextTextModel", "a glm5_next ForCausalLM")
_MEDIA = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "mm_token_type_ids",
          "mm_encoder_outputs")


def _check_text_only(kwargs: dict) -> None:
    for name in _MEDIA:
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"GLM53: the patched forward is text only, got {name}")


class _TextModel:
    """Grafted onto ``Glm5NextTextModel``: the text model's forward on this project's layers."""

    final_hidden = GLM53Model.final_hidden
    embed = GLM53Model.embed
    final_norm = GLM53Model.final_norm

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, cu_seqlens=None, output_hidden_states=None, return_dict=None, past_key_values=None,
                **kwargs):
        """``last_hidden_state``: the final norm's output ``[..., T, D]`` (leading dims of
        ``input_ids``); documents and options as :func:`graphs.transformers_call.causal_lm_call`."""
        from transformers.modeling_outputs import BaseModelOutputWithPast

        _check_text_only(kwargs)
        check_options(use_cache, cache if cache is not None else past_key_values, inputs_embeds)
        check_input_ids(input_ids)
        cu = resolve_documents(input_ids.numel(), input_ids.device, cu_seqlens, position_ids, attention_mask, kwargs)
        check_options(extra=kwargs)
        final, streams = self.final_hidden(input_ids, cu, resolve_precision(self.precision))
        hidden = tuple(s.view(*input_ids.shape, *s.shape[1:]) for s in streams) if output_hidden_states else None
        out = BaseModelOutputWithPast(last_hidden_state=final.view(*input_ids.shape, -1), hidden_states=hidden)
        return out.to_tuple() if return_dict is False else out


class _Model:
    """Grafted onto ``Glm5NextModel`` (vision tower + text model): text only, the text model's forward."""

    def forward(self, input_ids=None, **kwargs):
        _check_text_only(kwargs)
        return self.language_model(input_ids=input_ids, **kwargs)


class _CausalLM:
    """Grafted onto the causal LM: the transformers call (:func:`graphs.transformers_call.causal_lm_call`)
    and :meth:`graphs.GLM53Model.token_logprobs`."""

    token_logprobs = GLM53Model.token_logprobs

    def final_hidden(self, input_ids, cu_seqlens, precision, serving=False, cp=None):
        """The text model's :meth:`graphs.GLM53Model.final_hidden`."""
        return _text_model(self).final_hidden(input_ids, cu_seqlens, precision, serving, cp=cp)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, return_dict=None, cu_seqlens=None, output_hidden_states=False,
                past_key_values=None, **kwargs):
        """``CausalLMOutputWithPast`` (``.logits``, ``.loss``); see :mod:`graphs.transformers_call`."""
        _check_text_only(kwargs)
        return causal_lm_call(self.final_hidden, self.lm_head, resolve_precision(self.precision), input_ids,
                              cu_seqlens=cu_seqlens, position_ids=position_ids, attention_mask=attention_mask,
                              labels=labels, use_cache=use_cache, return_dict=return_dict,
                              output_hidden_states=output_hidden_states,
                              cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                              **kwargs)


def _glm5_next():
    from transformers.models.glm5_next import modeling_glm5_next

    return modeling_glm5_next


def _text_model(model: nn.Module) -> nn.Module:
    """The ``Glm5NextTextModel`` inside ``model`` (itself, ``.language_model``, ``.model.language_model``
    or ``.model``)."""
    text_cls = _glm5_next().Glm5NextTextModel
    candidates = [model, getattr(model, "language_model", None), getattr(model, "model", None)]
    candidates.insert(2, getattr(candidates[2], "language_model", None))
    for c in candidates:
        if isinstance(c, text_cls):
            return c
    raise ValueError(f"patch_transformers: no Glm5NextTextModel inside {type(model).__name__}")


def _architecture(model) -> str:
    config = getattr(model, "config", None)
    return f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r})"


def _check_architecture(model) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"patch_transformers: expected a transformers glm5_next model, got {type(model).__name__}")
    try:
        hf = _glm5_next()
    except ImportError as e:  # an older transformers: no glm5_next at all
        raise ValueError(f"patch_transformers: {_architecture(model)} is not a transformers glm5_next model "
                         f"(this transformers has no glm5_next)") from e
    if not isinstance(model, hf.Glm5NextPreTrainedModel) or isinstance(model, hf.Glm5NextVisionModel):
        raise ValueError(f"patch_transformers: {_architecture(model)} is not supported; it patches the transformers "
                         f"glm5_next text models: {', '.join(_SUPPORTED)}")


_GRAFTS: dict[tuple[type, type], type] = {}


def _graft(module: nn.Module, ours: type) -> None:
    """Give ``module`` the class (``ours``, its transformers class), named like the transformers class."""
    if isinstance(module, ours):
        return
    cls = type(module)
    new = _GRAFTS.get((cls, ours))
    if new is None:
        new = type(cls.__name__, (ours, cls), {"__module__": __name__, "__qualname__": cls.__qualname__,
                                               "_glm53_patched": True})
        _GRAFTS[(cls, ours)] = new
    module.__class__ = new


def _copy_attributes(module: nn.Module, ours: nn.Module, name: str) -> None:
    """The plain (non-tensor, non-module) attributes of this project's module onto the transformers one."""
    for key, value in vars(ours).items():
        if key.startswith("_") or key == "training":
            continue
        if key in module._modules or key in module._parameters or key in module._buffers:
            held = {**module._modules, **module._parameters, **module._buffers}[key]
            if value is None and held is None:
                continue
            raise ValueError(f"patch_transformers: {name or 'model'}.{key} is a {type(held).__name__} in transformers "
                             f"and {type(value).__name__} here")
        setattr(module, key, value)


def _patch_modules(text: nn.Module, config: GLM53Config, lm_head: nn.Module | None) -> None:
    """Graft every module of ``text`` (and ``lm_head``) that has a project counterpart."""
    with torch.device("meta"):
        reference = GLM53Model(config)
    theirs = dict(text.named_modules())
    if lm_head is not None:
        theirs["lm_head"] = lm_head
    for name, ours in reference.named_modules():
        if not name or (name == "lm_head" and lm_head is None):
            continue
        module = theirs.get(name)
        if module is None:
            raise ValueError(f"patch_transformers: the transformers model has no module {name!r} "
                             f"({type(ours).__name__} here)")
        if not type(ours).__module__.startswith("graphs."):  # a torch module: called as it is
            if not isinstance(module, type(ours)):
                raise ValueError(f"patch_transformers: {name} is a {type(module).__name__}, expected "
                                 f"{type(ours).__name__}")
            continue
        ours_params = {n for n, _ in ours.named_parameters(recurse=False)}
        their_params = {n for n, _ in module.named_parameters(recurse=False)}
        if ours_params != their_params:
            raise ValueError(f"patch_transformers: {name} holds parameters {sorted(their_params)}, this project's "
                             f"{type(ours).__name__} {sorted(ours_params)}")
        _graft(module, type(ours))
        _copy_attributes(module, ours, name)


def is_patched(model: nn.Module) -> bool:
    """Whether ``model`` was patched by :func:`patch_transformers`."""
    return bool(getattr(type(model), "_glm53_patched", False))


def patch_transformers(model: nn.Module, precision: PrecisionConfig | None = None, *, freeze_indexer: bool = False,
                       attn_impl: str = "eager") -> nn.Module:
    """Run a transformers ``glm5_next`` model on this project's layer code, in place.

    Args:
        model: ``Glm5NextForConditionalGeneration``, ``Glm5NextModel`` or ``Glm5NextTextModel`` (or a
            glm5_next ``ForCausalLM``, should transformers add one). Patch before wrapping it
            (activation checkpointing, ``torch.compile``, FSDP2).
        precision: the :class:`~inductor_ext.PrecisionConfig` every layer runs under; None reads the
            active config while tracing (``inductor_ext.precision(cfg)``), as :class:`GLM53Model`.
        freeze_indexer: set ``requires_grad=False`` on the KPool indexer's parameters (they get no
            gradient either way: the indexer returns integer ids).
        attn_impl: the sparse attention kernel of the decompressed MLA form (``GLM53Config.attn_impl``).

    Returns:
        ``model`` itself: every parameter, buffer and ``state_dict`` key unchanged (same objects),
        the forwards this project's. Patching again only updates ``precision`` and ``freeze_indexer``.

    Raises:
        ValueError: another architecture (named), a config the project cannot run
        (:meth:`GLM53Config.from_hf`), or a module tree that does not match ``GLM53Model``'s.
    """
    _check_architecture(model)
    precision = None if precision is None else resolve_precision(precision)
    text = _text_model(model)
    config = GLM53Config.from_hf(text.config, attn_impl=attn_impl)
    lm_head = getattr(model, "lm_head", None)
    _patch_modules(text, config, lm_head)
    _graft(text, _TextModel)
    text.precision = precision
    for layer in text.layers:
        layer.precision = precision
    for wrapper in (model, getattr(model, "model", None)):  # the multimodal Glm5NextModel, if any
        if isinstance(wrapper, _glm5_next().Glm5NextModel):
            _graft(wrapper, _Model)
    if lm_head is not None:
        _graft(model, _CausalLM)
        model.precision = precision
    for layer in text.layers:
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None and freeze_indexer:
            indexer.requires_grad_(False)
    return model
