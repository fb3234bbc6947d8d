"""The Backend protocol, its error and input checks: no torch here, so runtimes other than the
reference (MLX) implement it without loading torch. `pipeline.stages.backends` dispatches."""

from typing import Protocol

import numpy as np

from pipeline.ground.errors import CmfdeployError

# What `open_backend` (pipeline.stages.backends) accepts; here so the CLI lists them without torch.
BACKENDS = ("auto", "torch", "coreml", "coreml-executor", "coreml-macos", "mlx")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of a backend's logits, in float64 (summed log-probs and KL must
    not lose digits to float32)."""
    x = np.array(logits, dtype=np.float64)  # a copy even of float64 rows: worked in place below
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def kl_rows(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """KL(p || q) per row of two log-softmaxed rows."""
    terms = log_p - log_q
    terms *= np.exp(log_p)
    return terms.sum(axis=-1)


def kl_rows_of_logits(p_logits: np.ndarray, q_logits: np.ndarray, targets: np.ndarray | None = None):
    """(KL(p || q) per row, log p and log q of each row's target, or None without `targets`)
    for rows of two distributions' logits, in float64, each row less its max (x' = x - max x):

        KL = Σ e^x' (x' - y') / Σ e^x' - log Σ e^x' + log Σ e^y',   log p_t = x'_t - log Σ e^x',

    which is `kl_rows(log_softmax(p_logits), log_softmax(q_logits))` rearranged: two exps a
    logit where that takes three, and fewer passes (a gate's comparisons and quality figures
    over Gemma 3's 262k vocabulary were a third of their time). log p_t is log_softmax's own
    value, to the bit."""
    x = np.array(p_logits, dtype=np.float64)  # copies: worked in place below
    y = np.array(q_logits, dtype=np.float64)
    x -= x.max(axis=-1, keepdims=True)
    y -= y.max(axis=-1, keepdims=True)
    at = np.arange(len(x)) if targets is not None else None
    shifted_at = None if targets is None else (x[at, targets], y[at, targets])
    weights = np.exp(x)
    mass = weights.sum(axis=-1)
    cross = np.einsum("...v,...v->...", weights, x) - np.einsum("...v,...v->...", weights, y)
    np.exp(y, out=y)
    log_mass_p, log_mass_q = np.log(mass), np.log(y.sum(axis=-1))
    kl = cross / mass - log_mass_p + log_mass_q
    if shifted_at is None:
        return kl, None, None
    return kl, shifted_at[0] - log_mass_p, shifted_at[1] - log_mass_q


def kl_rows_against(p: np.ndarray, p_log_p: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(p || softmax(logits)) per row, for a p that many logits are measured against, given
    once as its probabilities `p` (float64 rows) and `p_log_p` (Σ p log p per row):

        KL = Σ p log p - Σ p (x - m) + log Σ exp(x - m) · Σ p,   m each row's max of x,

    which is `kl_rows(log_p, log_softmax(logits))` rearranged, in one exp per logit where that
    takes two, and half its passes over the rows (Gemma 3's mixed recipe measures 82 of these
    on 254 rows of a 262k vocabulary: 45% of its time). The sums are float64 over the
    vocabulary as before, in another order."""
    x = np.array(logits, dtype=np.float64)  # a copy even of float64 rows: worked in place below
    x -= x.max(axis=-1, keepdims=True)
    cross = np.einsum("...v,...v->...", p, x)
    np.exp(x, out=x)
    return p_log_p - cross + np.log(x.sum(axis=-1)) * p.sum(axis=-1)


class BackendError(CmfdeployError):
    """An artifact no backend can open as asked, or input a backend cannot run."""


class ChunkSchedule(Protocol):
    """What a backend that runs in chunks over an explicit KV cache offers the gates: chunk
    schedules, and snapshots whose caches can be read and edited (the dirty-tail check).
    Caches are [layers, 1, kv_heads, context, head_dim] in the backend's cache dtype."""

    context: int

    def empty(self) -> object:
        """The snapshot before any token."""

    def run(self, snapshot: object, ids: np.ndarray) -> tuple[np.ndarray, object]:
        """Logits of ids fed as one chunk after the snapshot, and the snapshot after them."""

    def run_tokens(self, snapshot: object, ids: np.ndarray) -> tuple[np.ndarray, object]:
        """Logits of ids fed a token a chunk after the snapshot, and the snapshot after the last."""

    def cache_arrays(self, snapshot: object) -> tuple[np.ndarray, np.ndarray, int]:
        """(keys, values, position): the snapshot's caches, slots [0, position) valid."""

    def with_cache_arrays(self, snapshot: object, keys: np.ndarray, values: np.ndarray) -> object:
        """A snapshot at the same position holding the given caches."""


class Backend(Protocol):
    name: str  # "torch-fp32", "coreml-executor", "coreml-macos", "mlx"
    context: int  # max tokens
    # Optional: a backend that runs in chunks over an explicit cache exposes it here (None or
    # absent otherwise); the gates then check every chunk pattern and the snapshot invariants.
    chunks: ChunkSchedule | None

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """ids int [T] -> float32 [T, vocab], one full forward."""

    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, object]:
        """Logits [T, vocab] and an immutable snapshot of the state after ids."""

    def extend(self, snapshot: object, ids: np.ndarray) -> np.ndarray:
        """Logits of ids run after the snapshot; the snapshot stays unchanged (branching)."""

    def advance(self, snapshot: object, ids: np.ndarray) -> tuple[np.ndarray, object]:
        """`extend`, and the snapshot after ids too (generation's decode step); the given
        snapshot stays unchanged."""

    # Optional, by presence, where a backend can batch (scoring's items and candidates; a
    # backend without them gets one call per prefix or branch):
    #   `prefill_batch([ids, ...]) -> [(logits, snapshot), ...]`, each `prefill(ids)` but with
    #   the logits of its last token alone [1, vocab] (what branching from it reads);
    #   `extend_batch([(snapshot, ids), ...]) -> [logits, ...]`, each `extend(snapshot, ids)`.


def branch_groups(branches: list, branch_cache_bytes: int, weight_bytes: int, share: float) -> list[list]:
    """`branches` in consecutive groups, each one batch: as many branches as keep their caches
    (`branch_cache_bytes` each, counted as float32) within `share` of the model's FP32 weight
    bytes, at least one. A batch holds its branches' caches stacked, the caches each layer
    writes, and those stacked again as its output: about three times what is counted while it
    runs. Each backend sets its share by where it runs (docs/MEMORY.md)."""
    size = max(1, int(share * weight_bytes) // max(1, branch_cache_bytes))
    return [branches[start:start + size] for start in range(0, len(branches), size)]


def validate_ids(ids, backend_name: str, vocab_size: int, context: int, offset: int = 0) -> np.ndarray:
    """ids as int64 [T], or a BackendError naming the problem; `offset` tokens are already cached."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise BackendError(f"{backend_name}: ids must be a non-empty 1-D integer array, got {ids.dtype} {ids.shape}")
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        raise BackendError(f"{backend_name}: token id {ids[bad][0]} at {int(np.argmax(bad))} is outside "
                           f"the vocabulary of {vocab_size}")
    if offset + ids.size > context:
        raise BackendError(f"{backend_name}: {offset + ids.size} tokens exceed the context of {context}")
    return ids.astype(np.int64)
