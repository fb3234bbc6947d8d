"""Map a Hugging Face config.json dict to the CMF `arch` block and the optional `moe` block.

transformers 5 writes `rope_theta` (and the Llama-3 scaling keys) inside `rope_parameters`;
older configs keep `rope_theta` at the top and the scaling in `rope_scaling`. Both are read,
and a missing value is an error, never a default.
"""

from collections.abc import Mapping
from typing import Any

from pipeline.ground.models.errors import ModelConfigError

LAYER_TYPES = {"full_attention": "FullAttention", "linear_attention": "LinearAttention",
               "sliding_attention": "SlidingAttention"}


def arch_from_hf_config(config: Mapping[str, Any], source: str = "config.json") -> tuple[dict, dict | None]:
    """(arch, moe) for a CMF header from a HF config dict; moe is None for dense models."""

    def need(key: str):
        if config.get(key) is None:
            raise ModelConfigError(f"{source}: field {key} is missing")
        return config[key]

    model_type = need("model_type")
    num_layers = need("num_hidden_layers")
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    hidden_act = need("hidden_act")
    if model_type == "gemma" and hidden_act == "gelu":
        # GemmaConfig rewrites the legacy "gelu" of the original releases to the tanh form.
        hidden_act = "gelu_pytorch_tanh"
    use_sliding = config.get("use_sliding_window") and config.get("sliding_window") is not None
    hf_layer_types = config.get("layer_types") or [
        "sliding_attention" if use_sliding else "full_attention"] * num_layers
    unknown = sorted(set(hf_layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ModelConfigError(f"{source}: field layer_types has unknown entries {unknown}")
    arch = {
        "arch_name": model_type,
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
        "norm_style": "gemma" if model_type == "gemma" else "qwen",
        "rope_theta": _rope_theta(config, source),
        "tie_word_embeddings": need("tie_word_embeddings"),
        "max_position_embeddings": need("max_position_embeddings"),
        "hidden_act": hidden_act,
    }
    scaling = _rope_scaling(config)
    if scaling is not None:
        arch["rope_scaling"] = scaling
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
