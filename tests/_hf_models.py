"""Small random-weight Hugging Face decoders saved to disk, the reference for the torch model.

Each model goes through `save_pretrained`, so the tensor names and config.json are the
on-disk checkpoint format that the importers also read. Weights are redrawn with spreads
that give O(1) logits (transformers' own init gives near-zero ones, which would hide errors).
"""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)


FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "gemma": ("GemmaConfig", dict(rope_theta=10000.0, hidden_act="gelu_pytorch_tanh")),
    # A query scalar unlike head_dim and two RoPE bases, so mixing either up shows.
    "gemma3": ("Gemma3TextConfig", dict(rope_theta=1000000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=24,
                                        sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                                         rope_theta=1000000.0, tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                                         shared_expert_intermediate_size=48, rope_theta=1000000.0,
                                         tie_word_embeddings=False)),
}


def _config(family: str, **overrides):
    import transformers

    class_name, defaults = FAMILIES[family]
    return getattr(transformers, class_name)(**{**SMALL, **defaults, **overrides})


def _randomise(model, seed: int):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                # Around 1 for x_hat * w norms, around 0 for Gemma's x_hat * (1 + w).
                offset = 0.0 if "gemma" in type(model).__name__.lower() else 1.0
                param.copy_(offset + 0.2 * noise)
            elif name.endswith("embed_tokens.weight"):
                param.copy_(noise)
            else:
                fan_in = param.shape[-1] if param.dim() > 1 else 1
                param.copy_(noise * (0.5 / fan_in**0.5 if param.dim() > 1 else 0.5))


def save_hf_model(family: str, directory: Path, seed: int = 0, **overrides):
    """Build, randomise and save a HF model; returns it in eval mode (eager attention)."""
    import transformers

    config = _config(family, **overrides)
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomise(model, seed)
    model.save_pretrained(directory)
    return model


def load_saved(directory: Path) -> tuple[dict, dict]:
    """(config.json dict, {HF tensor name: tensor}) as written by save_pretrained."""
    config = json.loads((Path(directory) / "config.json").read_text())
    return config, load_file(Path(directory) / "model.safetensors")


def rewrite_config(directory: Path, edit) -> None:
    """Apply `edit` (a function of the dict) to a saved model's config.json."""
    config = json.loads((Path(directory) / "config.json").read_text())
    edit(config)
    (Path(directory) / "config.json").write_text(json.dumps(config))
