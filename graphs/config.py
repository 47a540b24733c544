"""Architecture of the GLM-5.3 layers in ``graphs/``: a frozen dataclass with named presets.

Field names follow transformers ``Glm5NextTextConfig`` so :meth:`GLM53Config.from_hf` is a plain
copy. Precision is not here: it lives in :class:`inductor_ext.PrecisionConfig`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from inductor_ext import validation as v

__all__ = ["GLM53Config", "ATTN_IMPLS"]

ATTN_IMPLS = ("eager", "flex")  # sparse attention: dense masked math (CPU path) | FlexAttention block mask
_LAYER_TYPES = ("linear_attention", "indexed_attention")
_MLP_TYPES = ("dense", "sparse")
_INDEXER_TYPES = ("full", "shared")
_INDEXER_HEADS = (32, 64, 128)  # MQA scorer row blocks (inductor_ext.workspace.SUPPORTED_HEADS)
_INDEX_HEAD_DIM = 128  # inductor_ext.ops.kpool_reference.HEAD_DIM
_KDA_MAX_HEAD_DIM = 256  # inductor_ext.ops.kda_reference.MAX_HEAD_DIM (kda_chunk)


@dataclasses.dataclass(frozen=True)
class GLM53Config:
    """GLM-5.3 text model shape (transformers ``Glm5NextTextConfig`` field names).

    Layer schedules are tuples: ``layer_types`` ("linear_attention" = KDA, "indexed_attention" =
    DSA), ``mlp_layer_types`` ("dense" | "sparse" = MoE), ``indexer_types`` ("full" runs the
    indexer, "shared" reuses the previous DSA layer's token ids; only read on DSA layers).
    ``attn_impl`` picks the sparse attention kernel ("eager" CPU/reference math or "flex").
    Bad values raise ``ValueError`` naming the constraint.
    """

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 256
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    attention_bias: bool = False
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    linear_num_heads: int = 2
    linear_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 4  # tiny only (h200: 20): mhc_pre's backward traces ~16 aten ops per iteration
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 16
    index_kpool: int = 4
    index_kpool_always_select_tail: bool = True
    layer_types: tuple[str, ...] = ("linear_attention", "indexed_attention", "indexed_attention")
    mlp_layer_types: tuple[str, ...] = ("sparse", "dense", "sparse")
    indexer_types: tuple[str, ...] = ("full", "full", "shared")
    tie_word_embeddings: bool = False
    attn_impl: str = "eager"

    def __post_init__(self) -> None:
        v.check_fields(self, "GLM53Config.", _RULES)
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            if len(getattr(self, name)) != self.num_hidden_layers:
                raise ValueError(f"GLM53Config.{name} must have num_hidden_layers={self.num_hidden_layers} "
                                 f"entries, got {len(getattr(self, name))}")
        # the KPool indexer's own rule (inductor_ext.ops.kpool.check_pool_geometry): pool_size divides topk
        if self.index_topk % self.index_kpool:
            raise ValueError(f"GLM53Config.index_topk ({self.index_topk}) must be a multiple of "
                             f"index_kpool ({self.index_kpool})")
        # the router scores a group by its two best experts: groups of at least 2
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ValueError(f"GLM53Config.n_routed_experts ({self.n_routed_experts}) must split into n_group "
                             f"({self.n_group}) groups of at least 2 experts")
        if self.topk_group > self.n_group:
            raise ValueError(f"GLM53Config.topk_group must be in 1..n_group={self.n_group}, got {self.topk_group}")
        reachable = self.n_routed_experts // self.n_group * self.topk_group
        if self.num_experts_per_tok > reachable:
            raise ValueError(f"GLM53Config.num_experts_per_tok ({self.num_experts_per_tok}) must not exceed the "
                             f"experts of topk_group groups ({reachable})")
        for i, (kind, idx) in enumerate(zip(self.layer_types, self.indexer_types)):
            if kind != "indexed_attention" or idx != "shared":
                continue
            if i == 0 or self.layer_types[i - 1] != "indexed_attention" or self.indexer_types[i - 1] != "full":
                raise ValueError(f"GLM53Config: shared-indexer layer {i} must follow a DSA layer with a full indexer")

    def first_layer(self, kind: str) -> int:
        """Index of the first ``"kda"`` layer, or of the first ``"dsa"`` layer with its own indexer."""
        for i, (layer, indexer) in enumerate(zip(self.layer_types, self.indexer_types)):
            if (kind == "kda" and layer == "linear_attention") or (
                    kind == "dsa" and layer == "indexed_attention" and indexer == "full"):
                return i
        raise ValueError(f"GLM53Config has no {kind!r} layer (kind is 'kda' or 'dsa')")

    @classmethod
    def tiny(cls, **changes) -> GLM53Config:
        """3 layers (KDA+MoE, DSA full+dense MLP, DSA shared+MoE), hidden 128: runs forward
        and backward on a 2-core CPU in seconds. Widths that the ops constrain are real: indexer
        32×128, MoE widths multiples of 128 (FP8 groups)."""
        return dataclasses.replace(cls(), **changes)

    @classmethod
    def h200(cls, **changes) -> GLM53Config:
        """Production-shaped widths (DESIGN §5): hidden 4096, KDA 64×128, MLA 64 heads (nope/v 256),
        indexer 32×128 with topk 2048 and pool 4, 288 experts top-8. Two layers (one KDA + dense,
        one DSA + MoE) keep the graph small; compile tests run it on fake tensors. ``attn_impl="flex"``
        selects FlexAttention (its backward needs CUDA)."""
        base = dict(
            vocab_size=154880, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
            num_hidden_layers=2, num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=256, v_head_dim=256, n_routed_experts=288, num_experts_per_tok=8, n_group=1,
            topk_group=1, linear_num_heads=64, linear_head_dim=128, index_topk=2048, index_kpool=4,
            layer_types=("linear_attention", "indexed_attention"), mlp_layer_types=("dense", "sparse"),
            indexer_types=("full", "full"), hc_sinkhorn_iters=20,
        )
        base.update(changes)
        return cls(**base)

    @classmethod
    def h200_stack(cls, **changes) -> GLM53Config:
        """:meth:`h200` widths, 3 KDA layers + 1 DSA layer (the first MLP dense, the others MoE with 32
        routed experts, top-8), FlexAttention for the sparse attention: the CUDA model of the mismatch
        ablation and of ``bench invariance``'s decode step."""
        base = dict(num_hidden_layers=4, layer_types=("linear_attention",) * 3 + ("indexed_attention",),
                    mlp_layer_types=("dense", "sparse", "sparse", "sparse"), indexer_types=("full",) * 4,
                    n_routed_experts=32, attn_impl="flex")
        base.update(changes)
        return cls.h200(**base)

    @classmethod
    def from_hf(cls, hf_config, **changes) -> GLM53Config:
        """Build from a transformers ``Glm5NextTextConfig`` (or ``Glm5NextConfig``: its
        ``text_config``) or a dict of its fields; ``changes`` override (e.g. ``attn_impl``)."""
        _check_hf_model_type(hf_config)
        if hasattr(hf_config, "text_config") and hf_config.text_config is not None:
            hf_config = hf_config.text_config
            _check_hf_model_type(hf_config)
        get = hf_config.get if isinstance(hf_config, Mapping) else (lambda k, d=None: getattr(hf_config, k, d))
        if get("qk_rope_head_dim", 0):
            raise ValueError(f"GLM53Config.from_hf: DSA layers are NoPE, qk_rope_head_dim must be 0, "
                             f"got {get('qk_rope_head_dim')}")
        if get("num_key_value_heads", None) not in (None, get("num_attention_heads")):
            raise ValueError("GLM53Config.from_hf: num_key_value_heads must equal num_attention_heads")
        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"GLM53Config.from_hf: hidden_act must be 'silu', got {get('hidden_act')!r}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"attn_impl"}
        values = {name: get(name) for name in fields if get(name) is not None}
        if get("linear_lower_bound", 0) is None:
            values["linear_lower_bound"] = None
        values.update(changes)
        return cls(**values)

    def to_hf_dict(self) -> dict:
        """The transformers ``Glm5NextTextConfig`` keyword arguments of this shape."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.pop("attn_impl")
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            out[name] = list(out[name])
        out.update(qk_rope_head_dim=0, num_key_value_heads=self.num_attention_heads, head_dim=0, pad_token_id=None)
        return out


# the transformers model types from_hf reads: Glm5NextConfig and its text config
_HF_MODEL_TYPES = ("glm5_next", "glm5_next_text")


def _check_hf_model_type(hf_config) -> None:
    """``ValueError`` naming the model type (and architectures) of a config that is not glm5_next's;
    a dict without ``model_type`` passes (its fields are checked by the dataclass)."""
    get = hf_config.get if isinstance(hf_config, Mapping) else (lambda k, d=None: getattr(hf_config, k, d))
    model_type = get("model_type", None)
    if model_type is not None and model_type not in _HF_MODEL_TYPES:
        arch = get("architectures", None)
        raise ValueError(f"GLM53Config.from_hf: expects a transformers glm5_next config (model_type one of "
                         f"{_HF_MODEL_TYPES}), got model_type {model_type!r}"
                         + (f" (architectures {list(arch)})" if arch else "") + f" ({type(hf_config).__name__})")

# every field's rule (inductor_ext.validation); the rules between fields are in __post_init__
_POS, _BOOL = v.integer(1), v.boolean()
_RULES = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
                     "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "linear_num_heads",
                     "linear_conv_kernel_dim", "hc_mult", "hc_sinkhorn_iters", "index_topk", "index_kpool"), _POS),
    **dict.fromkeys(("attention_bias", "norm_topk_prob", "index_kpool_always_select_tail", "tie_word_embeddings"),
                    _BOOL),
    "n_shared_experts": v.integer(0),  # 0: no shared expert (a zero-width MLP adds 0)
    "linear_head_dim": v.integer(1, _KDA_MAX_HEAD_DIM),
    "routed_scaling_factor": v.real(gt=0), "rms_norm_eps": v.real(gt=0), "swiglu_limit": v.real(gt=0),
    "linear_lower_bound": v.optional(v.real(lt=0)),  # the log-decay g = bound·sigmoid(·) must be < 0
    "hc_eps": v.real(ge=0),  # mhc_pre's rule: hc_eps >= 0
    "index_n_heads": v.one_of(_INDEXER_HEADS), "index_head_dim": v.one_of((_INDEX_HEAD_DIM,)),
    "layer_types": v.sequence(v.one_of(_LAYER_TYPES), min_len=1),
    "mlp_layer_types": v.sequence(v.one_of(_MLP_TYPES), min_len=1),
    "indexer_types": v.sequence(v.one_of(_INDEXER_TYPES), min_len=1),
    "attn_impl": v.one_of(ATTN_IMPLS),
}
