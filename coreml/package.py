"""Open a saved Core ML package for prediction, on macOS (Core ML) or anywhere (the executor).

`open_package(path)` accepts a cmfdeploy package directory (`model.mlpackage` plus
`manifest.json`, see coreml/manifest.py) or a bare `.mlpackage`. Both backends expose the same
small interface, so gates, scoring and benchmarks never care where they run:

    pkg = open_package(path)                       # backend "auto": Core ML on macOS
    out = pkg.predict({"input_ids": ids})          # dict name -> np.ndarray
    state = pkg.make_state(); pkg.predict(inputs, state=state)   # stateful packages
    state.read_state("key_cache"); state.write_state("key_cache", a)  # snapshots, either backend
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Mapping
from pathlib import Path

import numpy as np

from coreml.interfaces import package_interface
from coreml.split import HIDDEN_INPUT, HIDDEN_OUTPUT, Piece
from manifests.identity import MANIFEST_NAME, load_manifest
from pipeline.ground.errors import CmfdeployError

MODEL_NAME = "model.mlpackage"
# The backends a package predicts on (`--backend`): the MIL executor here, Core ML on macOS.
PREDICTION_BACKENDS = ("executor", "macos")


class PackageError(CmfdeployError):
    """The path is not a Core ML package, or the requested backend cannot run here."""


def _has(folder: Path, name: str) -> bool:
    # Exact-case lookup: on macOS's case-insensitive disks Apple's Manifest.json would
    # otherwise pass for cmfdeploy's manifest.json.
    return folder.is_dir() and name in os.listdir(folder)


def locate(path: str | Path, manifest: dict | None = None) -> tuple[Path, Path, dict | None]:
    """(package dir, .mlpackage, manifest or None) for a package dir or a bare .mlpackage; `manifest`:
    the folder's, where the caller has read it already."""
    path = Path(path)
    if _has(path, "Manifest.json"):
        mlpackage = path
    elif _has(path, MODEL_NAME):
        mlpackage = path / MODEL_NAME
    else:
        raise PackageError(f"{path}: neither an .mlpackage nor a folder holding {MODEL_NAME}")
    if manifest is None and _has(path, MANIFEST_NAME):
        manifest = load_manifest(path)
    return path, mlpackage, manifest


class _Package:
    """What both backends share: where the package is and what the spec says it takes."""

    backend: str

    def __init__(self, path: Path, mlpackage: Path, manifest: dict | None, function_name: str):
        self.path = path
        self.mlpackage = mlpackage
        self.manifest = manifest
        self.function_name = function_name

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.mlpackage} function={self.function_name} backend={self.backend}>"


class ExecutorPackage(_Package):
    """The numpy MIL reference executor over the saved program (any platform)."""

    backend = "coreml-executor"

    def __init__(self, path: Path, mlpackage: Path, manifest: dict | None, function_name: str | None,
                 program=None):
        from coreml.mil import Executor, load_program

        self.program = program or load_program(mlpackage)
        self.executor = Executor(self.program, function_name)
        super().__init__(path, mlpackage, manifest, self.executor.function.name)
        self.token_input = package_interface((manifest or {}).get("package", {}), path).token_input
        self.functions = tuple(self.program.functions)
        fn = self.executor.function
        self.spec_inputs = {f.name: f for f in fn.spec_inputs}
        self.spec_outputs = {f.name: f for f in fn.spec_outputs}
        self.spec_states = {f.name: f for f in fn.spec_states}

    def predict(self, inputs: Mapping[str, object], state=None, rows_later: bool = False) -> dict[str, np.ndarray]:
        """`rows_later`: the outputs among `row_outputs` are left as the rows they are made of,
        for `finish_rows` (`Executor.run`)."""
        # One token (in the input its interface names, or a split package's hidden state) is a decode step.
        given = inputs.get(self.token_input, inputs.get(HIDDEN_INPUT))
        return self.executor.run(inputs, state, single_token=given is not None and np.shape(given)[1:2] == (1,),
                                 rows_later=rows_later)

    @property
    def row_outputs(self) -> frozenset[str]:
        return self.executor.row_outputs

    def finish_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        return self.executor.finish_rows(name, rows)

    def predict_batch(self, batch: list[Mapping[str, object]], rows: list[Mapping[str, np.ndarray] | None] | None = None,
                      outputs: Collection[str] | None = None) -> list[dict[str, np.ndarray]]:
        """`predict` of each input set, the weights read once for all (`Executor.run_batch`).
        `rows`: per input set, output name -> the rows (axis -2) wanted of it, the only ones
        returned; `outputs`: the outputs returned (None: all), the only ones computed."""
        return self.executor.run_batch(batch, rows, outputs)

    def make_state(self):
        return self.executor.make_state()

    def function(self, name: str) -> "ExecutorPackage":
        """Another function of this package over the same loaded program: opening it anew
        would map and count the weights a second time."""
        return ExecutorPackage(self.path, self.mlpackage, self.manifest, name, self.program)


class MacPackage(_Package):
    """Core ML itself, through coremltools.models.MLModel (macOS only)."""

    backend = "coreml-macos"

    def __init__(self, path: Path, mlpackage: Path, manifest: dict | None, function_name: str | None):
        import coremltools as ct

        from coreml.mil.loader import feature_spec

        self.model = ct.models.MLModel(str(mlpackage), function_name=function_name)
        spec = self.model.get_spec()
        described = {f.name: f for f in spec.description.functions}
        name = function_name or spec.description.defaultFunctionName or "main"
        desc = described.get(name, spec.description)
        super().__init__(path, mlpackage, manifest, name)
        self.functions = tuple(described) or ("main",)
        where = f"{mlpackage}: function {name}"
        self.spec_inputs = {f.name: feature_spec(f, where) for f in desc.input}
        self.spec_outputs = {f.name: feature_spec(f, where) for f in desc.output}
        self.spec_states = {f.name: feature_spec(f, where) for f in desc.state}

    def predict(self, inputs: Mapping[str, object], state=None) -> dict[str, np.ndarray]:
        feed = {name: np.asarray(value) for name, value in inputs.items()}
        out = self.model.predict(feed, state=state) if state is not None else self.model.predict(feed)
        return {name: np.asarray(value) for name, value in out.items()}

    def predict_batch(self, batch: list[Mapping[str, object]], rows: list[Mapping[str, np.ndarray] | None] | None = None,
                      outputs: Collection[str] | None = None) -> list[dict[str, np.ndarray]]:
        """Core ML's batch prediction (MLModel.predict of a list of input dicts). `rows` and
        `outputs` as the executor's: Core ML computes every output and row, and the wanted ones
        are returned."""
        outs = self.model.predict([{name: np.asarray(value) for name, value in inputs.items()} for inputs in batch])
        outs = [{name: np.asarray(value) for name, value in out.items() if outputs is None or name in outputs}
                for out in outs]
        for out, selection in zip(outs, rows or ()):
            for name, wanted in (selection or {}).items():
                out[name] = out[name][..., np.asarray(wanted, np.intp), :]
        return outs

    def make_state(self):
        return self.model.make_state()

    def function(self, name: str) -> "MacPackage":
        return MacPackage(self.path, self.mlpackage, self.manifest, name)


def open_package(path: str | Path, backend: str = "auto", function_name: str | None = None):
    """Open the package at `path`. backend: "auto" (Core ML on macOS, else the executor),
    "executor"/"coreml-executor" or "macos"/"coreml-macos". `function_name` picks a function of
    a multifunction package (default: the package's default function). A package split into
    pieces (`coreml.split`) opens as the `ChainedPackage` of them."""
    path = Path(path)
    manifest = load_manifest(path) if _has(path, MANIFEST_NAME) and not _has(path, "Manifest.json") else None
    if manifest is not None and "pieces" in manifest.get("package", {}):
        return ChainedPackage.open(path, manifest, backend, function_name)
    opened_by = package_class(path, backend)
    return opened_by(*locate(path, manifest), function_name)


def is_package(path: str | Path) -> bool:
    """Whether `path` is a package folder `open_package` opens: one holding model.mlpackage, or a
    split package's (its manifest lists pieces)."""
    path = Path(path)
    if _has(path, MODEL_NAME):
        return True
    return _has(path, MANIFEST_NAME) and "pieces" in load_manifest(path).get("package", {})


class ChainState:
    """The states of a split package's pieces behind one state's interface: a cache reads as the
    whole model's [layers, ...], each piece's own layers in order, and writes back the same way."""

    def __init__(self, states: list, pieces: tuple[Piece, ...]):
        self.states, self.pieces = states, pieces

    def read_state(self, name: str) -> np.ndarray:
        return np.concatenate([state.read_state(name) for state, piece in zip(self.states, self.pieces)
                               if piece.layer_count], axis=0)

    def write_state(self, name: str, value: np.ndarray) -> None:
        for state, piece in zip(self.states, self.pieces):
            if piece.layer_count:
                start, stop = piece.layers
                state.write_state(name, np.ascontiguousarray(value[start:stop]))


class ChainedPackage:
    """A package split into pieces (`coreml.split`), each opened on the same backend, run in turn
    behind the interface of the unsplit package its manifest describes: token ids and position
    in, the logits out, states of the whole model's caches (`ChainState`). The hidden state
    passes from piece to piece as the piece before gave it (the package's float dtype)."""

    def __init__(self, path: Path, manifest: dict, pieces: list[tuple[Piece, _Package]]):
        self.path, self.mlpackage, self.manifest, self.pieces = path, path, manifest, pieces
        last = pieces[-1][1]
        self.backend, self.function_name, self.functions = last.backend, last.function_name, last.functions
        self.token_input = package_interface(manifest["package"], path).token_input

    @classmethod
    def open(cls, path: Path, manifest: dict, backend: str, function_name: str | None) -> "ChainedPackage":
        """The chain of the pieces `manifest` (its `package.pieces`) lists in the folder `path`."""
        opened_by = package_class(path, backend)
        pieces = [(Piece.from_record(block["piece"]), opened_by(path / block["name"], path / block["name"], None,
                                                                 function_name))
                  for block in manifest["package"]["pieces"]]
        return cls(path, manifest, pieces)

    def __repr__(self) -> str:
        return f"<ChainedPackage {self.path} pieces={len(self.pieces)} function={self.function_name}>"

    def predict(self, inputs: Mapping[str, object], state: ChainState | None = None, **options) -> dict[str, np.ndarray]:
        """The last piece's outputs; `options` (the executor's `rows_later`) go to it alone, the
        piece that makes the logits."""
        states = state.states if state is not None else [None] * len(self.pieces)
        beside = {name: value for name, value in inputs.items() if name != self.token_input}
        out: dict[str, np.ndarray] = {}
        for (piece, package), piece_state in zip(self.pieces, states):
            feed = dict(inputs) if piece.embeds else {HIDDEN_INPUT: out[HIDDEN_OUTPUT], **beside}
            out = package.predict(feed, state=piece_state, **(options if piece.head else {}))
        return out

    @property
    def row_outputs(self) -> frozenset[str]:
        return self.pieces[-1][1].row_outputs

    def finish_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        return self.pieces[-1][1].finish_rows(name, rows)

    def make_state(self) -> ChainState:
        return ChainState([package.make_state() if piece.layer_count else None for piece, package in self.pieces],
                          tuple(piece for piece, _ in self.pieces))

    def function(self, name: str) -> "ChainedPackage":
        return ChainedPackage(self.path, self.manifest, [(piece, package.function(name))
                                                         for piece, package in self.pieces])


def package_class(path: str | Path, backend: str = "auto") -> type[_Package]:
    """The class `open_package(path, backend)` opens the package with (its `backend`
    attribute names it), found without opening: refused when unknown or not on this platform."""
    name = backend.removeprefix("coreml-")
    if name == "auto":
        name = "macos" if sys.platform == "darwin" else "executor"
    if name not in PREDICTION_BACKENDS:
        raise PackageError(f"{path}: backend {backend!r} is not one of auto, coreml-executor, coreml-macos")
    if name == "macos" and sys.platform != "darwin":
        raise PackageError(f"{path}: backend 'macos' needs macOS (this is {sys.platform})")
    return ExecutorPackage if name == "executor" else MacPackage
