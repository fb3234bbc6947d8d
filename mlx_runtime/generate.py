"""Token generation: chunked prefill, greedy / temperature / top-p sampling with a seed, streaming.

Prompt chunks of `GEMM_MIN_TOKENS` or more run their projections as dense GEMMs over a
transient expansion of each weight (see `weights.expanded_matmul`); shorter chunks and every
decode step run the packed weights on MLX's quantized kernels.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from pipeline.models.errors import ContextOverflow
from mlx_runtime.cache import KVCache
from mlx_runtime.models import Model, forward

# From this many tokens a transient dense GEMM beats MLX's row-serial quantized kernel
# (measured by benchmarks/mlx_bench.py on the CPU build).
GEMM_MIN_TOKENS = 8
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Stats:
    """Prefill: the prompt up to the first sampled token. Decode: every later token is one
    step, timed as wall time from the first token to the last."""

    prompt_tokens: int = 0
    prefill_s: float = 0.0
    generated: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0
    kv_bytes: int = 0  # the KV cache as allocated for prompt + max_tokens

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s else 0.0


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


def sample(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """One token from logits [vocab]: argmax, or softmax(logits / T) cut to the smallest set of
    tokens whose probability reaches top_p (nucleus), renormalised."""
    if sampling.temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / sampling.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if sampling.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < sampling.top_p  # the token that crosses top_p stays
        cut = np.zeros_like(p)
        cut[order[keep]] = p[order[keep]]
        p = cut / cut.sum()
    return int(rng.choice(p.size, p=p))


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
        now = time.perf_counter()
        if first is None:
            first, stats.prefill_s = now, now - start
        else:
            stats.decode_steps, stats.decode_s = stats.decode_steps + 1, now - first
        stats.generated += 1
        yield token
        if token in eos_ids:
            return
