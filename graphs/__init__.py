"""GLM-5.3 layers and the reduced causal LM, written to compile into one graph.

Public surface::

    from graphs import GLM53Config, GLM53Model
    cfg = GLM53Config.tiny()                   # .h200(), .from_hf(hf_text_config)
    model = GLM53Model(cfg, precision=PrecisionConfig.serving_aligned()).to_dtype(torch.bfloat16)
    model = GLM53Model.from_hf(hf_model_or_state_dict, config=None, precision=None)
    torch.compile(model, fullgraph=True)(input_ids, cu_seqlens)   # one graph for every length
    ids, cu, n = pad_to_bucket(input_ids, cu_seqlens, 256)          # few lengths, for CUDA graphs
    out = model(input_ids=ids, position_ids=pos, labels=labels)   # transformers call: .logits, .loss
    hf_model = patch_transformers(hf_model, precision=None)      # a transformers glm5_next model, in place
    shard_fsdp2(hf_model, mesh)                                  # FSDP2 after checkpointing + compiling layers

``graphs.signature`` records the op sequence of the compiled graphs; the recorded signatures live
in ``tests/graphs/signatures/``.
"""

from graphs.buckets import pad_to_bucket
from graphs.config import GLM53Config
from graphs.dsa_layer import IndexedAttention, Indexer
from graphs.kda_layer import LinearAttention
from graphs.model import DecoderLayer, GLM53Model
from graphs.modules import MLP, HyperConnection, MoE, RMSNorm
from graphs.sparse_attention import sparse_attention

__all__ = ["GLM53Config", "GLM53Model", "DecoderLayer", "LinearAttention", "IndexedAttention", "Indexer",
           "MLP", "MoE", "HyperConnection", "RMSNorm", "sparse_attention", "pad_to_bucket"]

from graphs.fsdp import shard_fsdp2  # noqa: E402
from graphs.serving import ServingForward  # noqa: E402
from graphs.transformers_patch import patch_transformers  # noqa: E402

__all__ += ["ServingForward", "patch_transformers", "shard_fsdp2"]
