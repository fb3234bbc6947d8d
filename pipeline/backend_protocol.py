"""The Backend protocol, its error and input checks: no torch here, so runtimes other than the
reference (MLX) implement it without loading torch. `pipeline.backends` dispatches."""

from typing import Protocol

import numpy as np

from pipeline.errors import CmfdeployError

# What `open_backend` (pipeline.backends) accepts; here so the CLI lists them without torch.
BACKENDS = ("auto", "torch", "coreml", "coreml-executor", "coreml-macos", "mlx")


class BackendError(CmfdeployError):
    """An artifact no backend can open as asked, or input a backend cannot run."""


class Backend(Protocol):
    name: str  # "torch-fp32", "coreml-executor", "coreml-macos", "mlx"
    context: int  # max tokens

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """ids int [T] -> float32 [T, vocab], one full forward."""

    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, object]:
        """Logits [T, vocab] and an immutable snapshot of the state after ids."""

    def extend(self, snapshot: object, ids: np.ndarray) -> np.ndarray:
        """Logits of ids run after the snapshot; the snapshot stays unchanged (branching)."""

    def advance(self, snapshot: object, ids: np.ndarray) -> tuple[np.ndarray, object]:
        """`extend`, and the snapshot after ids too (generation's decode step); the given
        snapshot stays unchanged."""


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
