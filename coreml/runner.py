"""Drive saved packages token by token: the chunk-KV and stateful contracts, the Backend adapter.

A chunk-KV package is pure: it takes caches and returns new ones. A stateful package keeps
its caches in Core ML state; its runner copies a snapshot into a fresh state before each
call and copies the state out after it, so both kinds look alike from outside. Snapshots
are frozen numpy arrays, so branching from one (scoring candidates, rollback, the gates'
A/B/A check) can never mutate it by accident.
"""

from dataclasses import dataclass

import numpy as np

from coreml.package import open_package
from pipeline.ground.errors import CmfdeployError


class PackageInterfaceError(CmfdeployError):
    """A package's inputs or outputs do not follow the contract this runner drives."""


@dataclass(frozen=True)
class KVSnapshot:
    key_cache: np.ndarray  # (layers, 1, kv_heads, context, head_dim), read-only, in the package's cache dtype
    value_cache: np.ndarray
    position: int  # slots [0, position) are valid


def _frozen(array: np.ndarray, dtype=np.float32) -> np.ndarray:
    array = np.array(array, dtype=dtype, copy=True)
    array.flags.writeable = False
    return array


def _input_ids(ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32).reshape(1, -1)


def _features(package, section: str, kind: str) -> dict[str, dict]:
    """The manifest's `package.<section>` features by name, checked to be the `kind` interface."""
    block = (package.manifest or {}).get("package", {})
    features = {f["name"]: f for f in block.get(section, [])}
    if block.get("kind") != kind or "key_cache" not in features or "value_cache" not in features:
        raise PackageInterfaceError(
            f"{package.path}: manifest package.kind {block.get('kind')!r} with {section} {sorted(features)} "
            f"is not the {kind} interface (key_cache and value_cache {section})")
    return features


class _CacheRunner:
    """What the cache-carrying kinds share: snapshots, the context check and chunk schedules.
    Subclasses set `package`, `cache_shape` and `cache_dtype`, and implement `run`."""

    package: object
    cache_shape: tuple[int, ...]
    cache_dtype: type

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

    def _snapshot(self, key_cache, value_cache, position: int) -> KVSnapshot:
        return KVSnapshot(_frozen(key_cache, self.cache_dtype), _frozen(value_cache, self.cache_dtype), position)

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


class ChunkKVRunner(_CacheRunner):
    """Feeds a chunk-KV package: `run(snapshot, ids)` returns logits and the next snapshot."""

    cache_dtype = np.float32

    def __init__(self, package):
        self.package = package
        self.cache_shape = tuple(_features(package, "inputs", "chunk_kv")["key_cache"]["shape"])

    def run(self, snapshot: KVSnapshot, ids) -> tuple[np.ndarray, KVSnapshot]:
        feed, end = self._feed(snapshot, ids)
        return self._result(self.package.predict(feed), end)

    def run_batch(self, branches) -> list[tuple[np.ndarray, KVSnapshot]]:
        """`run` of each (snapshot, ids) in one batch prediction (`predict_batch`)."""
        feeds, ends = zip(*(self._feed(snapshot, ids) for snapshot, ids in branches))
        return [self._result(out, end) for out, end in zip(self.package.predict_batch(list(feeds)), ends)]

    def _feed(self, snapshot: KVSnapshot, ids) -> tuple[dict, int]:
        ids = _input_ids(ids)
        return {"input_ids": ids, "position": np.array([snapshot.position], dtype=np.int32),
                "key_cache": snapshot.key_cache, "value_cache": snapshot.value_cache}, self._end(snapshot, ids)

    def _result(self, out: dict, end: int) -> tuple[np.ndarray, KVSnapshot]:
        next_snapshot = self._snapshot(out["new_key_cache"], out["new_value_cache"], end)
        return np.asarray(out["logits"], dtype=np.float32)[0], next_snapshot


class StatefulRunner(_CacheRunner):
    """Feeds a stateful package through the same snapshot interface as ChunkKVRunner.

    `package` is any function of the package opened with `open_package`; the runner runs
    its `prefill` (chunks of 2+ tokens) and `decode` (1 token) on the same backend. Each run
    writes the snapshot's fp16 caches into a fresh state, so a state never outlives one
    call and no snapshot shares memory with one.
    """

    FUNCTIONS = ("prefill", "decode")
    cache_dtype = np.float16

    def __init__(self, package):
        states = _features(package, "states", "stateful")
        self.package = package
        self.cache_shape = tuple(states["key_cache"]["shape"])
        self.functions = {name: package if package.function_name == name else package.function(name)
                          for name in self.FUNCTIONS}

    def run(self, snapshot: KVSnapshot, ids) -> tuple[np.ndarray, KVSnapshot]:
        ids = _input_ids(ids)
        end = self._end(snapshot, ids)
        function = self.functions["decode" if ids.shape[1] == 1 else "prefill"]
        state = function.make_state()
        state.write_state("key_cache", snapshot.key_cache)
        state.write_state("value_cache", snapshot.value_cache)
        out = function.predict({"input_ids": ids, "position": np.array([snapshot.position], dtype=np.int32)},
                               state=state)
        next_snapshot = self._snapshot(state.read_state("key_cache"), state.read_state("value_cache"), end)
        return np.asarray(out["logits"], dtype=np.float32)[0], next_snapshot


RUNNERS = {"chunk_kv": ChunkKVRunner, "stateful": StatefulRunner}


class PackageBackend:
    """The Backend protocol (docs/ARCHITECTURE.md) over any package kind.

    Stateless packages have no cache, so `extend` recomputes prefix + suffix in one call
    and returns the suffix's logits; chunk-KV and stateful packages run the prefix once
    and branch from its snapshot, and offer their runner as `chunks` (the ChunkSchedule
    capability of the protocol). `prefill_batch`/`extend_batch` batch chunk-KV predictions.
    """

    def __init__(self, package, chunk: int | None = None):
        self.package = package
        self.name = package.backend
        kind = package.manifest["package"]["kind"]
        self.kv = self.chunks = RUNNERS[kind](package) if kind in RUNNERS else None
        if chunk and not self.kv:
            raise PackageInterfaceError(f"{package.path}: --chunk needs a chunk_kv or stateful package, not {kind}")
        self.chunk = chunk
        self.context = self.kv.context if self.kv else package.manifest["package"]["context"]
        # One prediction per branch (no chunking) of a package without states: a batch of
        # them shares its weight reads (`ChunkKVRunner.run_batch`); other kinds run one by one.
        self._batches = kind == "chunk_kv" and not chunk

    def logits(self, ids) -> np.ndarray:
        return self.prefill(ids)[0]

    def prefill_batch(self, prefixes) -> list:
        prefilled = (self.kv.run_batch([(self.kv.empty(), np.asarray(ids)) for ids in prefixes]) if self._batches
                     else [self.prefill(ids) for ids in prefixes])
        return [(logits[-1:], snapshot) for logits, snapshot in prefilled]

    def extend_batch(self, branches) -> list[np.ndarray]:
        if not self._batches:
            return [self.extend(snapshot, ids) for snapshot, ids in branches]
        return [logits for logits, _ in self.kv.run_batch([(snapshot, np.asarray(ids)) for snapshot, ids in branches])]

    def prefill(self, ids):
        ids = np.asarray(ids)
        if not self.kv:
            return np.asarray(self.package.predict({"input_ids": _input_ids(ids)})["logits"])[0], ids
        return self._feed(self.kv.empty(), ids)

    def extend(self, snapshot, ids) -> np.ndarray:
        return self.advance(snapshot, ids)[0]

    def advance(self, snapshot, ids):
        ids = np.asarray(ids)
        if not self.kv:
            logits, joined = self.prefill(np.concatenate([snapshot, ids]))
            return logits[len(snapshot):], joined
        return self._feed(snapshot, ids)

    def _feed(self, snapshot: KVSnapshot, ids: np.ndarray):
        step = self.chunk or len(ids)
        schedule = [min(step, len(ids) - start) for start in range(0, len(ids), step)]
        return self.kv.run_schedule(ids, schedule, snapshot)


def open_package_backend(package_dir, backend: str = "auto", chunk: int | None = None) -> PackageBackend:
    return PackageBackend(open_package(package_dir, backend=backend), chunk=chunk)
