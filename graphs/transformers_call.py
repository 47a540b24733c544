"""The transformers causal-LM call, shared by :class:`graphs.GLM53Model` and a transformers
``glm5_next`` model patched by :func:`graphs.patch_transformers` (``docs/DESIGN.md`` §7.1)::

    out = model(input_ids=ids,               # int64 [1, T] or [T]: documents packed, batch 1
                position_ids=pos,            # None (one document) or [1, T] / [T]: a document starts
                                             #   at token 0 and wherever pos == 0
                attention_mask=None,         # None or all ones (packing is by positions)
                labels=labels,               # None or ids' shape; -100 ignored; shifted like transformers
                use_cache=False, return_dict=True,
                cu_seqlens=None)             # or the document offsets [N+1] (int64, or int32 as flash-attn)
    out.logits, out.loss                     # transformers CausalLMOutputWithPast; loss FP32

Documents reach the layers as ``cu_seqlens``: every op that packs documents (``kda_chunk``,
``kpool_indexer``, the short convolution's positions) takes offsets ``[N+1]``, and N is data
dependent. ``position_ids`` are therefore turned into offsets on the host (one device-to-host copy),
in :func:`documents_from_positions`, which Dynamo never traces (``torch.compiler.disable``): with
the layers compiled one by one (torchtitan's order) the conversion runs before them; a model
compiled whole breaks its graph there once, and compiles with ``fullgraph=True`` when it gets
``cu_seqlens`` instead of ``position_ids`` (and no ``attention_mask``, whose all-ones check reads
the data too). A static-shape form (offsets padded to T+1 with empty documents) would make KDA
keep one ``[H, K, V]`` FP32 state per padding document: not done.

``transformers`` is imported only when an output is built (it is a test dependency of the project).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphs.modules import linear

__all__ = ["IGNORE_INDEX", "check_input_ids", "check_options", "resolve_documents", "documents_from_positions",
           "causal_lm_loss", "causal_lm_call"]

IGNORE_INDEX = -100
# flash-attn keywords transformers' packing collators send: the offsets are taken, the lengths not needed
_FLASH_OFFSETS = ("cu_seq_lens_q", "cu_seq_lens_k")
_FLASH_IGNORED = ("max_length_q", "max_length_k")


def check_input_ids(input_ids: torch.Tensor, vocab_size: int | None = None) -> None:
    """``input_ids`` int64 ``[T]`` or ``[1, T]`` (packed documents: batch 1); with ``vocab_size``, in
    eager mode (the ids are read: a host synchronisation) every id in ``[0, vocab_size)``, which a
    compiled forward does not check (the embedding's lookup then fails or reads out of range)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.int64 or input_ids.dim() not in (1, 2) \
            or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
        got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else \
            type(input_ids).__name__
        raise ValueError(f"GLM53Model: input_ids must be int64 [T] or [1, T] (packed), got {got}")
    tracing = torch.compiler.is_compiling() or isinstance(input_ids, torch._subclasses.FakeTensor) or \
        (input_ids.is_cuda and torch.cuda.is_current_stream_capturing())
    if vocab_size is not None and not tracing and input_ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(input_ids))
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"GLM53Model: input_ids must be in [0, vocab_size={vocab_size}), got values in "
                             f"[{lo}, {hi}]")


def check_options(use_cache=None, cache=None, inputs_embeds=None, extra: dict | None = None) -> None:
    """The transformers options the training forward does not have: ``use_cache=True``, a cache,
    ``inputs_embeds``; any other keyword in ``extra`` must be unset (None, False or 0)."""
    if use_cache:
        raise ValueError("GLM53: use_cache=True is not supported: the training forward keeps no cache "
                         "(generation: graphs.decode)")
    if cache is not None:
        raise ValueError("GLM53: past_key_values / cache are not supported: the training forward keeps no cache")
    if inputs_embeds is not None:
        raise ValueError("GLM53: inputs_embeds is not supported: pass input_ids")
    for name, value in (extra or {}).items():
        if name in _FLASH_IGNORED or value is None or value is False or (type(value) is int and value == 0):
            continue
        raise ValueError(f"GLM53: keyword {name}={_describe(value)} is not supported by the training forward")


def _describe(value) -> str:
    return f"<tensor {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)


def _flat_tokens(name: str, t, num_tokens: int) -> torch.Tensor:
    """``t`` as ``[T]``: a tensor of ``[T]`` or ``[1, T]``."""
    if not isinstance(t, torch.Tensor) or t.dim() not in (1, 2) or (t.dim() == 2 and t.shape[0] != 1) \
            or t.shape[-1] != num_tokens:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"GLM53: {name} must be [T] or [1, T] with T = {num_tokens} (packed, batch 1), got {got}")
    return t.reshape(-1)


def _offsets(cu_seqlens) -> torch.Tensor:
    """Document offsets as int64 (int32 is flash-attn's convention: converted on their device, no host
    sync; the layers check the device)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64) \
            or cu_seqlens.dim() != 1:
        got = f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor) else \
            type(cu_seqlens).__name__
        raise ValueError(f"GLM53: cu_seqlens must be a 1-D int64 (or int32) tensor of N+1 offsets, got {got}")
    return cu_seqlens.to(torch.int64)


@torch.compiler.disable(reason="GLM53: the attention_mask check reads the data (a host sync): compiling the whole "
                               "model with fullgraph=True, pass no attention_mask")
def check_attention_mask(attention_mask, num_tokens: int) -> None:
    """``attention_mask`` must be all ones (reads the data: never traced)."""
    mask = _flat_tokens("attention_mask", attention_mask, num_tokens)
    if not bool(mask.bool().all()):
        raise ValueError("GLM53: attention_mask must be None or all ones: documents are packed (batch 1) and "
                         "separated by position_ids (a document starts where position_ids == 0) or cu_seqlens, "
                         "not by a padding mask")


@torch.compiler.disable(reason="GLM53: position_ids -> cu_seqlens reads the data (a host sync): compiling the "
                               "whole model with fullgraph=True, pass cu_seqlens instead")
def documents_from_positions(position_ids, num_tokens: int, device) -> torch.Tensor:
    """Offsets ``[N+1]`` int64 of the documents of packed ``position_ids``: a document starts at token
    0 and wherever ``position_ids == 0``; inside a document positions count up by one. Reads the
    data (one device-to-host copy): never traced, so call it before compiled layers."""
    pos = _flat_tokens("position_ids", position_ids, num_tokens)
    if pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
        raise ValueError(f"GLM53: position_ids must be integers, got {pos.dtype}")
    host = pos.to("cpu", torch.int64)
    starts = host == 0
    if not bool(starts[0]):
        raise ValueError(f"GLM53: packing is by position_ids: the first token must have position 0, got {int(host[0])}")
    steps = host[1:] == host[:-1] + 1
    bad = ~(starts[1:] | steps)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0]) + 1
        raise ValueError(f"GLM53: position_ids must count up by one inside a document and restart at 0 at the next "
                         f"(packing is by positions); token {t} has {int(host[t])} after {int(host[t - 1])}")
    offsets = torch.cat([starts.nonzero()[:, 0], torch.tensor([num_tokens])])
    return offsets.to(device)


def resolve_documents(num_tokens: int, device, cu_seqlens=None, position_ids=None, attention_mask=None,
                      extra: dict | None = None) -> torch.Tensor | None:
    """The documents of a call as int64 offsets ``[N+1]``, or None for one document.

    ``cu_seqlens`` (or flash-attn's ``cu_seq_lens_q`` / ``cu_seq_lens_k`` in ``extra``, taken out of
    it) wins over ``position_ids``, which are then not read; otherwise ``position_ids`` give them
    (:func:`documents_from_positions`). ``attention_mask``: None or all ones."""
    extra = {} if extra is None else extra
    flash = [extra.pop(k) for k in _FLASH_OFFSETS if extra.get(k) is not None]
    if cu_seqlens is None and flash:
        cu_seqlens = flash[0]
    if attention_mask is not None:
        check_attention_mask(attention_mask, num_tokens)
    if cu_seqlens is not None:
        return _offsets(cu_seqlens)
    if position_ids is None:
        return None
    return documents_from_positions(position_ids, num_tokens, device)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """transformers' causal-LM loss: ``logits[..., t, :]`` predicts ``labels[..., t+1]`` (labels padded
    with -100 and shifted left), -100 ignored, cross-entropy in FP32, the mean over the other tokens
    (or their sum / ``num_items_in_batch``, transformers' gradient-accumulation form). Packed
    documents: the last token of a document predicts the first label of the next one, as in
    transformers; label a document's first token -100 to leave that pair out."""
    if not isinstance(labels, torch.Tensor) or labels.shape != logits.shape[:-1] or labels.is_floating_point():
        got = f"{labels.dtype} {tuple(labels.shape)}" if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"GLM53: labels must be integer token ids of input_ids' shape {tuple(logits.shape[:-1])}, "
                         f"got {got}")
    shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).to(logits.device)
    source = logits.float().reshape(-1, logits.shape[-1])
    if num_items_in_batch is None:
        return F.cross_entropy(source, shift, ignore_index=IGNORE_INDEX, reduction="mean")
    return F.cross_entropy(source, shift, ignore_index=IGNORE_INDEX, reduction="sum") / num_items_in_batch


def causal_lm_call(final_hidden, lm_head: torch.nn.Linear, prec, input_ids, *, cu_seqlens=None, position_ids=None,
                   attention_mask=None, labels=None, use_cache=None, return_dict=None, output_hidden_states=False,
                   cp=None, cache=None, inputs_embeds=None, **extra):
    """One transformers call: documents from the arguments, ``final_hidden(input_ids, cu_seqlens,
    prec, cp=cp)`` → ``(hidden [T, D], streams per layer)``, the lm_head (batch-invariant with
    ``prec.batch_invariant``), the loss. Returns ``CausalLMOutputWithPast`` (logits of
    ``input_ids``' leading dims, model dtype; ``hidden_states``: the mHC streams after every layer
    with ``output_hidden_states``), or its ``to_tuple()`` with ``return_dict=False``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    check_options(use_cache, cache if cache is not None else extra.pop("past_key_values", None), inputs_embeds)
    check_input_ids(input_ids, lm_head.weight.shape[0])
    num_items = extra.pop("num_items_in_batch", None)
    cu = resolve_documents(input_ids.numel(), input_ids.device, cu_seqlens, position_ids, attention_mask, extra)
    check_options(extra=extra)
    if cp is not None and (labels is not None or cu is not None):
        raise ValueError("GLM53: with cp pass the documents to cp_context and score local tokens with "
                         "token_logprobs (the label shift crosses ranks); no labels, cu_seqlens or position_ids")
    final, streams = final_hidden(input_ids, cu, prec, cp=cp)
    logits = linear(lm_head, final, prec).view(*input_ids.shape, -1)
    loss = None if labels is None else causal_lm_loss(logits, labels, num_items)
    hidden = tuple(s.view(*input_ids.shape, *s.shape[1:]) for s in streams) if output_hidden_states else None
    out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=hidden)
    return out.to_tuple() if return_dict is False else out
