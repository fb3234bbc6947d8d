"""The chunk schedules a traced or converted cache graph is checked on before it is saved:
what each kind's conversion check runs (`coreml.kinds.export.check_chunk_schedules`, the stateful
kind's `check_traced` and `measure`). Imported by the runners' modules too, so it needs no torch
to load: its tensors come from the caller."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from pipeline.ground.models import ModelArgs

# Chunk schedules (token counts per call) over the first 128 slots: a first call longer than
# one token, single-token decode between long chunks, a chunk ending at the 128th slot
# (`check_schedules` adds one at the context's end and one across a sliding window's edge).
SHORT_SCHEDULES = ((1, 3, 124), (128,), (3, 1, 124), (124, 3, 1), (127, 1))
# The tokens a check runs at the context's end: a chunk whose queries span the last slots, then a
# decode into the last one.
END_TOKENS = 128


@dataclass(frozen=True)
class CheckSchedule:
    """Token counts per call (`chunks`) run from slot `start` (a negative start counts from the
    context's end). The slots below `start` hold a synthetic cache, noise that the graph and
    the reference both read, so a check at the end of a long context costs its own tokens times
    the context. Real tokens up to that point would cost the context squared: the reference's
    and the executor's attention over every earlier token, 14 minutes of SmolLM2's chunk-KV
    conversion at 8192."""

    chunks: tuple[int, ...]
    start: int = 0

    def fit(self, context: int) -> CheckSchedule:
        """This schedule with its start counted from 0 and its chunks cut to the slots after it."""
        start = self.start % context
        return CheckSchedule(fit_schedule(self.chunks, context - start), start)

    @property
    def tokens(self) -> int:
        return sum(self.chunks)

    @property
    def name(self) -> str:
        chunks = "[" + ",".join(map(str, self.chunks)) + "]"
        return f"@{self.start}{chunks}" if self.start else chunks

    def prefix(self, *caches: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`caches` [layers, 1, kv_heads, slots, head_dim] with their slots from `start` zeroed in
        place: what the tokens before the schedule left."""
        for cache in caches:
            cache[..., self.start:, :] = 0
        return caches


def check_schedules(args: ModelArgs, context: int) -> tuple[CheckSchedule, ...]:
    """The chunk schedules a graph is checked on: SHORT_SCHEDULES within the context, and
    END_TOKENS decoding into the last slot, over a synthetic cache up to them in a context
    longer. Where a sliding window is shorter than the context, one from the first slot
    also decodes single tokens on each side of the window's edge (positions window-1 and window,
    where the first key leaves the window), then a chunk whose queries' windows start at
    different slots."""
    n = context
    schedules = [CheckSchedule(s).fit(n) for s in SHORT_SCHEDULES]
    window = args.sliding_window if "SlidingAttention" in args.layer_types else None
    if window is not None and window < n:
        schedules.append(CheckSchedule((window - 1, 1, 1, 64, 1)).fit(n))
    end = min(n, END_TOKENS)
    schedules.append(CheckSchedule((end - 1, 1), n - end).fit(n))
    return tuple(dict.fromkeys(schedules))


def fit_schedule(schedule: Iterable[int], context: int) -> tuple[int, ...]:
    """The schedule's positive chunks, cut to fit `context` slots (a context under 5 tokens)."""
    ends = np.minimum(np.cumsum([s for s in schedule if s > 0]), context)
    sizes = np.diff(ends, prepend=0)
    return tuple(int(s) for s in sizes if s > 0)


def noise_caches(cache_shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [layers, 1, kv_heads, slots, head_dim] of standard normal noise, float32,
    the same for the same seed: what a check's caches start as, on either side of it."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(cache_shape, generator=generator), torch.randn(cache_shape, generator=generator)
