"""The reference decoder against transformers 5 on random-weight models, full and cached.

Each HF model is saved with save_pretrained; our side reads the saved config.json (through
arch_from_hf_config and ModelArgs) and the saved safetensors, as an importer would.
"""

import copy

import pytest
import torch

from _hf_models import load_saved, save_hf_model
from pipeline.ground.models.numerics import _chain, model_logits_bound
from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models import KVCache, ModelArgs, build_model
from pipeline.ground.models.hf_config import arch_from_hf_config

CASES = {
    "llama-llama3-rope": ("llama", {}),
    "qwen2-biases": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "gemma": ("gemma", {}),
    "qwen3-moe": ("qwen3_moe", {"norm_topk_prob": False}),
    "qwen3-moe-norm-topk": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen2-moe-shared-expert": ("qwen2_moe", {"norm_topk_prob": False}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(family, directory, seed=len(request.param), **overrides)
    config, weights = load_saved(directory)
    arch, moe = arch_from_hf_config(config)
    args = ModelArgs.from_header({"arch": arch, "moe": moe})
    ids = torch.randint(0, args.vocab_size, (64,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    return request.param, build_model(args, weights), ids, expected


def test_capabilities_come_from_the_saved_tensors(pair):
    name, model, _, _ = pair
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None) == name.startswith("qwen2")  # Qwen2 and Qwen2-MoE have q/k/v biases
    assert (attn.q_norm is not None) == name.startswith("qwen3")
    assert (model.lm_head is None) == name.startswith(("qwen2-biases", "qwen3-qk", "gemma"))


@torch.no_grad()
def test_full_forward_matches_transformers(pair):
    name, model, ids, expected = pair
    got = model(ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    delta = (got - expected).abs().max().item()
    print(f"{name}: full max|dlogit| = {delta:.3g} (logit std {expected.std():.3g})")
    assert delta <= model_logits_bound(model, len(ids))  # two float32 implementations: sums differ


@torch.no_grad()
def test_cached_forward_matches_transformers(pair):
    name, model, ids, expected = pair
    cache = KVCache.empty(model.args, 80)
    got = torch.cat([model.forward_cached(ids[a:b], cache) for a, b in ((0, 1), (1, 4), (4, 64))])
    assert cache.position == 64
    delta = (got - expected).abs().max().item()
    print(f"{name}: cached max|dlogit| = {delta:.3g}")
    assert delta <= model_logits_bound(model, cache.context)


def test_the_bounds_chain_counts_each_bias_add(pair):
    """A bias is one more term in the sum that ends its projection: Qwen2's q/k/v biases make
    every layer's path one longer (`numerics._chain`); a model without biases is unchanged."""
    name, model, _, _ = pair
    unbiased = copy.deepcopy(model)
    for layer in unbiased.model.layers:
        for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            projection.bias = None
    assert _chain(model, 64) - _chain(unbiased, 64) == (model.args.num_layers if name.startswith("qwen2") else 0)


LEGACY_LLAMA = {  # transformers 4 layout: rope_theta on top, scaling under rope_scaling with "type"
    "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_size": 64, "intermediate_size": 96, "vocab_size": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "max_position_embeddings": 512, "rope_theta": 500000.0,
    "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 64},
}


def test_legacy_hf_configs_map_to_the_same_arch(tmp_path):
    save_hf_model("llama", tmp_path)
    config, _ = load_saved(tmp_path)
    assert "rope_theta" not in config  # transformers 5 keeps it in rope_parameters only
    new, _ = arch_from_hf_config(config)
    old, moe = arch_from_hf_config(LEGACY_LLAMA)
    assert moe is None
    assert ModelArgs.from_header(old) == ModelArgs.from_header(new)
    gemma, _ = arch_from_hf_config({**LEGACY_LLAMA, "model_type": "gemma", "hidden_act": "gelu",
                                    "rope_scaling": None})
    assert gemma["hidden_act"] == "gelu_pytorch_tanh" and gemma["norm_style"] == "gemma"


@pytest.mark.parametrize("change, message", [
    ({"arch_name": "mamba"}, "arch.arch_name 'mamba' is not a supported family"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not one of"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not one of"),
])
def test_architectures_the_model_cannot_run_are_refused_by_name(change, message):
    arch, _ = arch_from_hf_config(LEGACY_LLAMA)
    with pytest.raises(UnsupportedModel, match=message):
        ModelArgs.from_header({"arch": {**arch, **change}}, source="m.cmf")
