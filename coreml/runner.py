"""Drive saved packages token by token: the chunk-KV contract and the Backend adapter.

A chunk-KV package is pure: it takes caches and returns new ones. Snapshots here are
frozen numpy arrays, so branching from one (scoring candidates, rollback, the gates'
A/B/A check) can never mutate it by accident.
"""

from dataclasses import dataclass

import numpy as np

from coreml.package import open_package
from pipeline.errors import CmfdeployError


class PackageInterfaceError(CmfdeployError):
    """A package's inputs or outputs do not follow the contract this runner drives."""


@dataclass(frozen=True)
class KVSnapshot:
    key_cache: np.ndarray  # (layers, 1, kv_heads, context, head_dim), read-only
    value_cache: np.ndarray
    position: int  # slots [0, position) are valid


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.array(array, dtype=np.float32, copy=True)
    array.flags.writeable = False
    return array


def _input_ids(ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32).reshape(1, -1)


class ChunkKVRunner:
    """Feeds a chunk-KV package: `run(snapshot, ids)` returns logits and the next snapshot."""

    def __init__(self, package):
        self.package = package
        shapes = {i["name"]: i["shape"] for i in package.manifest["package"]["inputs"]}
        if "key_cache" not in shapes or "position" not in shapes:
            raise PackageInterfaceError(
                f"{package.path}: inputs {sorted(shapes)} are not the chunk-KV interface "
                "(input_ids, position, key_cache, value_cache)")
        self.cache_shape = tuple(shapes["key_cache"])
        self.context = self.cache_shape[3]

    def empty(self, fill: float = 0.0) -> KVSnapshot:
        cache = _frozen(np.full(self.cache_shape, fill, dtype=np.float32))
        return KVSnapshot(cache, cache, 0)

    def run(self, snapshot: KVSnapshot, ids) -> tuple[np.ndarray, KVSnapshot]:
        ids = _input_ids(ids)
        end = snapshot.position + ids.shape[1]
        if end > self.context:
            raise PackageInterfaceError(
                f"{self.package.path}: position {snapshot.position} + {ids.shape[1]} tokens "
                f"exceeds the cache context {self.context}")
        out = self.package.predict({
            "input_ids": ids,
            "position": np.array([snapshot.position], dtype=np.int32),
            "key_cache": snapshot.key_cache,
            "value_cache": snapshot.value_cache,
        })
        next_snapshot = KVSnapshot(_frozen(out["new_key_cache"]), _frozen(out["new_value_cache"]), end)
        return np.asarray(out["logits"], dtype=np.float32)[0], next_snapshot

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


class PackageBackend:
    """The Backend protocol (docs/ARCHITECTURE.md) over a stateless or chunk-KV package.

    Stateless packages have no cache, so `extend` recomputes prefix + suffix in one call
    and returns the suffix's logits; chunk-KV packages run the prefix once and branch.
    """

    def __init__(self, package, chunk: int | None = None):
        self.package = package
        self.name = package.backend
        kind = package.manifest["package"]["kind"]
        self.kv = ChunkKVRunner(package) if kind == "chunk_kv" else None
        if chunk and not self.kv:
            raise PackageInterfaceError(f"{package.path}: --chunk needs a chunk_kv package, not {kind}")
        self.chunk = chunk
        self.context = self.kv.context if self.kv else package.manifest["package"]["context"]

    def logits(self, ids) -> np.ndarray:
        return self.prefill(ids)[0]

    def prefill(self, ids):
        ids = np.asarray(ids)
        if not self.kv:
            return np.asarray(self.package.predict({"input_ids": _input_ids(ids)})["logits"])[0], ids
        return self._feed(self.kv.empty(), ids)

    def extend(self, snapshot, ids) -> np.ndarray:
        ids = np.asarray(ids)
        if not self.kv:
            return self.prefill(np.concatenate([snapshot, ids]))[0][len(snapshot):]
        return self._feed(snapshot, ids)[0]

    def _feed(self, snapshot: KVSnapshot, ids: np.ndarray):
        step = self.chunk or len(ids)
        schedule = [min(step, len(ids) - start) for start in range(0, len(ids), step)]
        return self.kv.run_schedule(ids, schedule, snapshot)


def open_package_backend(package_dir, backend: str = "auto", chunk: int | None = None) -> PackageBackend:
    return PackageBackend(open_package(package_dir, backend=backend), chunk=chunk)
