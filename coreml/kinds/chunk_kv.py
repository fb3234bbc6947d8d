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

from coreml.kinds.base import (CACHE_MEANING, PackageKind, chunked_prompt_lines, feature, position_feature,
                               register_kind)
from coreml.layout import enumerated_lengths
from coreml.kinds.cache_runner import KVSnapshot, CacheRunner, input_ids_array, package_features

if TYPE_CHECKING:
    from torch import nn

    from coreml.kinds.export import Reference
    from coreml.precisions import Precision
    from manifests.identity import Manifest


class ChunkKVRunner(CacheRunner):
    """Feeds a chunk-KV package: `run(snapshot, ids)` returns logits and the next snapshot, with
    caches in the dtype the package's interface declares (float32, or float16 at fp16). A chunk
    runs as the package's enumerated lengths where it has them (`CacheRunner._pieces`), each
    piece from the cache the one before wrote."""

    def __init__(self, package):
        cache = package_features(package, "inputs", "chunk_kv")["key_cache"]
        self.package = package
        self.cache_shape = tuple(cache["shape"])
        self.cache_dtype = np.dtype(cache["dtype"]).type
        self._layout()

    def run(self, snapshot: KVSnapshot, ids) -> tuple[np.ndarray, KVSnapshot]:
        return self._rounds([(snapshot, ids)], lambda feeds, _rows, _outputs: [self.package.predict(feed) for feed in feeds])[0]

    def run_batch(self, branches, pad_id: int | None = None, last_only: bool = False,
                  snapshots: bool = True) -> list[tuple[np.ndarray, KVSnapshot | None]]:
        """`run` of each (snapshot, ids) in batch predictions (`predict_batch`): one batch per
        round of pieces, each branch's i-th piece in round i.

        `pad_id`: each chunk's last piece is right-padded to an enumerated length where the
        cache has room (`_padded_pieces`), so a 45-token prefix is one call of 64, not ten.
        The real rows are `run`'s: a row reads the tokens before it only. The padding's K/V
        land past the snapshot's position, where every later query masks them until a later
        chunk writes over them: the dirty-tail invariant every chunk-KV gate checks. Scoring
        takes it (`PackageBackend`); the gates' chunk patterns run unpadded, since they
        compare every slot of the caches a chunk writes.

        Only the real rows' logits are asked of a padded piece, and with `last_only` only the
        chunk's last token's (a prefix's, in scoring): the package's head computes no others
        where it makes its logits from rows alone (`Executor.run_batch`). Without `snapshots`,
        a branch's last piece is asked for its logits alone, and None stands for its snapshot:
        a scoring candidate's written caches (two of the whole context's, stacked and copied,
        17% of scoring Gemma 3) are never read."""
        return self._rounds(branches, self.package.predict_batch, pad_id, last_only, snapshots)

    def _rounds(self, branches, predict, pad_id: int | None = None, last_only: bool = False,
                snapshots: bool = True) -> list[tuple[np.ndarray, KVSnapshot | None]]:
        ids = [input_ids_array(chunk) for _, chunk in branches]
        for (snapshot, _), chunk in zip(branches, ids):
            self._end(snapshot, chunk)  # the whole chunk checked before any piece runs
        split = [[(piece, piece.shape[1]) for piece in self._pieces(chunk)] if pad_id is None
                 else self._padded_pieces(chunk, snapshot.position, pad_id)
                 for (snapshot, _), chunk in zip(branches, ids)]
        states, outs = [snapshot for snapshot, _ in branches], [[] for _ in branches]
        for round_ in range(max(map(len, split), default=0)):
            active = [i for i, chunks in enumerate(split) if round_ < len(chunks)]
            # Branches whose caches a later piece or the caller reads, and those done with them.
            for group, outputs in (([i for i in active if snapshots or round_ < len(split[i]) - 1], None),
                                   ([i for i in active if not snapshots and round_ == len(split[i]) - 1],
                                    self.logit_names)):
                if not group:
                    continue
                feeds = [self._feed(states[i], split[i][round_][0]) for i in group]
                rows = [self._rows_wanted(split[i], round_, last_only) for i in group]
                for i, out in zip(group, predict(feeds, rows, outputs)):
                    # The logits alone: a piece's written caches live on in the next snapshot only.
                    outs[i].append({name: out[name] for name in self.logit_names})
                    states[i] = None if outputs else self._snapshot(out["new_key_cache"], out["new_value_cache"],
                                                                    states[i].position + split[i][round_][1], fresh=True)
        return [(self._logits(out), state) for out, state in zip(outs, states)]

    def _decoder(self):
        return self.package

    def _decode(self, snapshot: KVSnapshot, token: np.ndarray) -> tuple[dict, KVSnapshot]:
        out = self.package.predict(self._feed(snapshot, token), rows_later=True)
        return out, self._snapshot(out["new_key_cache"], out["new_value_cache"], snapshot.position + 1, fresh=True)

    def _rows_wanted(self, pieces: list[tuple[np.ndarray, int]], index: int, last_only: bool) -> dict | None:
        """Logit output -> the rows wanted of piece `index`'s prediction; None: all of them."""
        piece, real = pieces[index]
        if last_only:
            rows = np.arange(real - 1, real) if index == len(pieces) - 1 else np.arange(0)
        elif real < piece.shape[1]:
            rows = np.arange(real)
        else:
            return None
        return {name: rows for name in self.logit_names}

    def _feed(self, snapshot: KVSnapshot, ids) -> dict:
        self._end(snapshot, ids)
        return {"input_ids": ids, "position": np.array([snapshot.position], dtype=np.int32),
                "key_cache": snapshot.key_cache, "value_cache": snapshot.value_cache}


@register_kind
class ChunkKV(PackageKind):
    name = "chunk_kv"
    description = "Chunk-KV decoder: tokens at an absolute position, KV cache passed in and out as float32"
    steps = 3
    runner = ChunkKVRunner

    def cache_dtype(self, precision: Precision) -> type[np.floating]:
        return precision.numpy_dtype.type

    def description_for(self, ref: Reference) -> str:
        return self.description.replace("float32", ref.precision.float_dtype)

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
        """The reference model's own cached step: `(ids, position, k, v) -> (logits, k', v')`, the
        logits in parts where the head is split (`(logits_0, .., k', v')`)."""
        from coreml.kinds.export import SplitHeadStep
        from pipeline.ground.models import CachedStep

        return CachedStep(ref.model) if ref.head_rows is None else SplitHeadStep(ref.model, ref.head_rows).eval()

    def export(self, ref: Reference, package_dir: Path, step: Callable[[str], None]) -> Manifest:
        import torch

        from coreml.kinds.export import (TRACE_LENGTH, example_ids, position_tensor, save_single, trace_module,
                                         check_chunk_schedules, traced_check_record)
        from pipeline.ground.workers import return_freed_memory

        start = time.perf_counter()
        step("chunk_kv: trace and check schedules")
        zeros = torch.zeros(ref.cache_shape)
        traced = trace_module(self.graph(ref), (example_ids(ref.args.vocab_size, TRACE_LENGTH, 0), position_tensor(3),
                                                zeros, zeros))
        del zeros
        return_freed_memory()  # the example cache and the trace's copies of it: 0.9 GB at a context of 8192
        checks = {"schedules_vs_reference_max_abs": check_chunk_schedules(traced, ref), "tolerance": ref.tolerance,
                  **traced_check_record(ref.precision)}
        return save_single(ref, package_dir, step, traced, self.interface(ref), self.description_for(ref),
                           checks, start)

    def snippet(self, interface: dict) -> list[str]:
        cache = next(f for f in interface["inputs"] if f["name"] == "key_cache")
        zeros = f"cache = np.zeros({tuple(cache['shape'])}, dtype=np.{cache['dtype']})  # (layer, batch, kv_head, slot, head_dim)"
        lengths = enumerated_lengths(interface)
        if lengths is None:
            return [zeros, "inputs.update(position=np.array([0], dtype=np.int32), key_cache=cache, value_cache=cache)",
                    "out = model.predict(inputs)  # out['new_key_cache'], out['new_value_cache'] feed the next call"]
        return [zeros, "keys = values = cache",
                *chunked_prompt_lines(lengths, 'model.predict({"input_ids": chunk, "position": np.array([position], '
                                               'dtype=np.int32), "key_cache": keys, "value_cache": values})',
                                      'keys, values = out["new_key_cache"], out["new_value_cache"]')]
