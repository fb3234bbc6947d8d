"""Token generation on MLX: chunked prefill, then decode steps that stay on the device; sampling,
timing and prompts are the runtime-independent ones of `pipeline.ground.generation`.

Prompt chunks of `GEMM_MIN_TOKENS` or more run their projections as dense GEMMs over a
transient expansion of each weight (see `weights.expanded_matmul`); shorter chunks and every
decode step run the packed weights on MLX's quantized kernels.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlx.core as mx
import numpy as np

from pipeline.ground.generation import Sampling, Stats, sample
from pipeline.ground.models.errors import ContextOverflow
from mlx_runtime.cache import KVCache
from mlx_runtime.models import Model, forward

# From this many tokens a transient dense GEMM beats MLX's row-serial quantized kernel
# (measured by benchmarks/mlx_bench.py on the CPU build).
GEMM_MIN_TOKENS = 8
PREFILL_CHUNK = 512


def prefill(model: Model, ids: np.ndarray, cache: KVCache, chunk: int = PREFILL_CHUNK) -> mx.array:
    """Run the prompt through the cache in chunks; logits [1, vocab] of its last token."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError("prefill needs at least one token")
    logits = None
    for lo in range(0, ids.size, chunk):
        part = ids[lo : lo + chunk]
        last = lo + chunk >= ids.size
        logits = forward(model, part, cache, gemm=part.size >= GEMM_MIN_TOKENS, last_only=last)
        mx.eval(logits)
    return logits


def _tokens(model: Model, logits: mx.array, cache: KVCache, sampling: Sampling, rng: np.random.Generator,
            count: int) -> Iterator[int]:
    """`count` tokens, one decode forward between each. Greedy decoding stays on the device and
    queues the next forward before reading the current token, so MLX computes while Python
    builds the next graph; sampling reads the logits to the host for the seeded generator."""
    if sampling.temperature > 0:
        for step in range(count):
            if step:
                logits = forward(model, np.array([token]), cache)
            token = sample(np.asarray(logits[0]), sampling, rng)
            yield token
        return
    following = mx.argmax(logits[0], keepdims=True)
    for step in range(count):
        current = following
        if step + 1 < count:
            following = mx.argmax(forward(model, current, cache)[0], keepdims=True)
            mx.async_eval(following)
        yield int(current.item())


def generate(model: Model, prompt: np.ndarray, *, max_tokens: int, sampling: Sampling = Sampling(),
             eos_ids: tuple[int, ...] = (), stats: Stats | None = None) -> Iterator[int]:
    """Stream up to `max_tokens` new tokens after `prompt`; stops after any of `eos_ids`
    (which is yielded). `stats`, when given, is filled with token counts and timings."""
    stats = Stats() if stats is None else stats
    prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
    context = model.args.max_position_embeddings
    if prompt.size + max_tokens > context:
        raise ContextOverflow(f"generate: {prompt.size} prompt tokens + {max_tokens} new tokens exceed the "
                              f"model's context of {context}")
    cache = model.new_cache(prompt.size + max_tokens)
    start = time.perf_counter()
    logits = prefill(model, prompt, cache)
    stats.prompt_tokens, stats.kv_bytes = prompt.size, cache.nbytes
    first = None
    for token in _tokens(model, logits, cache, sampling, np.random.default_rng(sampling.seed), max_tokens):
        first = stats.tick(start, first)
        yield token
        if token in eos_ids:
            return
