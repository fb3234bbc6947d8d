"""`ModelArgs`: the architecture of a decoder, read from a CMF header or a bundle config.

Every size the model uses comes from here, so a traced forward never reads a shape.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models.errors import ModelConfigError

# arch_name -> family module in pipeline.ground.models; anything else is refused by name.
FAMILY_OF_ARCH = {
    "llama": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "gemma": "gemma",
    "gemma3": "gemma3",
    "qwen2_moe": "qwen3_moe",
    "qwen3_moe": "qwen3_moe",
}
# Files from the reference CMF writer carry no hidden_act: the family's activation is implied.
FAMILY_ACTIVATION = {"llama": "silu", "qwen3_moe": "silu", "gemma": "gelu_pytorch_tanh",
                     "gemma3": "gelu_pytorch_tanh"}
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")
NORM_STYLES = ("qwen", "gemma")
# The layer types a CMF may name (the vocabulary hf_config maps to); which of them a runtime
# runs is the runtime's to say. Any other entry is refused here, by name.
LAYER_TYPES = ("FullAttention", "SlidingAttention", "LinearAttention")
# Tanh caps on logits or scores (Gemma 2): no decoder here implements them, so a value is refused.
SOFTCAPS = ("final_logit_softcapping", "attn_logit_softcapping")
# Arch keys a family always means (with the layer type that needs them; None: every file).
# Without them a decoder on any runtime would fall back to a general default, head_dim ** -0.5
# or the one RoPE base, which is another model: Gemma 3's query scalar is not always its
# head_dim (the 27B's), and its sliding layers have their own RoPE base.
FAMILY_KEYS = {"gemma3": {"query_pre_attn_scalar": None, "rope_local_base_freq": "SlidingAttention"}}
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class MoeArgs:
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int | None = None


# What apps ship (Apple's stateful Llama recipe, ANEMLL, Core AI: 512-4096 tokens), and what
# a default build costs: at SmolLM2's own limit of 8192, chunk-KV's conversion alone took 14
# minutes (issue 50).
DEPLOYED_CONTEXT = 2048


@dataclass(frozen=True)
class ModelArgs:
    arch_name: str
    hidden_size: int
    intermediate_size: int  # the maximum: pruned files carry per-layer widths in their shapes
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    norm_style: str
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    hidden_act: str
    rope_scaling: Mapping[str, Any] | None = None
    moe: MoeArgs | None = None
    # A SlidingAttention query at position i sees keys j with i - window < j <= i.
    sliding_window: int | None = None
    # The SlidingAttention layers' RoPE base, unscaled (rope_theta and rope_scaling are the
    # FullAttention layers'); None: every layer shares rope_theta.
    rope_local_base_freq: float | None = None
    # Queries are scaled by query_pre_attn_scalar ** -0.5; None: by head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None

    @property
    def deployed_context(self) -> int:
        """The context a package, its preflight and its fixtures are built for when none is
        asked: DEPLOYED_CONTEXT, or the model's own limit where that is smaller."""
        return min(DEPLOYED_CONTEXT, self.max_position_embeddings)

    @property
    def family(self) -> str:
        return FAMILY_OF_ARCH[self.arch_name]

    @classmethod
    def from_header(cls, header: Mapping[str, Any], source: str = "header") -> "ModelArgs":
        """Read a CMF header (`arch` + top-level `moe`) or a bundle config.json of the same keys.

        A flat dict (no `arch` key) is read as the arch block itself. `source` names the file
        in error messages.
        """
        arch = header["arch"] if "arch" in header else header
        if not isinstance(arch, Mapping):
            raise ModelConfigError(f"{source}: field arch is {arch!r}, not an object")
        field = _FieldReader(arch, f"{source}: arch")
        arch_name = field.get("arch_name", str)
        if arch_name not in FAMILY_OF_ARCH:
            raise UnsupportedModel(
                f"{source}: arch.arch_name {arch_name!r} is not a supported family "
                f"(supported: {', '.join(sorted(FAMILY_OF_ARCH))})"
            )
        # Keys the reference writer always emits, checked so a file we cannot run says so by name.
        if field.optional("partial_rotary_factor", (int, float), 1.0) != 1.0:
            raise UnsupportedModel(
                f"{source}: arch.partial_rotary_factor {arch['partial_rotary_factor']!r} is not supported"
            )
        if (field.optional("num_loops", int, 1) or 1) > 1:
            raise UnsupportedModel(f"{source}: arch.num_loops {arch['num_loops']!r} (looped layers) is not supported")
        hidden_act = field.optional("hidden_act", str, FAMILY_ACTIVATION[FAMILY_OF_ARCH[arch_name]])
        if hidden_act not in ACTIVATIONS:
            raise UnsupportedModel(f"{source}: arch.hidden_act {hidden_act!r} is not one of {ACTIVATIONS}")
        norm_style = field.get("norm_style", str)
        if norm_style not in NORM_STYLES:
            raise ModelConfigError(f"{source}: arch.norm_style {norm_style!r} is not one of {NORM_STYLES}")
        num_layers = field.get("num_layers", int)
        layer_types = tuple(field.get("layer_types", list))
        if len(layer_types) != num_layers:
            raise ModelConfigError(
                f"{source}: arch.layer_types has {len(layer_types)} entries for num_layers {num_layers}"
            )
        for index, layer_type in enumerate(layer_types):
            if layer_type not in LAYER_TYPES:
                raise UnsupportedModel(
                    f"{source}: arch.layer_types[{index}] {layer_type!r} is not one of {LAYER_TYPES}")
        for key in SOFTCAPS:
            if arch.get(key) is not None:
                raise UnsupportedModel(f"{source}: arch.{key} {arch[key]!r} (tanh softcapping) is not supported")
        sliding_window = field.optional("sliding_window", int, None)
        if "SlidingAttention" in layer_types and sliding_window is None:
            raise ModelConfigError(f"{source}: arch.sliding_window is missing (arch.layer_types has SlidingAttention)")
        if sliding_window is not None and sliding_window < 1:
            raise ModelConfigError(f"{source}: arch.sliding_window {sliding_window!r} is not a positive size")
        rope_local_base_freq = field.optional("rope_local_base_freq", (int, float), None)
        query_pre_attn_scalar = field.optional("query_pre_attn_scalar", (int, float), None)
        family = FAMILY_OF_ARCH[arch_name]
        for key, layer_type in FAMILY_KEYS.get(family, {}).items():
            if arch.get(key) is None and (layer_type is None or layer_type in layer_types):
                raise ModelConfigError(f"{source}: arch.{key} is missing ({family} needs it)")
        moe = header.get("moe") or arch.get("moe")  # top-level per spec §2.2; some writers nest it
        return cls(
            arch_name=arch_name,
            hidden_size=field.get("hidden_size", int),
            intermediate_size=field.get("intermediate_size", int),
            num_layers=num_layers,
            num_attention_heads=field.get("num_attention_heads", int),
            num_kv_heads=field.get("num_kv_heads", int),
            head_dim=field.get("head_dim", int),
            vocab_size=field.get("vocab_size", int),
            layer_types=layer_types,
            rms_norm_eps=float(field.get("rms_norm_eps", (int, float))),
            norm_style=norm_style,
            rope_theta=float(field.get("rope_theta", (int, float))),
            tie_word_embeddings=field.get("tie_word_embeddings", bool),
            max_position_embeddings=field.get("max_position_embeddings", int),
            hidden_act=hidden_act,
            rope_scaling=_rope_scaling(arch.get("rope_scaling"), source),
            moe=None if moe is None else _moe_args(moe, source),
            sliding_window=sliding_window,
            rope_local_base_freq=None if rope_local_base_freq is None else float(rope_local_base_freq),
            query_pre_attn_scalar=None if query_pre_attn_scalar is None else float(query_pre_attn_scalar),
        )


class _FieldReader:
    """Typed access to one JSON object; every failure names the field and the value."""

    def __init__(self, block: Mapping[str, Any], where: str):
        self.block, self.where = block, where

    def get(self, key: str, kind):
        if key not in self.block or self.block[key] is None:
            raise ModelConfigError(f"{self.where}.{key} is missing")
        return self._typed(key, kind)

    def optional(self, key: str, kind, default):
        return default if self.block.get(key) is None else self._typed(key, kind)

    def _typed(self, key: str, kind):
        value = self.block[key]
        # bool is an int in Python; a size given as true/false is still wrong.
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ModelConfigError(f"{self.where}.{key} has the wrong type: {value!r}")
        return value


def _rope_scaling(block: Any, source: str) -> Mapping[str, Any] | None:
    if block is None:
        return None
    if not isinstance(block, Mapping):
        raise ModelConfigError(f"{source}: arch.rope_scaling is {block!r}, not an object")
    rope_type = block.get("rope_type", block.get("type"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(f"{source}: arch.rope_scaling.rope_type {rope_type!r} is not one of {tuple(ROPE_TYPES)}")
    field = _FieldReader(block, f"{source}: arch.rope_scaling")
    params = {key: field.get(key, (int, float)) for key in ROPE_TYPES[rope_type]}
    return None if rope_type == "default" else {"rope_type": rope_type, **params}


def _moe_args(block: Any, source: str) -> MoeArgs:
    if not isinstance(block, Mapping):
        raise ModelConfigError(f"{source}: field moe is {block!r}, not an object")
    field = _FieldReader(block, f"{source}: moe")
    return MoeArgs(
        num_experts=field.get("num_experts", int),
        top_k=field.get("top_k", int),
        moe_intermediate_size=field.get("moe_intermediate_size", int),
        norm_topk_prob=field.get("norm_topk_prob", bool),
        shared_expert_intermediate_size=field.optional("shared_expert_intermediate_size", int, None),
    )
