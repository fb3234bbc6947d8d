"""Gemma 3 on the reference decoder against transformers' Gemma3ForCausalLM, past the window.

Two random-weight models: a small one whose window of 8 short contexts cross many times, and
a tiny-width one with Gemma 3's own window (512) and layer pattern (five sliding, one full)
run over more than 512 tokens. Every comparison takes the derived float32 bound
(pipeline/ground/models/numerics.py), and a window one off, or none, is shown to break it.
"""

import dataclasses

import numpy as np
import pytest
import torch

from _hf_models import load_saved, save_hf_model
from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models import CachedStep, KVCache, ModelArgs, build_model
from pipeline.ground.models.errors import ModelConfigError
from pipeline.ground.models.hf_config import arch_from_hf_config
from pipeline.ground.models.numerics import model_cache_bound, model_logits_bound
from pipeline.ground.torch_backend import TorchBackend

SMALL = dict(num_hidden_layers=4, sliding_window=8,
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
# Gemma 3 270M's window and pattern at a tiny width.
GEMMA_WINDOW = dict(hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, num_hidden_layers=6, layer_types=None, sliding_window=512,
                    query_pre_attn_scalar=16, max_position_embeddings=1024)
LENGTHS = {"small": 64, "window-512": 700}


@pytest.fixture(scope="module", params=sorted(LENGTHS))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model("gemma3", directory, seed=11, **(SMALL if request.param == "small" else GEMMA_WINDOW))
    config, weights = load_saved(directory)
    arch, moe = arch_from_hf_config(config)
    model = build_model(ModelArgs.from_header({"arch": arch, "moe": moe}), weights)
    ids = torch.randint(0, model.args.vocab_size, (LENGTHS[request.param],), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    return model, weights, ids, expected


def test_capabilities_come_from_the_tensors_and_the_arch(pair):
    model, _, _, _ = pair
    args, layer = model.args, model.model.layers[0]
    assert layer.pre_feedforward_layernorm is not None and layer.post_feedforward_layernorm is not None
    assert layer.self_attn.q_norm is not None and layer.self_attn.k_norm is not None
    assert model.lm_head is None
    assert [l.self_attn.sliding for l in model.model.layers] == [t == "SlidingAttention" for t in args.layer_types]
    assert layer.self_attn.scale == args.query_pre_attn_scalar ** -0.5
    assert model.sliding_window == args.sliding_window
    assert not torch.equal(model.sliding_inv_freq, model.inv_freq)


@torch.no_grad()
@pytest.mark.parametrize("window", ["exact", "one-less", "one-more", "none"])
def test_logits_match_transformers_and_a_wrong_window_is_caught(pair, window):
    """Within the bound with transformers' window; and the bound is tight enough to see a
    window one off, or none: those agree with transformers before the window fills, and part
    from it, beyond the bound, after."""
    model, weights, ids, expected = pair
    size = model.args.sliding_window
    wrong = {"exact": size, "one-less": size - 1, "one-more": size + 1, "none": len(ids)}[window]
    got = build_model(dataclasses.replace(model.args, sliding_window=wrong), weights)(ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    bound = model_logits_bound(model, len(ids))  # two float32 implementations: sums differ
    first = min(size, wrong)  # queries before it see every earlier key under both windows
    before, after = ((got[part] - expected[part]).abs().max().item() for part in (slice(first), slice(first, None)))
    print(f"window {size} run as {wrong}: max|dlogit| {before:.3g} before it, {after:.3g} after "
          f"(bound {bound:.3g}, logit std {expected.std():.3g})")
    assert before <= bound
    assert after <= bound if wrong == size else after > bound


def _schedule(length: int, window: int) -> list[int]:
    """Chunks that cross the window's edge inside a chunk and, one token at a time, a decode across it."""
    prefill, steps = window - 5, [1] * 10
    return [1, prefill - 1, *steps, 7, length - prefill - len(steps) - 7]


@torch.no_grad()
def test_chunked_prefill_and_decode_across_the_window_equal_the_full_forward(pair):
    model, _, ids, _ = pair
    expected = model(ids)
    cache = KVCache.empty(model.args, len(ids) + 16)
    out, start = [], 0
    for size in _schedule(len(ids), model.args.sliding_window):
        out.append(model.forward_cached(ids[start:start + size], cache))
        start += size
    assert cache.position == len(ids)
    # Every layer's cache keeps every position: slots before the window stay written.
    assert cache.keys[:, :, :, :len(ids)].abs().amin(dim=(1, 2, 4)).gt(0).all()
    assert (torch.cat(out) - expected).abs().max().item() <= model_logits_bound(model, cache.context)


@torch.no_grad()
def test_batched_branches_equal_one_branch_at_a_time(pair):
    """`forward_branches` with branches before, across and past the window's edge, each from
    its own cache and position, against `forward_cached` of each branch."""
    model, _, ids, _ = pair
    window, context = model.args.sliding_window, len(ids) + 16
    deep, edge, empty = (KVCache.empty(model.args, context) for _ in range(3))
    model.forward_cached(ids[:len(ids) - 8], deep)
    model.forward_cached(ids[:window - 2], edge)
    branches = [(deep, ids[-8:-5]), (deep, ids[-5:-4]), (edge, ids[window - 2:window + 3]), (empty, ids[:11])]
    suffixes, positions = [suffix for _, suffix in branches], [cache.position for cache, _ in branches]
    keys_in = torch.stack([cache.keys for cache, _ in branches])
    values_in = torch.stack([cache.values for cache, _ in branches])
    logits, keys, values = model.forward_branches(suffixes, positions, keys_in, values_in)
    bound, cache_bound = model_logits_bound(model, context), model_cache_bound(model, context)
    alone = [cache.snapshot() for cache, _ in branches]
    want = [model.forward_cached(suffix, branch) for branch, suffix in zip(alone, suffixes)]
    assert [got.shape for got in logits] == [w.shape for w in want]
    assert max((got - w).abs().max().item() for got, w in zip(logits, want)) <= bound
    # Each branch's cache up to its end; the padding's slots past it are never read.
    written = [(got[..., :branch.position, :] - ref[..., :branch.position, :]).abs().max().item()
               for got_keys, got_values, branch in zip(keys, values, alone)
               for got, ref in ((got_keys, branch.keys), (got_values, branch.values))]
    assert max(written) <= cache_bound


def test_single_steps_in_one_forward_equal_each_step_from_its_own_cache(pair):
    """`TorchBackend.single_steps` over an fp16 cache, across the window's edge: each token of
    the run against `advance_arrays` of it alone from the cache the steps before it left (the
    gate checks a package's consecutive calls so), logits within the bound and the written
    cache within the gate's cache bound."""
    from pipeline.stages.gates.exactness import cache_outside, exact_tolerances

    model, _, ids, _ = pair
    start, steps, context = model.args.sliding_window - 4, 8, len(ids) + 16
    backend = TorchBackend(model, model.args, context, cache_dtype=np.float16)
    _, prefilled = backend.prefill(ids[:start].numpy())
    before = (prefilled.keys.numpy().astype(np.float16), prefilled.values.numpy().astype(np.float16), start)
    cache, alone = before, []
    for token in ids[start:start + steps].numpy():
        [(logits, cache)] = backend.advance_arrays([(cache, np.array([token]))])
        alone.append(logits)
    logits, written = backend.single_steps(before, cache, ids[start:start + steps].numpy())
    assert np.abs(logits - np.concatenate(alone)).max() <= model_logits_bound(model, context)
    _, cache_tolerance = exact_tolerances(model, context)
    assert written[2] == cache[2] == start + steps
    assert all(cache_outside(got, want, cache_tolerance) == 0 for got, want in zip(written[:2], cache[:2]))
    assert all(got.dtype == np.float16 for got in written[:2])


@torch.no_grad()
def test_traced_step_keeps_the_window_exact_at_any_position(pair):
    """The graph a converter traces at one position keeps the window right at others."""
    model, _, ids, _ = pair
    window, context = model.args.sliding_window, len(ids) + 16
    empty = KVCache.empty(model.args, context)
    traced = torch.jit.trace(
        CachedStep(model), (ids[None, :3], torch.tensor([1]), empty.keys, empty.values), check_trace=False)
    cache = KVCache.empty(model.args, context)
    model.forward_cached(ids[:window - 2], cache)
    for length in (1, 4):
        at = cache.position
        logits, keys, values = traced(ids[None, at:at + length], torch.tensor([at]), cache.keys, cache.values)
        branch = cache.snapshot()
        expected = model.forward_cached(ids[at:at + length], branch)
        assert (logits[0] - expected).abs().max().item() <= model_logits_bound(model, context)
        assert torch.equal(keys, branch.keys) and torch.equal(values, branch.values)
        cache = branch


# -- refusals


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The arch and weights of _hf_models' gemma3 (one sliding layer, one full)."""
    directory = tmp_path_factory.mktemp("refusals")
    save_hf_model("gemma3", directory, seed=3)
    config, weights = load_saved(directory)
    return arch_from_hf_config(config)[0], weights


@pytest.mark.parametrize("change, error, message", [
    ({"layer_types": ["SlidingAttention", "sliding_attention"]}, UnsupportedModel,
     r"m.cmf: arch.layer_types\[1\] 'sliding_attention' is not one of"),
    ({"final_logit_softcapping": 30.0}, UnsupportedModel,
     "m.cmf: arch.final_logit_softcapping 30.0 .tanh softcapping. is not supported"),
    ({"attn_logit_softcapping": 50.0}, UnsupportedModel,
     "m.cmf: arch.attn_logit_softcapping 50.0 .tanh softcapping. is not supported"),
    ({"sliding_window": None}, ModelConfigError,
     "m.cmf: arch.sliding_window is missing .arch.layer_types has SlidingAttention."),
    ({"sliding_window": 0}, ModelConfigError, "m.cmf: arch.sliding_window 0 is not a positive size"),
])
def test_headers_the_decoder_cannot_run_are_refused_by_name(saved, change, error, message):
    arch, _ = saved
    with pytest.raises(error, match=message):
        ModelArgs.from_header({"arch": {**arch, **change}}, source="m.cmf")


@pytest.mark.parametrize("key", ["query_pre_attn_scalar", "rope_local_base_freq"])
def test_a_gemma3_file_without_its_own_keys_is_refused(saved, key):
    """Without them base would run head_dim ** -0.5 and one RoPE base: another model."""
    arch, _ = saved
    with pytest.raises(ModelConfigError, match=f"g.cmf: arch.{key} is missing .gemma3 needs it."):
        ModelArgs.from_header({"arch": {k: v for k, v in arch.items() if k != key}}, source="g.cmf")


def test_a_post_ffn_norm_without_a_pre_ffn_norm_is_refused(saved):
    """pre_feedforward_layernorm is what makes a layer sandwich-normed; without it a
    post_feedforward_layernorm has no place in the layer, and running without it would be
    another model."""
    arch, weights = saved
    lone = {n: t for n, t in weights.items() if "pre_feedforward_layernorm" not in n}
    with pytest.raises(UnsupportedModel, match="g.cmf: tensors this model family cannot run: "
                                               "model.layers.0.post_feedforward_layernorm.weight"):
        build_model(ModelArgs.from_header({"arch": arch}), lone, source="g.cmf")
