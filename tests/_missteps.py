"""A package's chunk schedule that goes wrong at one single-token step, for the gates' tests."""

import numpy as np

# The slot a "past" misstep overwrites: one written long before the step.
PAST_SLOT = 3


class Misstep:
    """A package's chunk schedule (`ChunkSchedule`, any cache-carrying kind) that, at the
    single-token chunk at `position`, adds `error` to what it hands back: the logits
    (`where="logits"`), the key slot it wrote (`"cache"`) or an earlier key slot (`"past"`:
    PAST_SLOT). Decode steps (`run_tokens`) go wrong at the same step: it runs alone, the
    steps around it as the package's own `run_tokens`."""

    def __init__(self, chunks, position: int, where: str, error: float = 0.5):
        self.chunks, self.position, self.where, self.error = chunks, position, where, error

    def __getattr__(self, name):
        return getattr(self.chunks, name)

    def run(self, snapshot, ids):
        at = self.chunks.cache_arrays(snapshot)[2]
        logits, after = self.chunks.run(snapshot, ids)
        if at != self.position or len(ids) != 1:
            return logits, after
        if self.where == "logits":
            return logits + self.error, after
        keys, values, _ = self.chunks.cache_arrays(after)
        keys = keys.copy()
        keys[..., self.position if self.where == "cache" else PAST_SLOT, :] += self.error
        return logits, self.chunks.with_cache_arrays(after, keys, values)

    def run_tokens(self, snapshot, ids):
        at = self.chunks.cache_arrays(snapshot)[2]
        cut = self.position - at
        if not 0 <= cut < len(ids):
            return self.chunks.run_tokens(snapshot, ids)
        logits = []
        for run, part in ((self.chunks.run_tokens, ids[:cut]), (self.run, ids[cut:cut + 1]),
                          (self.chunks.run_tokens, ids[cut + 1:])):
            if len(part):
                got, snapshot = run(snapshot, part)
                logits.append(got)
        return np.concatenate(logits), snapshot
