"""KV-cache semantics of the reference decoder: chunk schedules, snapshots, stale slots, tracing."""

import mmap

import numpy as np
import pytest
import torch

from _hf_models import load_saved, save_hf_model
from pipeline.ground import torch_backend
from pipeline.ground.models.fp16 import fp16_reference
from pipeline.ground.models.numerics import fp16_logits_bound, model_cache_bound, model_logits_bound
from pipeline.ground.models import CachedStep, KVCache, ModelArgs, build_model
from pipeline.ground.models.errors import ContextOverflow
from pipeline.ground.models.hf_config import arch_from_hf_config

SCHEDULES = [[1, 3, 124], [128], [3, 1, 124], [124, 3, 1], [127, 1]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    save_hf_model("qwen3", directory, seed=3, tie_word_embeddings=False)
    config, weights = load_saved(directory)
    arch, moe = arch_from_hf_config(config)
    return build_model(ModelArgs.from_header({"arch": arch, "moe": moe}), weights)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (128,), generator=torch.Generator().manual_seed(7))


def _run(model, ids, schedule, cache):
    out, start = [], 0
    for size in schedule:
        out.append(model.forward_cached(ids[start : start + size], cache))
        start += size
    return torch.cat(out)


@torch.no_grad()
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: "-".join(map(str, s)))
def test_any_chunk_schedule_gives_the_full_forward(model, ids, schedule):
    expected = model(ids)
    got = _run(model, ids, schedule, KVCache.empty(model.args, 160))
    # Other chunk lengths, other kernels and sums: two float32 evaluations (pipeline/ground/models/numerics.py).
    assert (got - expected).abs().max().item() <= model_logits_bound(model, 160)


@torch.no_grad()
def test_snapshot_branches_do_not_disturb_each_other(model, ids):
    cache = KVCache.empty(model.args, 160)
    model.forward_cached(ids[:64], cache)
    snapshot = cache.snapshot()
    keys_before = snapshot.keys.clone()
    first = model.forward_cached(ids[64:80], cache)
    branch = snapshot.snapshot()
    second = model.forward_cached(ids[64:80], branch)
    assert snapshot.position == 64 and torch.equal(snapshot.keys, keys_before)
    assert torch.equal(first, second)
    assert (first - model(ids[:80])[64:]).abs().max().item() <= model_logits_bound(model, 160)


@torch.no_grad()
def test_slots_at_or_after_the_chunk_end_never_affect_the_output(model, ids):
    clean = KVCache.empty(model.args, 160)
    model.forward_cached(ids[:40], clean)
    dirty = KVCache(clean.keys.clone(), clean.values.clone(), clean.position)
    garbage = torch.randn(dirty.keys[..., 48:, :].shape, generator=torch.Generator().manual_seed(0)) * 1e3
    dirty.keys[..., 48:, :] = garbage
    dirty.values[..., 48:, :] = -garbage
    assert torch.equal(model.forward_cached(ids[40:48], dirty), model.forward_cached(ids[40:48], clean))


def test_writing_past_the_context_is_refused(model, ids):
    cache = KVCache.empty(model.args, 16)
    with torch.no_grad():
        model.forward_cached(ids[:10], cache)
        with pytest.raises(ContextOverflow, match="position 10 exceed the context of 16"):
            model.forward_cached(ids[10:17], cache)
    assert cache.position == 10


@torch.no_grad()
def test_traced_step_follows_position_and_length(model, ids):
    """The graph a converter traces keeps the position and chunk length symbolic."""
    args, context = model.args, 32
    empty = KVCache.empty(args, context)
    traced = torch.jit.trace(
        CachedStep(model), (ids[None, :3], torch.tensor([5]), empty.keys, empty.values), check_trace=False
    )
    cache = KVCache.empty(args, context)
    model.forward_cached(ids[:9], cache)
    for length in (1, 4):
        logits, keys, values = traced(ids[None, 9 : 9 + length], torch.tensor([9]), cache.keys, cache.values)
        branch = cache.snapshot()
        expected = model.forward_cached(ids[9 : 9 + length], branch)
        assert (logits[0] - expected).abs().max().item() <= model_logits_bound(model, context)
        assert torch.equal(keys, branch.keys) and torch.equal(values, branch.values)


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma"])
def test_batched_branches_equal_one_branch_at_a_time(family, tmp_path):
    """`forward_branches` (scoring's prefixes and candidates as one vmapped batch, right-padded,
    each branch from its own cache and position) against `forward_cached` of each branch: the
    same float32 operations in another batching, within two float32 evaluations' bound;
    padding never reaches a real row, and each branch writes the cache its own run writes."""
    save_hf_model(family, tmp_path, seed=5)
    config, weights = load_saved(tmp_path)
    arch, moe = arch_from_hf_config(config)
    model = build_model(ModelArgs.from_header({"arch": arch, "moe": moe}), weights)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(9))
    shared, other, empty = KVCache.empty(model.args, 64), KVCache.empty(model.args, 64), KVCache.empty(model.args, 64)
    model.forward_cached(ids[:30], shared)
    model.forward_cached(ids[:7], other)
    branches = [(shared, ids[30:33]), (shared, ids[33:34]), (other, ids[34:40]), (empty, ids[:11])]
    logits, keys, values = model.forward_branches(
        [suffix for _, suffix in branches], [cache.position for cache, _ in branches],
        torch.stack([cache.keys for cache, _ in branches]), torch.stack([cache.values for cache, _ in branches]))
    bound, cache_bound = model_logits_bound(model, 64), model_cache_bound(model, 64)
    for i, (cache, suffix) in enumerate(branches):
        alone = cache.snapshot()
        want = model.forward_cached(suffix, alone)
        assert logits[i].shape == want.shape and (logits[i] - want).abs().max().item() <= bound
        written = slice(0, alone.position)  # the padding's slots past it are never read
        for got, ref in ((keys[i], alone.keys), (values[i], alone.values)):
            assert (got[..., written, :] - ref[..., written, :]).abs().max().item() <= cache_bound
    last, _, _ = model.forward_branches(  # scoring's prefixes: the head on each last token alone
        [suffix for _, suffix in branches], [cache.position for cache, _ in branches],
        torch.stack([cache.keys for cache, _ in branches]), torch.stack([cache.values for cache, _ in branches]),
        last_only=True)
    for rows, all_rows in zip(last, logits):
        assert rows.shape == all_rows[-1:].shape and (rows - all_rows[-1:]).abs().max().item() <= bound

def _mapped(array: np.ndarray) -> bool:
    while array is not None and not isinstance(array, mmap.mmap):
        array = getattr(array, "base", None) if isinstance(array, np.ndarray) else getattr(array, "obj", None)
    return array is not None


@torch.no_grad()
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_logits_over_the_head_block_are_written_by_row_blocks_into_a_map(model, ids, fp16, monkeypatch):
    """Over HEAD_BLOCK_BYTES (a 262k vocabulary's 1024 rows are 1 GB) the reference's head runs
    a block of rows at a time into a scratch file's map, for one sequence and for batched
    branches alike: the same dot products, so the same logits within two evaluations' bound
    (another row count may pick another gemm kernel)."""
    reference = fp16_reference(model) if fp16 else model
    backend = torch_backend.TorchBackend(reference, model.args, 160, cache_dtype=np.float16 if fp16 else np.float32)
    bound = fp16_logits_bound(model, 160) if fp16 else model_logits_bound(model, 160)
    _, snapshot = backend.prefill(ids[:60].numpy())
    whole = [backend.logits(ids.numpy()), *backend.extend_batch([(snapshot, ids[60:].numpy()), (snapshot, ids[60:70].numpy())])]
    assert not any(_mapped(a) for a in whole)
    monkeypatch.setattr(torch_backend, "HEAD_BLOCK_BYTES", 5 * model.args.vocab_size * 4)  # 5 rows a block
    blocked = [backend.logits(ids.numpy()), *backend.extend_batch([(snapshot, ids[60:].numpy()), (snapshot, ids[60:70].numpy())])]
    for got, want in zip(blocked, whole):
        assert _mapped(got) and got.shape == want.shape and np.abs(got - want).max() <= bound
