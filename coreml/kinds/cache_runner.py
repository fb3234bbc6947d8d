"""What the kinds that carry a K/V cache share to drive a saved package: frozen cache
snapshots and the runner base.

A chunk-KV package is pure: it takes caches and returns new ones. A stateful package keeps
its caches in Core ML state; its runner copies a snapshot into a fresh state before each
call and copies the state out after it, so both kinds look alike from outside. Snapshots
are frozen numpy arrays, so branching from one (scoring candidates, rollback, the gates'
A/B/A check) can never mutate it by accident.

A package of the Neural Engine's layout takes only its enumerated chunk lengths and may return
its logits in parts (coreml.layout: `enumerated_lengths`, `logit_outputs`): a runner splits
a chunk into enumerated lengths greedily (`pieces`) and concatenates the parts (`joined_logits`),
so every Backend user still sees any chunk's logits [T, vocab].
"""

from dataclasses import dataclass

import numpy as np

from coreml.layout import enumerated_lengths, logit_outputs
from pipeline.ground.errors import CmfdeployError


class PackageInterfaceError(CmfdeployError):
    """A package's inputs or outputs do not follow the contract this runner drives."""


@dataclass(frozen=True)
class KVSnapshot:
    key_cache: np.ndarray  # (layers, 1, kv_heads, context, head_dim), read-only, in the package's cache dtype
    value_cache: np.ndarray
    position: int  # slots [0, position) are valid


def _frozen(array: np.ndarray, dtype=np.float32, fresh: bool = False) -> np.ndarray:
    """`array` as a read-only array of `dtype`: a copy, unless it is `fresh` (a prediction's
    output, which nothing else holds), of that dtype and owns its data: then it is frozen in
    place (a single-token step's two written caches are 38 MB on Gemma 3, copied 1024 times a
    chunk pattern)."""
    if fresh and isinstance(array, np.ndarray) and array.dtype == dtype and array.flags.owndata:
        array.flags.writeable = False
        return array
    array = np.array(array, dtype=dtype, copy=True)
    array.flags.writeable = False
    return array


def input_ids_array(ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32).reshape(1, -1)


def pieces(count: int, lengths: tuple[int, ...] | None) -> list[int]:
    """`count` tokens as calls of enumerated `lengths`, largest first (None: one call of any
    length). 1 is always among the lengths, so the pieces add up to `count` exactly, with no
    padding: 75 over (1, 8, 64, 128) is 64, 8, 1, 1, 1."""
    if lengths is None:
        return [count]
    out = []
    for length in sorted(lengths, reverse=True):
        take, count = divmod(count, length)
        out += [length] * take
    if count:
        raise PackageInterfaceError(f"{count} tokens cannot be split into the enumerated lengths {sorted(lengths)}")
    return out


def padded_pieces(count: int, lengths: tuple[int, ...], room: int) -> list[int]:
    """`count` tokens as calls of enumerated `lengths` where the last may be right-padded:
    the shortest length that holds what is left, where the cache has `room` for it, else the
    longest that the tokens fill (`pieces`' step). 45 over (1, 8, 64, 128) with room is one
    call of 64 (`pieces`: 8, 8, 8, 8, 8, 1, 1, 1, 1, 1)."""
    out = []
    while count:
        fits = [n for n in lengths if count <= n <= room]
        if fits:
            return out + [min(fits)]
        take = max(n for n in lengths if n <= count)
        out, count, room = out + [take], count - take, room - take
    return out


def joined_logits(out: dict, names: list[str]) -> np.ndarray:
    """float32 logits [T, vocab] of one prediction: its logit outputs concatenated in order (one
    output is returned as it is, not copied: a 262k vocabulary's logits at 1024 positions are 1 GB)."""
    parts = [np.asarray(out[name], dtype=np.float32)[0] for name in names]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)


def package_features(package, section: str, kind: str,
                     caches: tuple[str, str] = ("key_cache", "value_cache")) -> dict[str, dict]:
    """The manifest's `package.<section>` features by name, checked to be the `kind` interface
    with its `caches` (the names of the key and value caches) among them."""
    block = (package.manifest or {}).get("package", {})
    features = {f["name"]: f for f in block.get(section, [])}
    if block.get("kind") != kind or not set(caches) <= set(features):
        raise PackageInterfaceError(
            f"{package.path}: manifest package.kind {block.get('kind')!r} with {section} {sorted(features)} "
            f"is not the {kind} interface ({' and '.join(caches)} {section})")
    return features


class CacheRunner:
    """What the cache-carrying kinds share: snapshots, the context check, chunk schedules and
    the Neural Engine layout's pieces and logit parts. Subclasses set `package`, `cache_shape`
    and `cache_dtype`, call `_layout` once, and implement `run`, `_decoder()` (the package or
    function that runs one token) and `_decode(snapshot, token)` (one token [1, 1] through it
    with its rows left for later: the prediction and the next snapshot, for `run_tokens`)."""

    package: object
    cache_shape: tuple[int, ...]
    cache_dtype: type
    lengths: tuple[int, ...] | None  # the enumerated chunk lengths (None: a range)
    logit_names: list[str]  # the outputs whose concatenation is the logits
    vocab: int

    def _layout(self, function: str | None = None) -> None:
        block = self.package.manifest["package"]
        self.lengths, self.logit_names = enumerated_lengths(block, function), logit_outputs(block)
        self.vocab = self.package.manifest["architecture"]["vocab_size"]

    def _pieces(self, ids: np.ndarray) -> list[np.ndarray]:
        """`ids` [1, T] as the calls the package takes (`pieces`)."""
        sizes = pieces(ids.shape[1], self.lengths)
        return [ids[:, end - size:end] for size, end in zip(sizes, np.cumsum(sizes))]

    def _padded_pieces(self, ids: np.ndarray, position: int, pad_id: int) -> list[tuple[np.ndarray, int]]:
        """`ids` [1, T] from `position` as (call, its real tokens) pairs (`padded_pieces`): the
        last call right-padded with `pad_id` where the cache has room for it."""
        if self.lengths is None:
            return [(ids, ids.shape[1])]
        sizes, calls, start = padded_pieces(ids.shape[1], self.lengths, self.context - position), [], 0
        for size in sizes:
            real = ids[:, start:start + size]
            pad = np.full((1, size - real.shape[1]), pad_id, dtype=ids.dtype)
            calls.append((np.concatenate([real, pad], axis=1) if pad.size else real, real.shape[1]))
            start += real.shape[1]
        return calls

    def _logits(self, outs: list[dict]) -> np.ndarray:
        """float32 logits [T, vocab] of the predictions of one chunk's pieces, in order."""
        if not outs:
            return np.zeros((0, self.vocab), np.float32)
        logits = [joined_logits(out, self.logit_names) for out in outs]
        return logits[0] if len(logits) == 1 else np.concatenate(logits)

    @property
    def context(self) -> int:
        return self.cache_shape[3]

    def empty(self, fill: float = 0.0) -> KVSnapshot:
        cache = _frozen(np.full(self.cache_shape, fill), self.cache_dtype)
        return KVSnapshot(cache, cache, 0)

    def _end(self, snapshot: KVSnapshot, ids: np.ndarray) -> int:
        """The position after `ids`, refused when it runs past the cache."""
        end = snapshot.position + ids.shape[1]
        if end > self.context:
            raise PackageInterfaceError(
                f"{self.package.path}: position {snapshot.position} + {ids.shape[1]} tokens "
                f"exceeds the cache context {self.context}")
        return end

    def cache_arrays(self, snapshot: KVSnapshot) -> tuple[np.ndarray, np.ndarray, int]:
        return snapshot.key_cache, snapshot.value_cache, snapshot.position

    def with_cache_arrays(self, snapshot: KVSnapshot, keys, values) -> KVSnapshot:
        return self._snapshot(keys, values, snapshot.position)

    def _snapshot(self, key_cache, value_cache, position: int, fresh: bool = False) -> KVSnapshot:
        """A snapshot of the caches (`fresh`: a prediction's outputs, frozen in place where they can be)."""
        return KVSnapshot(_frozen(key_cache, self.cache_dtype, fresh), _frozen(value_cache, self.cache_dtype, fresh),
                          position)

    def run_tokens(self, snapshot: KVSnapshot, ids) -> tuple[np.ndarray, KVSnapshot]:
        """`ids` a token a call (decode steps) after `snapshot`: their logits [T, vocab] and the
        snapshot after the last, as `run_schedule` with chunks of 1 makes them. Where the package
        runs on the executor and makes its logits from rows alone (`row_outputs`), each call
        leaves its head's rows and the head makes every token's logits at once after the last
        call (`Executor.run(rows_later=True)`): a token's logits feed no later call, and a step
        otherwise reads the head's weight whole for one row. Each row is the one its call would
        make, summed in the order of a product of many rows."""
        ids = input_ids_array(ids)
        decoder = self._decoder()
        if not set(self.logit_names) <= getattr(decoder, "row_outputs", frozenset()):
            return self.run_schedule(ids[0], [1] * ids.shape[1], snapshot)
        self._end(snapshot, ids)
        rows = {name: [] for name in self.logit_names}
        for token in range(ids.shape[1]):
            out, snapshot = self._decode(snapshot, ids[:, token:token + 1])
            # The head's rows alone: a step's written caches go with the next step, where keeping
            # its outputs kept 64 steps' caches (0.75 GB of SmolLM2's 256-slot ones, 6.4 GB of a 1.7B's).
            for name in self.logit_names:
                rows[name].append(out[name])
        return joined_logits({name: decoder.finish_rows(name, np.concatenate(parts, axis=-2))
                              for name, parts in rows.items()}, self.logit_names), snapshot

    def run_schedule(self, ids, schedule, snapshot: KVSnapshot | None = None) -> tuple[np.ndarray, KVSnapshot]:
        """Logits of `ids` fed in chunks of the given sizes, and the snapshot after the last."""
        ids = np.asarray(ids)
        if sum(schedule) != len(ids):
            raise ValueError(f"schedule {schedule} does not cover {len(ids)} tokens")
        snapshot = snapshot or self.empty()
        logits, start = [], 0
        for size in schedule:
            chunk_logits, snapshot = self.run(snapshot, ids[start:start + size])
            logits.append(chunk_logits)
            start += size
        return np.concatenate(logits), snapshot
