"""The reference decoder behind the Backend protocol (`pipeline.ground.backend_protocol`).

    backend = TorchBackend(*load_reference("model.cmf")[:2])
    stateful = TorchBackend(model, args, 128, cache_dtype=np.float16, numerics="fp32, fp16 K/V cache")

It is the peer every runtime is compared with, so it lives with the reference model, below
the runtimes; `pipeline.stages.backends.open_backend` picks it for a CMF file or a bundle,
and the gates build the numerics a package intends from it (`pipeline.stages.gates.references`).
"""

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.ground.backend_protocol import BackendError, branch_groups, validate_ids
from pipeline.ground.models import Decoder, KVCache, ModelArgs
from pipeline.ground.scratch import ScratchFile

# The torch cache is [layers, 1, kv, context, head_dim] and attention reads all of it, so the
# default stays far below the long contexts some models declare; `context=` raises it.
DEFAULT_TORCH_CONTEXT = 2048
# Batched snapshots (`prefill_batch`) hold caches as long as their tokens need, in steps of this
# many slots, and grow when a branch runs past them: attention and the cache write cost what the
# cache holds, and scoring's items are tens of tokens where a package's context is 1024 (Gemma 3's
# cloze set scores 5x faster). Slots past a branch's tokens are masked, so the length only moves
# the float32 summation order (within `numerics`' bound of two evaluations).
ROOM_STEP = 64
# A batch of branches (`prefill_batch`, `extend_batch`) keeps its caches within this share of the
# FP32 weight bytes W (`branch_groups`), about 3/16 W while it runs. The reference scores inside
# the survey's workers, two of them within one stage bound of 1.25 W + 1.5 GB (docs/MEMORY.md):
# with a quarter, SmolLM2-135M's 40 candidates ran as one batch of 64-slot caches, about 0.35 GB
# in each worker, and the survey's two random-135M workers summed 2.55 GiB against a bound of
# 2.03 GiB; with a sixteenth (11 a batch) and the quality part's smaller blocks, 1.84 GiB.
BATCH_CACHE_SHARE = 1 / 16
_TORCH_DTYPE = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}
# Logits over this many bytes are made by the head this many bytes of rows at a time, into a
# scratch file of their own (pipeline.ground.scratch) that goes with the array: a 262k
# vocabulary's over a 1024-token window are 1 GB, which a gate would otherwise hold as its
# own memory beside everything else. A row's logits are the same dot products either way.
HEAD_BLOCK_BYTES = 64 * 2**20


class TorchBackend:
    """The reference decoder behind the Backend protocol.

    Snapshots are KVCaches whose tensors the model never writes in place, so holding one
    costs nothing and `extend` branches from it freely. With `chunk`, `logits` feeds the
    sequence through a float32 cache `chunk` tokens at a time (the path a chunked package takes).

    The numerics a package intends are this decoder with options: `model` carries the
    weights it intends (FP32, or its own decoded ones; `numerics` names them), and
    `cache_dtype` is the dtype its K/V cache keeps. A chunk attends over its own float32
    K/V and what it writes to a snapshot is rounded to that dtype, as the package does
    (held as float32 values, which undo the rounding exactly). `hot_rows_head_norm`: the package
    sums its head from a table's code and its hot rows' residual (`coreml.decoded.hot_rows_head_norm`),
    which the exactness bound takes (`pipeline.ground.models.numerics.model_logits_bound`).
    """

    def __init__(self, model: Decoder, args: ModelArgs, context: int | None = None, chunk: int | None = None,
                 cache_dtype=np.float32, numerics: str = "fp32", hot_rows_head_norm: float | None = None):
        self.model, self.args = model, args
        self.context = min(args.max_position_embeddings, DEFAULT_TORCH_CONTEXT) if context is None else context
        if chunk is not None and chunk < 1:
            raise BackendError(f"torch backend: chunk {chunk} must be at least 1")
        self.chunk = chunk
        self.cache_dtype, self.numerics = np.dtype(cache_dtype), numerics
        self.hot_rows_head_norm = hot_rows_head_norm
        self.name = "torch-fp32" if numerics == "fp32" else f"torch-intended ({numerics})"
        self.weight_bytes = 4 * sum(p.numel() for p in model.parameters())  # FP32 bytes, whatever the dtype held

    def _kept(self, cache: torch.Tensor) -> torch.Tensor:
        """A written cache as the package keeps it: rounded to `cache_dtype` (to nearest even,
        as numpy and Core ML round; torch's conversion runs in SIMD, numpy's float16 cast one
        value at a time), held as float32."""
        if self.cache_dtype == np.float32:
            return cache
        return cache.to(_TORCH_DTYPE[self.cache_dtype]).to(torch.float32)

    def _ids(self, ids, offset: int = 0) -> torch.Tensor:
        ids = validate_ids(ids, self.name, self.args.vocab_size, self.context, offset)
        return torch.from_numpy(ids)

    @torch.no_grad()
    def logits(self, ids: np.ndarray) -> np.ndarray:
        tokens = self._ids(ids)
        if self.chunk is None and self._fits(len(tokens)):
            return self.model(tokens).numpy()
        if self.chunk is None:
            return self._head(self.model.hidden(tokens))
        cache = KVCache.empty(self.args, tokens.numel())
        return torch.cat([self.model.forward_cached(part, cache) for part in tokens.split(self.chunk)]).numpy()

    @torch.no_grad()
    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, KVCache]:
        cache = KVCache.empty(self.args, self.context)
        logits = self.model.forward_cached(self._ids(ids), cache)
        return logits.numpy(), KVCache(self._kept(cache.keys), self._kept(cache.values), cache.position)

    def extend(self, snapshot: KVCache, ids: np.ndarray) -> np.ndarray:
        return self.advance(snapshot, ids)[0]

    def prefill_batch(self, prefixes: list[np.ndarray]) -> list[tuple[np.ndarray, KVCache]]:
        empty = KVCache.empty(self.args, 0)
        return self._branches([(empty, ids) for ids in prefixes], lambda logits, cache: (logits, cache), last_only=True)

    def extend_batch(self, branches: list[tuple[KVCache, np.ndarray]]) -> list[np.ndarray]:
        return self._branches(branches, lambda logits, cache: logits)

    def _branches(self, branches: list[tuple[KVCache, np.ndarray]], keep: Callable[[np.ndarray, KVCache], object],
                  last_only: bool = False) -> list:
        """`advance` of each (snapshot, ids) as one batch (`Decoder.forward_branches`), over
        caches of one length that holds every branch's tokens (`ROOM_STEP`), in groups
        (`branch_groups`); each branch's (logits, cache) reduced by `keep` as its group ends, so
        the caches a caller does not read go before the next group runs (a branch's cache is a
        view of its group's stacked tensor, which any one kept branch would hold whole)."""
        slots = self._room(max(max(snapshot.context for snapshot, _ in branches),
                               max(snapshot.position + len(ids) for snapshot, ids in branches)))
        cache_bytes = 2 * 4 * self.args.num_layers * self.args.num_kv_heads * slots * self.args.head_dim
        kept = []
        for group in branch_groups(branches, cache_bytes, self.weight_bytes, BATCH_CACHE_SHARE):
            kept += [keep(*done) for done in self._stacked_branches(
                [(snapshot.position, ids) for snapshot, ids in group],
                torch.stack([_grown(snapshot.keys, slots) for snapshot, _ in group]),
                torch.stack([_grown(snapshot.values, slots) for snapshot, _ in group]), last_only)]
        return kept

    def _room(self, tokens: int) -> int:
        """Cache slots for `tokens`: the next multiple of ROOM_STEP, at most the context (a
        branch past it is refused by `_ids`, naming the context)."""
        return min(-(-tokens // ROOM_STEP) * ROOM_STEP, self.context)

    def advance_arrays(self, branches: list[tuple[tuple[np.ndarray, np.ndarray, int], np.ndarray]],
                       logits_out: np.ndarray | None = None) -> list[tuple[np.ndarray, tuple[np.ndarray, np.ndarray, int]]]:
        """`advance` of each ((keys, values, position), ids) as one batch over numpy caches (a
        `ChunkSchedule.cache_arrays`: the gates run each chunk from the package's own cache),
        with the caches each wrote as numpy arrays in `cache_dtype`. `logits_out`: rows for the
        branches' logits, in order, which the head writes (each branch's logits a view of them),
        so a caller that keeps them somewhere gets them there without a copy or a scratch file."""
        caches = (torch.from_numpy(np.stack([snapshot[part] for snapshot, _ in branches])).to(torch.float32)
                  for part in (0, 1))
        done = self._stacked_branches([(position, ids) for (_, _, position), ids in branches], *caches,
                                      logits_out=logits_out)
        dtype = _TORCH_DTYPE[self.cache_dtype]  # exact: the written caches hold `_kept` values
        return [(logits, (after.keys.to(dtype).numpy(), after.values.to(dtype).numpy(), after.position))
                for logits, after in done]

    @torch.no_grad()
    def single_steps(self, before: tuple[np.ndarray, np.ndarray, int], after: tuple[np.ndarray, np.ndarray, int],
                     ids: np.ndarray, logits_out: np.ndarray | None = None
                     ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, int]]:
        """Each token of `ids` as a one-token chunk of its own, as a package's consecutive
        single-token calls from the numpy cache `before` ((keys, values, position)) run them, in
        one forward (`CacheStep`'s rows_apart): `after` is the package's cache when they are
        done, whose slots before a token's position are the cache that token's call read (slot =
        position). Returns their logits (into `logits_out`'s rows, where given) and `before` with
        each token's K/V written into its slot, in `cache_dtype`: what the calls should have
        left, each from its own cache. One forward of T rows reads the weights once and holds one
        cache, where T branches of a token each (`advance_arrays`) hold T caches."""
        position = before[2]
        if after[2] != position + len(ids):
            raise BackendError(f"{self.name}: single steps of {len(ids)} tokens from position {position} "
                               f"cannot have left a cache at position {after[2]}")
        tokens = self._ids(ids, position)[None]
        keys, values = (torch.from_numpy(np.array(after[part], np.float32)) for part in (0, 1))
        hidden, new_keys, new_values = self.model.hidden_with_cache_tensors(
            tokens, torch.tensor([position]), keys, values, rows_apart=True)
        logits = self._head(hidden[0], logits_out)
        written, slots = [], slice(position, position + len(ids))
        for cache, new in zip(before[:2], (new_keys, new_values)):
            cache = np.array(cache, copy=True)
            cache[..., slots, :] = self._kept(torch.stack(new)[..., slots, :]).numpy()
            written.append(cache)
        return logits, (written[0], written[1], position + len(ids))

    @torch.no_grad()
    def _stacked_branches(self, branches: list[tuple[int, np.ndarray]], keys: torch.Tensor, values: torch.Tensor,
                          last_only: bool = False, logits_out: np.ndarray | None = None) -> list[tuple[np.ndarray, KVCache]]:
        """Each (position, ids) run after its own caches, stacked [B, ...] in `keys` / `values`."""
        tokens = [self._ids(ids, position) for position, ids in branches]
        hidden, keys, values = self.model.hidden_branches(tokens, [position for position, _ in branches], keys, values,
                                                          last_only=last_only)
        keys, values = self._kept(keys), self._kept(values)
        logits = np.split(self._head(torch.cat(hidden), logits_out), np.cumsum([len(h) for h in hidden])[:-1])
        return [(rows, KVCache(keys[i], values[i], position + len(ids)))
                for i, (rows, (position, ids)) in enumerate(zip(logits, branches))]

    def _fits(self, rows: int) -> bool:
        return rows * self.args.vocab_size * 4 <= HEAD_BLOCK_BYTES

    def _head(self, hidden: torch.Tensor, out: np.ndarray | None = None) -> np.ndarray:
        """Logits [T, vocab] of final hidden rows [T, hidden]: in memory, or, over
        HEAD_BLOCK_BYTES, written a block of rows at a time into a scratch file's map; into
        `out`'s rows, a block at a time, where given."""
        if out is None and self._fits(len(hidden)):
            return self.model.logits_of(hidden).numpy()
        logits = ScratchFile().empty((len(hidden), self.args.vocab_size), np.float32) if out is None else out
        step = max(1, HEAD_BLOCK_BYTES // (4 * self.args.vocab_size))
        for start in range(0, len(hidden), step):
            logits[start:start + step] = self.model.logits_of(hidden[start:start + step]).numpy()
        return logits

    @torch.no_grad()
    def advance(self, snapshot: KVCache, ids: np.ndarray) -> tuple[np.ndarray, KVCache]:
        branch = snapshot.snapshot()
        if branch.position + len(ids) > branch.context:  # a batched snapshot holds its own tokens' room
            slots = self._room(branch.position + len(ids))
            branch = KVCache(_grown(branch.keys, slots), _grown(branch.values, slots), branch.position)
        logits = self.model.forward_cached(self._ids(ids, snapshot.position), branch)
        return logits.numpy(), KVCache(self._kept(branch.keys), self._kept(branch.values), branch.position)


def _grown(cache: torch.Tensor, slots: int) -> torch.Tensor:
    """cache [layers, 1, kv, S, D] with empty slots appended up to `slots` (itself when it holds them)."""
    return cache if cache.shape[3] >= slots else F.pad(cache, (0, 0, 0, slots - cache.shape[3]))
