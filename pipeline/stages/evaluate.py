"""Logits and perplexity over any Backend.

Perplexity uses non-overlapping windows: the token sequence is cut into consecutive windows
and each is scored on its own from a cold start, so every window costs one forward and no
token is scored twice. Within a window, token j is predicted from tokens 0..j-1 of that
window. When the tokenizer has a BOS, every window starts with BOS followed by `window - 1`
text tokens, and every text token is predicted; without one, a window is `window` text
tokens and its first token serves only as context. (Overlapping, sliding windows give lower
numbers at many times the cost; what matters here is comparing backends on equal terms.)
"""

from dataclasses import dataclass

import numpy as np

from pipeline.ground.errors import CmfdeployError
from pipeline.ground.backend_protocol import log_softmax


class EvaluateError(CmfdeployError):
    """Text too short to score, or a window that does not fit the backend."""


@dataclass(frozen=True)
class Perplexity:
    tokens: int  # predicted tokens
    mean_nll: float  # nats per predicted token
    windows: int

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.mean_nll))


def windows(ids: np.ndarray, window: int, bos_id: int | None) -> list[np.ndarray]:
    """The model inputs of a non-overlapping-window evaluation (see the module docstring)."""
    if window < 2:
        raise EvaluateError(f"perplexity: window {window} leaves no token to predict")
    text_per_window = window - 1 if bos_id is not None else window
    parts = [ids[start : start + text_per_window] for start in range(0, len(ids), text_per_window)]
    if bos_id is not None:
        return [np.concatenate([[bos_id], part]).astype(np.int64) for part in parts]
    return [part for part in parts if len(part) >= 2]


def perplexity(backend, ids: np.ndarray, window: int = 128, bos_id: int | None = None) -> Perplexity:
    """Mean NLL of `ids` (text tokens, no BOS) under `backend`, in non-overlapping windows."""
    if window > backend.context:
        raise EvaluateError(f"perplexity: window {window} exceeds the {backend.context}-token context "
                            f"of backend {backend.name!r}")
    total, count = 0.0, 0
    inputs = windows(np.asarray(ids, dtype=np.int64), window, bos_id)
    for tokens in inputs:
        logprobs = log_softmax(backend.logits(tokens))[:-1]
        total -= logprobs[np.arange(len(tokens) - 1), tokens[1:]].sum()
        count += len(tokens) - 1
    if count == 0:
        raise EvaluateError("perplexity: the text has fewer than two tokens, nothing to predict")
    return Perplexity(tokens=count, mean_nll=total / count, windows=len(inputs))
