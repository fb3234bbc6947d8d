"""One harness for logits, perplexity, scoring and gates: the Backend protocol and its dispatch.

    backend = open_backend("model.cmf")              # torch reference, FP32
    backend = open_backend("out/package")            # a folder with model.mlpackage: Core ML
    backend = open_backend("model.cmf", "mlx")       # the MLX runtime
    backend = open_backend("dist/model-int8-b32")    # a release: the package it ships

Each runtime implements the protocol in its own area; this module holds the torch one and
imports the others only when asked for, so the reference path never needs coremltools or MLX.
The protocol itself lives in `pipeline.backend_protocol`, which needs no torch.
"""

from pathlib import Path

import numpy as np
import torch

from pipeline.backend_protocol import BACKENDS, Backend, BackendError, validate_ids
from pipeline.models import Decoder, KVCache, ModelArgs
from pipeline.reference import load_reference

PACKAGE_MARKER = "model.mlpackage"
RELEASE_FORMAT = "cmfdeploy.release/1"
# The torch cache is [layers, 1, kv, context, head_dim] and attention reads all of it, so the
# default stays far below the long contexts some models declare; `context=` raises it.
DEFAULT_TORCH_CONTEXT = 2048


class TorchBackend:
    """The FP32 reference decoder behind the Backend protocol.

    Snapshots are KVCaches whose tensors the model never writes in place, so holding one
    costs nothing and `extend` branches from it freely. With `chunk`, `logits` feeds the
    sequence through the cache `chunk` tokens at a time (the path a chunked package takes).
    """

    name = "torch-fp32"

    def __init__(self, model: Decoder, args: ModelArgs, context: int | None = None, chunk: int | None = None):
        self.model, self.args = model, args
        self.context = min(args.max_position_embeddings, DEFAULT_TORCH_CONTEXT) if context is None else context
        if chunk is not None and chunk < 1:
            raise BackendError(f"torch backend: chunk {chunk} must be at least 1")
        self.chunk = chunk

    def _ids(self, ids, offset: int = 0) -> torch.Tensor:
        ids = validate_ids(ids, self.name, self.args.vocab_size, self.context, offset)
        return torch.from_numpy(ids)

    @torch.no_grad()
    def logits(self, ids: np.ndarray) -> np.ndarray:
        tokens = self._ids(ids)
        if self.chunk is None:
            return self.model(tokens).numpy()
        cache = KVCache.empty(self.args, tokens.numel())
        return torch.cat([self.model.forward_cached(part, cache) for part in tokens.split(self.chunk)]).numpy()

    @torch.no_grad()
    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, KVCache]:
        cache = KVCache.empty(self.args, self.context)
        logits = self.model.forward_cached(self._ids(ids), cache)
        return logits.numpy(), cache.snapshot()

    def extend(self, snapshot: KVCache, ids: np.ndarray) -> np.ndarray:
        return self.advance(snapshot, ids)[0]

    def prefill_batch(self, prefixes: list[np.ndarray]) -> list[tuple[np.ndarray, KVCache]]:
        empty = KVCache.empty(self.args, self.context)
        return self._branches([(empty, ids) for ids in prefixes], last_only=True)

    def extend_batch(self, branches: list[tuple[KVCache, np.ndarray]]) -> list[np.ndarray]:
        return [logits for logits, _ in self._branches(branches)]

    @torch.no_grad()
    def _branches(self, branches: list[tuple[KVCache, np.ndarray]], last_only: bool = False
                  ) -> list[tuple[np.ndarray, KVCache]]:
        """`advance` of each (snapshot, ids) as one batch (`Decoder.forward_branches`)."""
        tokens = [self._ids(ids, snapshot.position) for snapshot, ids in branches]
        logits, keys, values = self.model.forward_branches(
            tokens, [snapshot.position for snapshot, _ in branches],
            torch.stack([snapshot.keys for snapshot, _ in branches]),
            torch.stack([snapshot.values for snapshot, _ in branches]), last_only=last_only)
        return [(rows.numpy(), KVCache(keys[i], values[i], snapshot.position + len(ids)))
                for i, (rows, (snapshot, ids)) in enumerate(zip(logits, branches))]

    @torch.no_grad()
    def advance(self, snapshot: KVCache, ids: np.ndarray) -> tuple[np.ndarray, KVCache]:
        branch = snapshot.snapshot()
        logits = self.model.forward_cached(self._ids(ids, snapshot.position), branch)
        return logits.numpy(), branch.snapshot()


def release_package(path: Path) -> Path | None:
    """The package folder a release folder runs as: the compressed package it ships (the
    manifest's second package, by the release schema); None when `path` is not a release."""
    from manifests.identity import MANIFEST_NAME, load_manifest

    if not (path.is_dir() and (path / MANIFEST_NAME).is_file()) or (path / PACKAGE_MARKER).exists():
        return None
    manifest = load_manifest(path)
    if manifest["format"] != RELEASE_FORMAT:
        return None
    return path / manifest["packages"][1]["path"]


def open_backend(artifact: str | Path, backend: str = "auto", **options) -> Backend:
    """The backend for an artifact: a CMF file or bundle folder runs on torch ("auto"/"torch")
    or MLX ("mlx"); a folder holding model.mlpackage runs on Core ML ("auto"/"coreml", or
    "coreml-executor"/"coreml-macos" to pick the engine). `options` go to the backend:
    torch takes task, skill, blend, temperature, context, chunk; Core ML takes chunk. A release
    folder runs as the package it ships (`release_package`)."""
    path = Path(artifact)
    if backend not in BACKENDS:
        raise BackendError(f"{path}: backend {backend!r} is not one of {BACKENDS}")
    if not path.exists():
        raise BackendError(f"{path}: no such file or folder")
    path = release_package(path) or path
    is_package = path.is_dir() and (path / PACKAGE_MARKER).exists()
    if is_package:
        if backend not in ("auto", "coreml", "coreml-executor", "coreml-macos"):
            raise BackendError(f"{path}: a Core ML package folder runs on coreml, not {backend!r}")
        from coreml.runner import open_package_backend

        return open_package_backend(path, backend="auto" if backend in ("auto", "coreml") else backend, **options)
    if backend.startswith("coreml"):
        raise BackendError(f"{path}: backend {backend!r} needs a folder holding {PACKAGE_MARKER}")
    if backend == "mlx":
        if path.is_dir():
            raise BackendError(f"{path}: the MLX runtime reads CMF files, not folders")
        from mlx_runtime.backend import MlxBackend

        return MlxBackend(path, **options)
    context, chunk = options.pop("context", None), options.pop("chunk", None)
    model, args, _ = load_reference(path, **options)
    return TorchBackend(model, args, context=context, chunk=chunk)
