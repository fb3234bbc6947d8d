"""The chunk-KV package: tokens at an absolute position, the K/V cache passed in and out as
float32 tensors, so a host can prefill and decode in chunks of any size.

Its graph is checked against the reference on fixed chunk schedules before anything is
converted; a graph that fails is refused, never shipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from coreml.kinds.base import CACHE_MEANING, PackageKind, feature, position_feature, register_kind
from coreml.kinds.cache_runner import KVSnapshot, CacheRunner, package_features, input_ids_array

if TYPE_CHECKING:
    from torch import nn

    from coreml.kinds.export import Reference
    from coreml.precisions import Precision
    from manifests.identity import Manifest


class ChunkKVRunner(CacheRunner):
    """Feeds a chunk-KV package: `run(snapshot, ids)` returns logits and the next snapshot, with
    caches in the dtype the package's interface declares (float32, or float16 at fp16)."""

    def __init__(self, package):
        cache = package_features(package, "inputs", "chunk_kv")["key_cache"]
        self.package = package
        self.cache_shape = tuple(cache["shape"])
        self.cache_dtype = np.dtype(cache["dtype"]).type

    def run(self, snapshot: KVSnapshot, ids) -> tuple[np.ndarray, KVSnapshot]:
        feed, end = self._feed(snapshot, ids)
        return self._result(self.package.predict(feed), end)

    def run_batch(self, branches) -> list[tuple[np.ndarray, KVSnapshot]]:
        """`run` of each (snapshot, ids) in one batch prediction (`predict_batch`)."""
        feeds, ends = zip(*(self._feed(snapshot, ids) for snapshot, ids in branches))
        return [self._result(out, end) for out, end in zip(self.package.predict_batch(list(feeds)), ends)]

    def _feed(self, snapshot: KVSnapshot, ids) -> tuple[dict, int]:
        ids = input_ids_array(ids)
        return {"input_ids": ids, "position": np.array([snapshot.position], dtype=np.int32),
                "key_cache": snapshot.key_cache, "value_cache": snapshot.value_cache}, self._end(snapshot, ids)

    def _result(self, out: dict, end: int) -> tuple[np.ndarray, KVSnapshot]:
        next_snapshot = self._snapshot(out["new_key_cache"], out["new_value_cache"], end)
        return np.asarray(out["logits"], dtype=np.float32)[0], next_snapshot


@register_kind
class ChunkKV(PackageKind):
    name = "chunk_kv"
    description = "Chunk-KV decoder: tokens at an absolute position, KV cache passed in and out as float32"
    steps = 3
    runner = ChunkKVRunner

    def cache_dtype(self, precision: Precision) -> type[np.floating]:
        return precision.numpy_dtype.type

    def description_for(self, precision: Precision) -> str:
        return self.description.replace("float32", precision.float_dtype)

    def interface(self, ref: Reference) -> dict:
        block, cache, dtype = super().interface(ref), list(ref.cache_shape), ref.precision.float_dtype
        block["inputs"] += [position_feature(), feature("key_cache", dtype, cache, f"keys {CACHE_MEANING}"),
                            feature("value_cache", dtype, cache, f"values {CACHE_MEANING}")]
        block["outputs"] += [
            feature("new_key_cache", dtype, cache, "key_cache with slots position..position+T-1 written"),
            feature("new_value_cache", dtype, cache, "value_cache with slots position..position+T-1 written"),
        ]
        return block

    def graph(self, ref: Reference) -> nn.Module:
        """The reference model's own cached step: `(ids, position, k, v) -> (logits, k', v')`."""
        from pipeline.ground.models import CachedStep

        return CachedStep(ref.model)

    def export(self, ref: Reference, package_dir: Path, step: Callable[[str], None]) -> Manifest:
        import torch

        from coreml.kinds.export import (TRACE_LENGTH, example_ids, position_tensor, save_single, trace_module,
                                         check_chunk_schedules, traced_check_record)

        start = time.perf_counter()
        step("chunk_kv: trace and check schedules")
        zeros = torch.zeros(ref.cache_shape)
        example = (example_ids(ref.args.vocab_size, TRACE_LENGTH, 0), position_tensor(3), zeros, zeros)
        traced = trace_module(self.graph(ref), example)
        checks = {"schedules_vs_reference_max_abs": check_chunk_schedules(traced, ref), "tolerance": ref.tolerance,
                  **traced_check_record(ref.precision)}
        return save_single(ref, package_dir, step, traced, self.interface(ref), self.description_for(ref.precision),
                           checks, start)

    def snippet(self, interface: dict) -> list[str]:
        cache = next(f for f in interface["inputs"] if f["name"] == "key_cache")
        return [
            f"cache = np.zeros({tuple(cache['shape'])}, dtype=np.{cache['dtype']})  # (layer, batch, kv_head, slot, head_dim)",
            "inputs.update(position=np.array([0], dtype=np.int32), key_cache=cache, value_cache=cache)",
            "out = model.predict(inputs)  # out['new_key_cache'], out['new_value_cache'] feed the next call",
        ]
