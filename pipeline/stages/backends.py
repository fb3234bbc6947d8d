"""One harness for logits, perplexity, scoring and gates: the Backend protocol and its dispatch.

    backend = open_backend("model.cmf")              # torch reference, FP32
    backend = open_backend("out/package")            # a folder with model.mlpackage: Core ML
    backend = open_backend("model.cmf", "mlx")       # the MLX runtime
    backend = open_backend("dist/model-int8-b32")    # a release: the package it ships

Each runtime implements the protocol in its own area (the torch reference in
`pipeline.ground.torch_backend`); this module imports a runtime only when asked for, so the
reference path never needs coremltools or MLX.
The protocol itself lives in `pipeline.ground.backend_protocol`, which needs no torch.
"""

from pathlib import Path

from pipeline.ground.backend_protocol import BACKENDS, Backend, BackendError
from pipeline.ground.reference import load_reference
from pipeline.ground.torch_backend import TorchBackend

PACKAGE_MARKER = "model.mlpackage"
RELEASE_FORMAT = "cmfdeploy.release/1"
# An app folder cut from a release (`pipeline.stages.app_release`) records the entry it ships.
APP_RELEASE_FORMAT = "cmfdeploy.app_release/1"


def release_package(path: Path) -> Path | None:
    """The package folder a release folder runs as: the package it ships (`shipped_entry`: its
    deployment's, else the survey's compressed one), or an app folder's; None when `path` is
    neither."""
    from manifests.identity import MANIFEST_NAME, load_manifest

    from coreml.package import is_package

    if not (path.is_dir() and (path / MANIFEST_NAME).is_file()) or is_package(path):
        return None
    manifest = load_manifest(path)
    if manifest["format"] == APP_RELEASE_FORMAT:
        return path / manifest["shipped"]["path"]
    if manifest["format"] != RELEASE_FORMAT:
        return None
    return path / shipped_entry(manifest)["path"]


def shipped_entry(manifest: dict) -> dict:
    """The release manifest's entry of the package an app loads: the deployment's (role
    "shipped") where the release has one, else the survey's compressed package (the second, by
    the release schema)."""
    return next((e for e in manifest["packages"] if e["role"] == "shipped"), manifest["packages"][1])


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
    from coreml.package import is_package

    if path.is_dir() and is_package(path):
        if backend not in ("auto", "coreml", "coreml-executor", "coreml-macos"):
            raise BackendError(f"{path}: a Core ML package folder runs on coreml, not {backend!r}")
        from coreml.runner import open_package_backend

        return open_package_backend(path, backend="auto" if backend in ("auto", "coreml") else backend, **options)
    if backend.startswith("coreml"):
        raise BackendError(f"{path}: backend {backend!r} needs a Core ML package folder ({PACKAGE_MARKER}, or a "
                           "split package's pieces)")
    if backend == "mlx":
        if path.is_dir():
            raise BackendError(f"{path}: the MLX runtime reads CMF files, not folders")
        from mlx_runtime.backend import MlxBackend

        return MlxBackend(path, **options)
    context, chunk = options.pop("context", None), options.pop("chunk", None)
    model, args, _ = load_reference(path, **options)
    return TorchBackend(model, args, context=context, chunk=chunk)
