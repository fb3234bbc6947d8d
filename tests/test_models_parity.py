"""The reference decoder against transformers 5 on random-weight models, full and cached.

Each HF model is saved with save_pretrained; our side reads the saved config.json (through
arch_from_hf_config and ModelArgs) and the saved safetensors, as an importer would.
"""

import pytest
import torch

from _hf_models import load_saved, save_hf_model
from pipeline.models import KVCache, ModelArgs, build_model
from pipeline.models.hf_config import arch_from_hf_config

TOLERANCE = 1e-4
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
    assert delta <= TOLERANCE


@torch.no_grad()
def test_cached_forward_matches_transformers(pair):
    name, model, ids, expected = pair
    cache = KVCache.empty(model.args, 80)
    got = torch.cat([model.forward_cached(ids[a:b], cache) for a, b in ((0, 1), (1, 4), (4, 64))])
    assert cache.position == 64
    delta = (got - expected).abs().max().item()
    print(f"{name}: cached max|dlogit| = {delta:.3g}")
    assert delta <= TOLERANCE
