"""Drive saved packages token by token: the Backend adapter over any package kind, through
the kind's runner (`coreml.kinds`, `PackageKind.runner`) where it carries a cache."""

from collections.abc import Callable

import numpy as np

from coreml.kinds import KINDS
from coreml.layout import enumerated_lengths, logit_outputs
from coreml.manifest import fp32_weight_bytes
from coreml.kinds.cache_runner import KVSnapshot, PackageInterfaceError, input_ids_array, joined_logits
from coreml.package import open_package
from pipeline.ground.backend_protocol import branch_groups


# A chunk-KV package's batch of branches keeps its caches (the whole context each) within this
# share of the FP32 weight bytes W (`branch_groups`). Package scoring runs as a stage of its own,
# one process within 1.25 W + 1.5 GB: the 1.7B model's batches of 17 peaked at 4.58 GB of private
# memory. The executor's batches are where its speed is: on SmolLM2-135M a sixteenth (2 a batch
# instead of 11) took 1.9x the CPU time to score 40 items.
BATCH_CACHE_SHARE = 1 / 4


class PackageBackend:
    """The Backend protocol (docs/ARCHITECTURE.md) over any package kind.

    Stateless packages have no cache, so `extend` recomputes prefix + suffix in one call
    and returns the suffix's logits; chunk-KV and stateful packages run the prefix once
    and branch from its snapshot, and offer their runner as `chunks` (the ChunkSchedule
    capability of the protocol). `prefill_batch`/`extend_batch` batch chunk-KV predictions,
    a chunk's last piece right-padded to an enumerated length (`ChunkKVRunner.run_batch`).
    A stateless package of enumerated lengths runs n tokens right-padded to the next length it
    takes and returns the first n rows: a causal model's row i reads tokens 0..i only, so the
    padding changes none of them (the gates' padding/future invariant holds the package to it).
    """

    def __init__(self, package, chunk: int | None = None):
        self.package = package
        self.name = package.backend
        kind = package.manifest["package"]["kind"]
        runner = KINDS[kind].runner if kind in KINDS else None
        self.kv = self.chunks = runner(package) if runner else None
        if chunk and not self.kv:
            cached = " or ".join(name for name, unit in KINDS.items() if unit.runner)
            raise PackageInterfaceError(f"{package.path}: --chunk needs a {cached} package, not {kind}")
        self.chunk = chunk
        block = package.manifest["package"]
        self.context = self.kv.context if self.kv else block["context"]
        self.lengths, self.logit_names = enumerated_lengths(block), logit_outputs(block)
        self.weight_bytes = fp32_weight_bytes(package.manifest)
        # One prediction per branch (no chunking) of a package without states: a batch of
        # them shares its weight reads (`ChunkKVRunner.run_batch`); other kinds run one by one.
        self._batches = hasattr(self.kv, "run_batch") and not chunk

    def logits(self, ids) -> np.ndarray:
        return self.prefill(ids)[0]

    def prefill_batch(self, prefixes) -> list:
        if not self._batches:
            return [(logits[-1:], snapshot) for logits, snapshot in map(self.prefill, prefixes)]
        return self._run_batch([(self.kv.empty(), np.asarray(ids)) for ids in prefixes],
                               keep=lambda logits, snapshot: (logits[-1:], snapshot), last_only=True)

    def extend_batch(self, branches) -> list[np.ndarray]:
        if not self._batches:
            return [self.extend(snapshot, ids) for snapshot, ids in branches]
        return self._run_batch([(snapshot, np.asarray(ids)) for snapshot, ids in branches],
                               keep=lambda logits, snapshot: logits, snapshots=False)

    def _run_batch(self, branches, keep: Callable[[np.ndarray, KVSnapshot | None], object], last_only: bool = False,
                   snapshots: bool = True) -> list:
        """`run_batch` in groups whose caches fit the batch's share of memory (`branch_groups`):
        a chunk-KV branch carries the package's whole context of cache. Each branch's (logits,
        snapshot) is reduced by `keep` as its group ends, so what the caller does not read (the
        caches a candidate wrote: 40 of the 1.7B model's, 4 GB) is not held while later groups run."""
        snapshot = branches[0][0] if branches else None
        cache_bytes = 0 if snapshot is None else 4 * (snapshot.key_cache.size + snapshot.value_cache.size)
        kept = []
        for group in branch_groups(branches, cache_bytes, self.weight_bytes, BATCH_CACHE_SHARE):
            kept += [keep(*done) for done in self.kv.run_batch(group, self._pad_id(), last_only, snapshots)]
        return kept

    def prefill(self, ids):
        ids = np.asarray(ids)
        if not self.kv:
            return self._stateless(ids), ids
        return self._feed(self.kv.empty(), ids)

    def _stateless(self, ids: np.ndarray) -> np.ndarray:
        """One forward of a stateless package: logits [T, vocab], padded to an enumerated length."""
        count = len(ids)
        if self.lengths is not None:
            fits = [n for n in self.lengths if n >= count]
            if not fits:
                raise PackageInterfaceError(f"{self.package.path}: {count} tokens exceed the longest enumerated "
                                            f"length {max(self.lengths)}")
            ids = np.concatenate([ids, np.full(min(fits) - count, self._pad_id(), dtype=ids.dtype)])
        out = self.package.predict({"input_ids": input_ids_array(ids)})
        return joined_logits(out, self.logit_names)[:count]

    def _pad_id(self) -> int:
        """PAD, else the first EOS, else id 0: padding only has to be a real token id."""
        tokens = self.package.manifest.get("special_tokens", {})
        pad = tokens.get("pad_token_id")
        return pad if pad is not None else (tokens.get("eos_token_ids") or [0])[0]

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
