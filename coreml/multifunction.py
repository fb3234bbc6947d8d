"""Merge single-function ML Program packages into one multifunction package without ever
holding the weights in memory.

`coremltools.utils.save_multifunction` loads every function into a pymil program (each
weight a numpy array), deduplicates constants across functions and serialises the lot
again: ~5x the FP32 weight bytes resident for SmolLM2-135M. The merge here works on what
is on disk instead. A package's spec is a small protobuf (its weights live in
`weights/weight.bin`, MIL blob storage), so the specs are merged as protobufs, the way
save_multifunction builds its model description, and the blobs the functions point at are
copied into one new weight file, streamed through a map a window at a time. Blobs are
matched by content (MIL data type, size, sha256 of the data): each distinct one is written
once, in order of first use, and every blobFileValue is pointed at its copy, so functions
share weights as save_multifunction's deduplication makes them. The sources are not modified.
"""

import hashlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import coremltools as ct
import numpy as np
from coremltools import _SPECIFICATION_VERSION_IOS_18
from coremltools.proto import MIL_pb2, Model_pb2

from coreml.mil.loader import BlobEntry, BlobStorage, blob_file, mil_dtype, model_path, program_spec
from pipeline.ground.errors import CmfdeployError

SOURCE_FUNCTION = "main"  # the one function of a single-function package


class MergeError(CmfdeployError):
    """The packages to merge are not single-function ML Programs with one weight file each."""


def merge_functions(sources: dict[str, Path], default_function: str,
                    metadata: Model_pb2.Metadata | None = None) -> ct.models.MLModel:
    """One multifunction model whose function `name` is the program of `sources[name]`.

    Returns the model unsaved (its package lives in coremltools' temporary folder, like a
    converted model's) so the caller can set metadata first: as with save_multifunction,
    the merged spec carries none but `metadata` (a package's own, merged again after its
    functions were rewritten one by one). The first source's function comes first.
    """
    first = Path(next(iter(sources), ""))
    if default_function not in sources:
        raise MergeError(f"{first}: default function {default_function!r} is not among {sorted(sources)}")
    specs = {name: _single_function_spec(Path(path)) for name, path in sources.items()}
    # Beside the sources: on the disk the caller chose for files of this size.
    with tempfile.TemporaryDirectory(dir=first.parent) as scratch:
        weights = Path(scratch) / "weights" / "weight.bin"
        weights.parent.mkdir()
        _merge_blobs(sources, specs, weights)
        spec = _multifunction_spec(specs, default_function)
        if metadata is not None:
            spec.description.metadata.CopyFrom(metadata)
        return ct.models.MLModel(spec, weights_dir=str(weights.parent), skip_model_load=True)


def _single_function_spec(package: Path) -> Model_pb2.Model:
    path, spec = program_spec(package)
    functions = list(spec.mlProgram.functions)
    if functions != [SOURCE_FUNCTION] or spec.description.functions:
        raise MergeError(f"{path}: expected a single-function ML Program with function "
                         f"{SOURCE_FUNCTION!r}; it has functions {sorted(functions)}")
    return spec


def _blob_values(spec: Model_pb2.Model) -> Iterator[tuple[MIL_pb2.Value, str]]:
    """Every blob-backed value of every function, nested blocks included, with where it is."""

    def in_value(value: MIL_pb2.Value, where: str):
        if value.WhichOneof("value") == "blobFileValue":
            yield value, where
        elif value.immediateValue.WhichOneof("value") == "list":
            for item in value.immediateValue.list.values:
                yield from in_value(item, where)
        elif value.immediateValue.WhichOneof("value") == "dictionary":
            for pair in value.immediateValue.dictionary.values:
                yield from in_value(pair.key, where)
                yield from in_value(pair.value, where)

    def in_block(block: MIL_pb2.Block, where: str):
        for op in block.operations:
            at = f"{where}, op {op.type} -> {', '.join(o.name for o in op.outputs) or '(no outputs)'}"
            for value in op.attributes.values():
                yield from in_value(value, at)
            for argument in op.inputs.values():
                for binding in argument.arguments:
                    if binding.WhichOneof("binding") == "value":
                        yield from in_value(binding.value, at)
            for nested in op.blocks:
                yield from in_block(nested, at)

    for name, function in spec.mlProgram.functions.items():
        for opset, block in function.block_specializations.items():
            yield from in_block(block, f"function {name} ({opset})")


class _MergedWeights:
    """The merged weight file, written blob by blob through one handle: each distinct content
    once. The header's blob count is written when the file is closed."""

    def __init__(self, path: Path):
        self.offsets: dict[tuple[int, int, bytes], int] = {}
        self.file = open(path, "wb")
        self.file.write(bytes(BlobStorage.HEADER.itemsize))

    def __enter__(self) -> "_MergedWeights":
        return self

    def __exit__(self, *exc) -> None:
        header = np.zeros(1, BlobStorage.HEADER)
        header["count"], header["version"] = len(self.offsets), 2
        self.file.seek(0)
        self.file.write(header.tobytes())
        self.file.close()

    def place(self, storage: BlobStorage, entry: BlobEntry) -> int:
        """The merged file's offset for a blob with this entry's content, appended if new."""
        digest = hashlib.sha256()
        for chunk in storage.stream(entry):
            digest.update(chunk)
        key = (entry.blob_dtype, entry.size, digest.digest())
        if key not in self.offsets:
            self.offsets[key] = self._append(storage, entry)
        return self.offsets[key]

    def _append(self, storage: BlobStorage, entry: BlobEntry) -> int:
        offset = self.file.tell()  # every append ends 64-byte aligned, as the header does
        meta = np.zeros(1, BlobStorage.METADATA)
        meta["sentinel"], meta["dtype"], meta["size"] = BlobStorage.SENTINEL, entry.blob_dtype, entry.size
        meta["offset"], meta["padding_bits"] = offset + meta.itemsize, entry.padding_bits
        self.file.write(meta.tobytes())
        for chunk in storage.stream(entry):
            self.file.write(chunk)
        self.file.write(bytes(-self.file.tell() % 64))
        return offset


def _merge_blobs(sources: dict[str, Path], specs: dict[str, Model_pb2.Model], merged: Path) -> None:
    """Write every function's blobs into `merged`, each distinct content once, and point the
    specs' blob values at them (rewriting their offsets)."""
    with _MergedWeights(merged) as weights:
        for name, spec in specs.items():
            model_dir = model_path(Path(sources[name])).parent
            storage, placed = None, {}
            for value, where in _blob_values(spec):
                blob, at = value.blobFileValue, f"{model_dir}: {where}"
                path = blob_file(model_dir, blob.fileName, at)
                if storage is None:
                    storage = BlobStorage(path)
                elif path != storage.path:
                    raise MergeError(f"{at}: weight file {path} besides {storage.path}; "
                                     "the merge expects one per package")
                if blob.offset not in placed:
                    entry = storage.entry(blob.offset, mil_dtype(value.type.tensorType.dataType, at))
                    placed[blob.offset] = weights.place(storage, entry)
                blob.offset = placed[blob.offset]


def _multifunction_spec(specs: dict[str, Model_pb2.Model], default_function: str) -> Model_pb2.Model:
    """The merged spec as save_multifunction builds it: one FunctionDescription per function
    from its single-function description, the programs renamed, iOS18 at least."""
    merged = Model_pb2.Model(
        specificationVersion=max(_SPECIFICATION_VERSION_IOS_18, *(s.specificationVersion for s in specs.values())),
        description=Model_pb2.ModelDescription(
            functions=[
                Model_pb2.FunctionDescription(
                    name=name,
                    input=s.description.input,
                    output=s.description.output,
                    state=s.description.state,
                    predictedFeatureName=s.description.predictedFeatureName,
                    predictedProbabilitiesName=s.description.predictedProbabilitiesName,
                )
                for name, s in specs.items()
            ],
            defaultFunctionName=default_function,
        ),
    )
    first = next(iter(specs.values())).mlProgram
    merged.mlProgram.version = first.version
    for name, s in specs.items():
        merged.mlProgram.functions[name].CopyFrom(s.mlProgram.functions[SOURCE_FUNCTION])
    return merged



@dataclass(frozen=True)
class PackageFunctions:
    """The functions of a multifunction package, each to be had as a single-function model
    (`model`): the inverse of `merge_functions`, so a step that works on one program (a
    compression recipe) can run function by function and `merge_functions` store what they
    share once again."""

    path: Path
    spec: Model_pb2.Model
    weights_dir: Path

    @property
    def names(self) -> list[str]:
        return list(self.spec.mlProgram.functions)

    @property
    def default_function(self) -> str:
        return self.spec.description.defaultFunctionName

    @property
    def metadata(self) -> Model_pb2.Metadata:
        return self.spec.description.metadata

    def model(self, name: str) -> ct.models.MLModel:
        """Function `name` as an unsaved single-function model (its program renamed `main`, its
        description the function's), over a copy of the weight file coremltools makes for it:
        made one at a time, so a function's copy is gone before the next is made."""
        described = {f.name: f for f in self.spec.description.functions}
        if name not in described or name not in self.spec.mlProgram.functions:
            raise MergeError(f"{self.path}: no described function {name!r} (functions: {self.names})")
        single = Model_pb2.Model(specificationVersion=self.spec.specificationVersion)
        description = described[name]
        single.description.input.extend(description.input)
        single.description.output.extend(description.output)
        single.description.state.extend(description.state)
        single.description.predictedFeatureName = description.predictedFeatureName
        single.description.predictedProbabilitiesName = description.predictedProbabilitiesName
        single.description.metadata.CopyFrom(self.metadata)
        single.mlProgram.version = self.spec.mlProgram.version
        single.mlProgram.functions[SOURCE_FUNCTION].CopyFrom(self.spec.mlProgram.functions[name])
        return ct.models.MLModel(single, weights_dir=str(self.weights_dir), skip_model_load=True)


def package_functions(package: Path) -> PackageFunctions:
    path, spec = program_spec(package)
    return PackageFunctions(path, spec, path.parent / "weights")
