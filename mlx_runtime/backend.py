"""`MlxBackend`: the MLX runtime behind the scoring/logits harness's Backend protocol
(`pipeline.stages.backends`). Snapshots are immutable `cache.Snapshot`s; `extend` branches from
one without changing it."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from pipeline.ground.backend_protocol import validate_ids
from pipeline.ground.cmf import open_cmf
from pipeline.ground.reference import task_mask
from mlx_runtime.cache import KVCache, Snapshot
from mlx_runtime.generate import GEMM_MIN_TOKENS
from mlx_runtime.models import Model, forward, load_model


def load(cmf_path: str | Path, task: str | int | None = None, skill: str | None = None) -> Model:
    """The model of a CMF file; its weights are copied out of the mmap, which is then closed."""
    with open_cmf(cmf_path) as cmf:
        return load_model(cmf, None if task is None else task_mask(cmf, task), skill)


class MlxBackend:
    name = "mlx"

    def __init__(self, cmf_path: str | Path, task: str | int | None = None, skill: str | None = None):
        self.model = load(cmf_path, task, skill)
        self.args = self.model.args
        self.context = self.args.max_position_embeddings

    def _ids(self, ids, offset: int = 0) -> np.ndarray:
        return validate_ids(ids, self.name, self.args.vocab_size, self.context, offset)

    def _run(self, ids: np.ndarray, cache: KVCache) -> np.ndarray:
        logits = forward(self.model, ids, cache, gemm=ids.size >= GEMM_MIN_TOKENS)
        return np.array(logits)

    def logits(self, ids: np.ndarray) -> np.ndarray:
        ids = self._ids(ids)
        return self._run(ids, self.model.new_cache(ids.size))

    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, Snapshot]:
        ids = self._ids(ids)
        cache = self.model.new_cache(ids.size)
        logits = self._run(ids, cache)
        snap = cache.snapshot()
        mx.eval(*snap.keys, *snap.values)
        return logits, snap

    def extend(self, snapshot: Snapshot, ids: np.ndarray) -> np.ndarray:
        return self.advance(snapshot, ids)[0]

    def advance(self, snapshot: Snapshot, ids: np.ndarray) -> tuple[np.ndarray, Snapshot]:
        cache = KVCache.restore(snapshot)
        logits = self._run(self._ids(ids, snapshot.position), cache)
        return logits, cache.snapshot()
