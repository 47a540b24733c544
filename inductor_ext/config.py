"""Compile-time precision configuration.

A :class:`PrecisionConfig` says, per GLM-5.3 precision path, whether training keeps the
transformers ``glm5_next`` numerics (``reference()``) or the serving engine's
(``serving_aligned()``). It is read while Dynamo traces and becomes a literal in the graph
(an op's ``precision`` string argument), so a config change recompiles and the same config
never does. Nothing here is read inside a forward: :meth:`PrecisionConfig.from_env` reads the
environment once, when the user calls it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping

from inductor_ext import validation as v

__all__ = [
    "CHOICES",
    "KDA_PRECISIONS",
    "KPOOL_PRECISIONS",
    "KPOOL_POOLINGS",
    "HEAD_PROJ_PRECISIONS",
    "MHC_POST_PRECISIONS",
    "SWIGLU_MODES",
    "MOE_ACT_MODES",
    "MQA_LAYOUTS",
    "MLA_FORMS",
    "PrecisionConfig",
    "precision",
    "active_config",
]

# The precision vocabulary, defined here once: each op family imports its tuple. The first value of
# each is the transformers glm5_next reference semantics.
KDA_PRECISIONS = ("bf16", "fp32")
KPOOL_PRECISIONS = ("bf16", "fp8")
KPOOL_POOLINGS = ("reference", "fp32")
HEAD_PROJ_PRECISIONS = ("model", "fp32")
MHC_POST_PRECISIONS = ("bf16", "fp32")
SWIGLU_MODES = ("native", "serving")
MOE_ACT_MODES = ("none", "fp8_ue8m0", "fp8_fp32scale")
MQA_LAYOUTS = ("compact", "legacy")
MLA_FORMS = ("decompressed", "absorbed")

# PrecisionConfig field -> its allowed values
CHOICES: dict[str, tuple[str, ...]] = {
    "kda": KDA_PRECISIONS,
    "kpool": KPOOL_PRECISIONS,
    "kpool_pooling": KPOOL_POOLINGS,
    "head_proj": HEAD_PROJ_PRECISIONS,
    "mhc_post": MHC_POST_PRECISIONS,
    "swiglu": SWIGLU_MODES,
    "moe_act": MOE_ACT_MODES,
    "mqa_layout": MQA_LAYOUTS,
    "mla": MLA_FORMS,
}

# the seed training stack's start-up variables, read by from_env() only
_ENV_FLAGS = (
    "XTUNER_GLM53_KDA_FP32",
    "XTUNER_GLM53_KPOOL_BF16",
    "XTUNER_GLM53_LMDEPLOY_SWIGLU",
    "FP8",
)


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Which numerics each GLM-5.3 precision path uses; frozen, hashable, validated.

    Fields (first value = transformers ``glm5_next`` reference semantics):

    - ``kda``: ``"bf16"`` | ``"fp32"`` — KDA chunk intermediates (normalized q/k, chunk solve,
      WY factors, states, backward recomputation).
    - ``kpool``: ``"bf16"`` | ``"fp8"`` — indexer pool storage and scoring precision.
    - ``kpool_pooling``: ``"reference"`` | ``"fp32"`` — BF16 pools: round probabilities and
      products to BF16, or keep them FP32 until the store.
    - ``head_proj``: ``"model"`` | ``"fp32"`` — indexer head-gate projection and key LayerNorm
      in FP32 (autocast-safe).
    - ``mhc_post``: ``"bf16"`` | ``"fp32"`` — mHC stream expansion in FP32, rounded once.
    - ``swiglu``: ``"native"`` | ``"serving"`` — serving = FP32 ``g/(1+exp(-g))*u``, one rounding.
    - ``moe_act``: ``"none"`` | ``"fp8_ue8m0"`` | ``"fp8_fp32scale"`` — quantize-dequantize of MoE
      expert inputs and post-SwiGLU activations per 128 group.
    - ``mqa_layout``: ``"compact"`` | ``"legacy"`` — MQA scorer logits layout (sizes the workspace).
    - ``logits_budget_mb``: positive int — bound on the scorer's logits storage in MiB.
    - ``mla``: ``"decompressed"`` | ``"absorbed"`` — DSA attention form: per-head keys and values
      from ``kv_b_proj`` (transformers) or the serving form (the query absorbed into the latent,
      the latent shared by all heads as key and value, ``glm53::sparse_mla``).
    - ``batch_invariant``: bool — every reduction whose order could depend on how many rows share
      a call runs a batch-invariant kernel (``glm53::bi_*``: linears, norms, the vocabulary
      log-softmax, the router, the MoE experts, the indexer's scorer), and the KDA serving decode
      replays the chunk arithmetic (``docs/DESIGN.md`` §9). Needs ``mla="absorbed"``. ``False``
      in both presets.

    Bad values raise ``ValueError`` naming the field and the allowed values.
    """

    kda: str = "bf16"
    kpool: str = "bf16"
    kpool_pooling: str = "reference"
    head_proj: str = "model"
    mhc_post: str = "bf16"
    swiglu: str = "native"
    moe_act: str = "none"
    mqa_layout: str = "compact"
    logits_budget_mb: int = 256
    mla: str = "decompressed"
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        v.check_fields(self, "PrecisionConfig.", _RULES)
        if self.batch_invariant and self.mla != "absorbed":
            raise ValueError("PrecisionConfig.batch_invariant=True needs mla='absorbed' (the decompressed form's "
                             f"[T, T] mask kernels have no batch-invariant variant), got mla={self.mla!r}")

    @classmethod
    def reference(cls) -> PrecisionConfig:
        """transformers ``glm5_next`` semantics: every path BF16 / model dtype."""
        return cls()

    @classmethod
    def serving_aligned(cls) -> PrecisionConfig:
        """Every path aligned to the serving engine (FP8 indexer, FP32 KDA/mHC/SwiGLU, FP8 MoE acts,
        absorbed MLA)."""
        return cls(
            kda="fp32",
            kpool="fp8",
            kpool_pooling="fp32",
            head_proj="fp32",
            mhc_post="fp32",
            swiglu="serving",
            moe_act="fp8_ue8m0",
            mla="absorbed",
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PrecisionConfig:
        """Build a config from the seed stack's start-up variables, read once, now.

        Starts from :meth:`reference` and applies, for each variable that is set:

        - ``XTUNER_GLM53_KDA_FP32=1`` → ``kda="fp32"``
        - ``XTUNER_GLM53_KPOOL_BF16=1`` → BF16 pools with FP32 pooling and FP32 head projection;
          ``=0`` → the FP8 serving indexer (``kpool="fp8"``, FP32 head projection)
        - ``XTUNER_GLM53_LMDEPLOY_SWIGLU=1`` → ``swiglu="serving"``
        - ``FP8=1`` → ``moe_act="fp8_ue8m0"``

        A value other than ``"0"`` or ``"1"`` raises ``ValueError``. Meant for migrating launch
        scripts; models should hold an explicit config.
        """
        env = os.environ if environ is None else environ
        flags: dict[str, bool] = {}
        for name in _ENV_FLAGS:
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            if raw not in ("0", "1"):
                raise ValueError(f"environment variable {name} must be '0' or '1', got {raw!r}")
            flags[name] = raw == "1"
        changes: dict[str, str] = {}
        if flags.get("XTUNER_GLM53_KDA_FP32"):
            changes["kda"] = "fp32"
        if "XTUNER_GLM53_KPOOL_BF16" in flags:
            if flags["XTUNER_GLM53_KPOOL_BF16"]:
                changes.update(kpool="bf16", kpool_pooling="fp32", head_proj="fp32")
            else:
                changes.update(kpool="fp8", head_proj="fp32")
        if flags.get("XTUNER_GLM53_LMDEPLOY_SWIGLU"):
            changes["swiglu"] = "serving"
        if flags.get("FP8"):
            changes["moe_act"] = "fp8_ue8m0"
        return dataclasses.replace(cls.reference(), **changes)

    def replace(self, **changes: object) -> PrecisionConfig:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    def toggles(self) -> dict[str, PrecisionConfig]:
        """Every config that differs from this one in exactly one choice field, keyed ``field=value``."""
        out = {}
        for name, allowed in CHOICES.items():
            for value in allowed:
                if value != getattr(self, name):
                    out[f"{name}={value}"] = self.replace(**{name: value})
        return out


# every field's rule (inductor_ext.validation): the choices, a positive int budget, a bool
_RULES = {**{name: v.one_of(allowed) for name, allowed in CHOICES.items()},
          "logits_budget_mb": v.integer(1), "batch_invariant": v.boolean()}


class _Active:
    """Holder of the active config; a plain attribute so Dynamo guards on it while tracing."""

    config: PrecisionConfig = PrecisionConfig.reference()


def active_config() -> PrecisionConfig:
    """The config selected by the innermost :func:`precision` block (``reference()`` outside any)."""
    return _Active.config


@contextlib.contextmanager
def precision(config: PrecisionConfig) -> Iterator[PrecisionConfig]:
    """Select ``config`` for code traced or run inside the block.

    Ops called with ``precision=None`` read the active config while Dynamo traces, so the choice
    becomes a literal in the compiled graph and is guarded: calling a compiled function under a
    different config recompiles once; under the same config it never recompiles.
    """
    if not isinstance(config, PrecisionConfig):
        raise ValueError(f"precision() takes a PrecisionConfig, got {type(config).__name__}")
    previous = _Active.config
    _Active.config = config
    try:
        yield config
    finally:
        _Active.config = previous
