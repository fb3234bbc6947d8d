"""Generation any runtime shares: sampling, timing, prompts, streamed text, the CLI flags, and a
decode loop over the Backend protocol (`pipeline.ground.backend_protocol`). No torch here, so the MLX
runtime (`mlx_runtime.generate`, which keeps its own device-side loop) builds on it too.

    tokens = generate(backend, prompt_ids, max_tokens=32, sampling=Sampling())
    stream_text(tokens, tokenizer, sys.stdout)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from pipeline.ground.errors import CmfdeployError


class GenerateError(CmfdeployError):
    """A generate request that cannot be run as given."""


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
    kv_bytes: int = 0  # the KV cache as allocated for prompt + max_tokens (runtimes that know it)

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s else 0.0

    def tick(self, start: float, first: float | None) -> float:
        """Record one token yielded now; returns the time of the first token."""
        now = time.perf_counter()
        if first is None:
            first, self.prefill_s = now, now - start
        else:
            self.decode_steps, self.decode_s = self.decode_steps + 1, now - first
        self.generated += 1
        return first

    def line(self) -> str:
        return (f"prefill: {self.prompt_tokens} tokens, {self.prefill_tps:.1f} tokens/s; "
                f"decode: {self.generated} tokens, {self.decode_tps:.1f} tokens/s")


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


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Where two token sequences first part: an index, or None where they are equal."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def check_request(prompt: np.ndarray, max_tokens: int, context: int, where: str) -> None:
    if max_tokens < 1:
        raise GenerateError(f"{where}: --max-tokens {max_tokens}: must be at least 1")
    if prompt.size == 0:
        raise GenerateError(f"{where}: the prompt has no tokens")
    if prompt.size + max_tokens > context:
        raise GenerateError(f"{where}: {prompt.size} prompt tokens + {max_tokens} new tokens exceed the "
                            f"context of {context}")


def generate(backend, prompt: np.ndarray, *, max_tokens: int, sampling: Sampling = Sampling(),
             eos_ids: tuple[int, ...] = (), stats: Stats | None = None, where: str | None = None
             ) -> Iterator[int]:
    """Stream up to `max_tokens` new tokens after `prompt` from any Backend: one `prefill` of the
    prompt, then one `advance` per token (a stateful package's decode function, a chunk-KV
    package's one-token chunk). Stops after any of `eos_ids` (which is yielded). `where` names
    the artifact in errors (default: the backend)."""
    stats = Stats() if stats is None else stats
    prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
    check_request(prompt, max_tokens, backend.context, where or backend.name)
    rng = np.random.default_rng(sampling.seed)
    start, first = time.perf_counter(), None
    logits, snapshot = backend.prefill(prompt)
    stats.prompt_tokens = prompt.size
    for step in range(max_tokens):
        if step:
            logits, snapshot = backend.advance(snapshot, np.array([token]))
        token = sample(np.asarray(logits[-1]), sampling, rng)
        first = stats.tick(start, first)
        yield token
        if token in eos_ids:
            return


# --- prompts, text, flags -------------------------------------------------------------------


def add_generation_arguments(parser) -> None:
    """The flags `cmfdeploy generate` and `cmfdeploy mlx generate` share."""
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    parser.add_argument("--bos", action="store_true", help="prepend the BOS token to a plain prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)


def prompt_ids(tokenizer, args) -> np.ndarray:
    """The prompt's ids as the shared flags ask: a chat turn, or plain text (BOS first with --bos)."""
    from pipeline.ground.chat import chat_ids  # jinja2, only for --chat

    if args.chat:
        return chat_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    return tokenizer.encode(args.prompt, add_bos=args.bos)


def sampling_of(args) -> Sampling:
    return Sampling(args.temperature, args.top_p, args.seed)


def stream_text(tokens: Iterable[int], tokenizer, out) -> list[int]:
    """Write the decoded text to `out` as tokens arrive; the tokens, once all are in."""
    received, shown = [], ""
    for token in tokens:
        received.append(token)
        text = tokenizer.decode(received)
        # Hold back a partial UTF-8 sequence until its last byte arrives.
        if not text.endswith("\ufffd"):
            out.write(text[len(shown):])
            out.flush()
            shown = text
    out.write("\n")
    return received
