"""Map a Hugging Face config.json dict to the CMF `arch` block and the optional `moe` block.

transformers 5 writes `rope_theta` (and the Llama-3 scaling keys) inside `rope_parameters`;
older configs keep `rope_theta` at the top and the scaling in `rope_scaling`. Both are read,
and a missing value is an error, never a default.

Gemma 3 (`gemma3_text`) adds the keys of docs/CMF-EXTENSIONS.md: its sliding layers' window
and RoPE base, and its query scalar. transformers 5 keeps one RoPE block per layer type in
`rope_parameters`; transformers 4 wrote `rope_theta` and `rope_local_base_freq` at the top.
"""

from collections.abc import Mapping
from typing import Any

from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models.errors import ModelConfigError

LAYER_TYPES = {"full_attention": "FullAttention", "linear_attention": "LinearAttention",
               "sliding_attention": "SlidingAttention"}
# Hugging Face model types whose CMF arch_name differs (the text-only Gemma 3 is "gemma3").
ARCH_NAMES = {"gemma3_text": "gemma3"}
# Gemma3TextConfig's own rule when a config has no layer_types: every sixth layer is full.
GEMMA3_SLIDING_PATTERN = 6


def arch_from_hf_config(config: Mapping[str, Any], source: str = "config.json") -> tuple[dict, dict | None]:
    """(arch, moe) for a CMF header from a HF config dict; moe is None for dense models."""

    def need(key: str):
        if config.get(key) is None:
            raise ModelConfigError(f"{source}: field {key} is missing")
        return config[key]

    model_type = need("model_type")
    if model_type == "gemma3":
        raise UnsupportedModel(f"{source}: model_type 'gemma3' is the multimodal Gemma3ForConditionalGeneration; "
                               f"only its text model (model_type 'gemma3_text') is imported")
    num_layers = need("num_hidden_layers")
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    gemma3 = model_type == "gemma3_text"
    hidden_act = need("hidden_activation" if gemma3 else "hidden_act")
    if model_type == "gemma" and hidden_act == "gelu":
        # GemmaConfig rewrites the legacy "gelu" of the original releases to the tanh form.
        hidden_act = "gelu_pytorch_tanh"
    if gemma3:
        default_types = [("full_attention" if (i + 1) % config.get("sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
                          == 0 else "sliding_attention") for i in range(num_layers)]
    else:
        use_sliding = config.get("use_sliding_window") and config.get("sliding_window") is not None
        default_types = ["sliding_attention" if use_sliding else "full_attention"] * num_layers
    hf_layer_types = config.get("layer_types") or default_types
    unknown = sorted(set(hf_layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ModelConfigError(f"{source}: field layer_types has unknown entries {unknown}")
    # Gemma 3's rope_theta and rope_scaling are its full-attention layers'; its sliding layers have their own base.
    rope, local_base = _gemma3_rope(config, source) if gemma3 else (config, None)
    arch = {
        "arch_name": ARCH_NAMES.get(model_type, model_type),
        "hidden_size": hidden,
        "intermediate_size": need("intermediate_size"),
        "num_layers": num_layers,
        "num_attention_heads": heads,
        # transformers' own rules for the two keys a config may leave out.
        "num_kv_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or hidden // heads,
        "vocab_size": need("vocab_size"),
        "layer_types": [LAYER_TYPES[t] for t in hf_layer_types],
        "rms_norm_eps": need("rms_norm_eps"),
        "norm_style": "gemma" if model_type in ("gemma", "gemma3_text") else "qwen",
        "rope_theta": _rope_theta(rope, source),
        "tie_word_embeddings": need("tie_word_embeddings"),
        "max_position_embeddings": need("max_position_embeddings"),
        "hidden_act": hidden_act,
    }
    scaling = _rope_scaling(rope)
    if scaling is not None:
        arch["rope_scaling"] = scaling
    if gemma3:
        if config.get("use_bidirectional_attention"):
            raise UnsupportedModel(f"{source}: use_bidirectional_attention is true (EmbeddingGemma); "
                                   f"only the causal Gemma 3 decoder is imported")
        arch.update({
            "sliding_window": need("sliding_window"),
            "rope_local_base_freq": local_base,
            "query_pre_attn_scalar": need("query_pre_attn_scalar"),
            # Carried so that a reader meeting a non-null value refuses it by name.
            "final_logit_softcapping": config.get("final_logit_softcapping"),
            "attn_logit_softcapping": config.get("attn_logit_softcapping"),
        })
    return arch, _moe(config, source)


def _rope_theta(config: Mapping[str, Any], source: str) -> float:
    parameters = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", parameters.get("rope_theta"))
    if theta is None:
        raise ModelConfigError(f"{source}: field rope_theta is missing (neither top-level nor in rope_parameters)")
    return float(theta)


def _rope_scaling(config: Mapping[str, Any]) -> dict | None:
    scaling = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling.pop("rope_theta", None)
    return None if rope_type == "default" else {"rope_type": rope_type, **scaling}


def _gemma3_rope(config: Mapping[str, Any], source: str) -> tuple[dict, float]:
    """(the full-attention layers' RoPE as a transformers 4 config spells it, the sliding layers' base).

    Gemma 3 scales only its full-attention layers' RoPE; a sliding block that says otherwise is refused.
    """
    parameters = config.get("rope_parameters") or {}
    if "full_attention" in parameters:  # transformers 5: one block per layer type
        full, local = parameters["full_attention"], dict(parameters.get("sliding_attention") or {})
        full = {"rope_theta": full.get("rope_theta"), "rope_scaling": full}
    else:  # transformers 4
        full = {"rope_theta": config.get("rope_theta"), "rope_scaling": config.get("rope_scaling")}
        local = {"rope_theta": config.get("rope_local_base_freq")}
    if local.get("rope_theta") is None:
        raise ModelConfigError(f"{source}: field rope_local_base_freq is missing (the sliding layers' RoPE base, "
                               f"neither top-level nor rope_parameters.sliding_attention.rope_theta)")
    rope_type = local.get("rope_type", "default")
    if rope_type != "default":
        raise UnsupportedModel(f"{source}: rope_parameters.sliding_attention.rope_type {rope_type!r}: "
                               f"only the full-attention layers' RoPE is scaled in Gemma 3")
    return full, float(local["rope_theta"])


def _moe(config: Mapping[str, Any], source: str) -> dict | None:
    # transformers 5 saves Qwen-MoE's num_experts as num_local_experts.
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    if not num_experts:
        return None
    moe = {"num_experts": num_experts}
    for cmf_key, hf_key in (("top_k", "num_experts_per_tok"), ("moe_intermediate_size", "moe_intermediate_size"),
                            ("norm_topk_prob", "norm_topk_prob")):
        if config.get(hf_key) is None:
            raise ModelConfigError(f"{source}: field {hf_key} is missing from a MoE config")
        moe[cmf_key] = config[hf_key]
    if config.get("shared_expert_intermediate_size"):
        moe["shared_expert_intermediate_size"] = config["shared_expert_intermediate_size"]
    return moe
