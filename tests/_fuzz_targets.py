"""The readers beyond CMF that take untrusted bytes, each as a fuzz target over a copy of a
valid artifact: `target(artifact_dir, work_dir) -> (mutate, exercise)` for `_fuzz.fuzz`.

    mlmodel      Model.mlmodel protobuf bytes: byte-level and field-level (op types, value
                 types and dims, blob offsets and file names, feature shapes and ranges)
    weight_bin   weight.bin: the storage header and every blob_metadata field, and raw bytes
    safetensors  a bundle's safetensors header (length prefix, JSON structure, raw bytes); a
                 header our reader accepts must read the same in the safetensors library
    bundle_manifest, package_manifest, gate_manifest
                 manifest.json: types, missing and added keys, '..' and absolute paths, raw
                 JSON bytes, and recorded files swapped for symlinks to outside copies

Every exercise runs all the readers of its input (the executor's loader, the cross-checks,
the artifact verifiers), so a typed error from one does not hide a defect in another.
"""

import json
import shutil
from pathlib import Path

import numpy as np
from coremltools.proto import Model_pb2

from _fuzz import PATH_ATTACKS, U64_INTERESTING, mutate_bytes, mutate_json
from coreml.crosscheck import check_package
from coreml.manifest import COREML_FORMAT
from coreml.mil.loader import load_program
from pipeline.stages.artifacts import verify_chain
from manifests.identity import MANIFEST_NAME, canonical_json, read_json
from pipeline.ground.bundle_format import WEIGHTS_NAME, safetensors_header, verify_bundle
from pipeline.ground.errors import CmfdeployError

SPEC = "model.mlpackage/Data/com.apple.CoreML/model.mlmodel"
WEIGHTS = "model.mlpackage/Data/com.apple.CoreML/weights/weight.bin"


def _each(*calls) -> None:
    """Run every call; then re-raise the first typed error (a defect in any call escapes at once)."""
    first = None
    for call in calls:
        try:
            call()
        except CmfdeployError as error:
            first = first or error
    if first is not None:
        raise first


def _copy(artifact: Path, work: Path) -> Path:
    copy = work / artifact.name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(artifact, copy)
    return copy


def _package_readers(copy: Path, manifest: dict):
    return (lambda: load_program(copy / "model.mlpackage"), lambda: check_package(copy, manifest, from_bundle=manifest["format"] == COREML_FORMAT))


# --- Model.mlmodel -------------------------------------------------------------------------


def _ops(model):
    for function in model.mlProgram.functions.values():
        for block in function.block_specializations.values():
            yield from block.operations


def _values(op):
    for value in op.attributes.values():
        yield value
    for argument in op.inputs.values():
        for binding in argument.arguments:
            if binding.WhichOneof("binding") == "value":
                yield binding.value


def _big(rng) -> int:
    return int(rng.choice(U64_INTERESTING)) % (1 << 63)


def mutate_spec(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """One field of the parsed spec set to an odd value, the spec serialised again."""
    model = Model_pb2.Model()
    model.ParseFromString(data)
    ops = list(_ops(model))
    op = ops[int(rng.integers(len(ops)))]
    kind = int(rng.integers(7))
    if kind == 0:
        op.type = str(rng.choice(["const", "linear", "gather", "read_state", "nope", ""]))
        what = f"op type -> {op.type!r}"
    elif kind == 1 and op.outputs and op.outputs[0].type.tensorType.dimensions:
        dims = op.outputs[0].type.tensorType.dimensions
        dims[int(rng.integers(len(dims)))].constant.size = _big(rng)
        what = f"output dim of {op.outputs[0].name}"
    elif kind == 2 and op.outputs:
        op.outputs[0].type.tensorType.dataType = int(rng.integers(0, 40))
        what = f"output dtype of {op.outputs[0].name} -> {op.outputs[0].type.tensorType.dataType}"
    elif kind == 3:
        blobs = [v for o in ops for v in _values(o) if v.WhichOneof("value") == "blobFileValue"]
        value = blobs[int(rng.integers(len(blobs)))]
        if rng.integers(2):
            value.blobFileValue.offset = _big(rng) if rng.integers(2) else value.blobFileValue.offset + 64
            what = f"blob offset -> {value.blobFileValue.offset}"
        else:
            value.blobFileValue.fileName = "@model_path/" + PATH_ATTACKS[int(rng.integers(len(PATH_ATTACKS)))]
            what = f"blob file -> {value.blobFileValue.fileName!r}"
    elif kind == 4:
        immediates = [v for v in _values(op) if v.WhichOneof("value") == "immediateValue"]
        if not immediates:
            return data, "no immediate to change"
        value = immediates[int(rng.integers(len(immediates)))]
        dims = value.type.tensorType.dimensions
        if dims and rng.integers(2):
            dims[int(rng.integers(len(dims)))].constant.size = _big(rng)
            what = "immediate dim"
        else:
            value.immediateValue.tensor.bytes.values = value.immediateValue.tensor.bytes.values[:1]
            what = "immediate bytes truncated"
    elif kind == 5:
        features = [*model.description.input, *model.description.output]
        array = features[int(rng.integers(len(features)))].type.multiArrayType
        if array.shape and rng.integers(2):
            array.shape[int(rng.integers(len(array.shape)))] = _big(rng)
        else:
            array.dataType = int(rng.integers(0, 1 << 20))
        what = "feature shape or dtype"
    else:
        block = next(iter(model.mlProgram.functions.values())).block_specializations
        operations = next(iter(block.values())).operations
        del operations[int(rng.integers(len(operations)))]
        what = "op deleted"
    return model.SerializeToString(), what


def mlmodel(package: Path, work: Path):
    copy = _copy(package, work)
    manifest, data = read_json(copy / MANIFEST_NAME), (copy / SPEC).read_bytes()

    def mutate(rng):
        return mutate_bytes(data, rng) if rng.integers(2) else mutate_spec(data, rng)

    def exercise(mutant: bytes):
        (copy / SPEC).write_bytes(mutant)
        _each(*_package_readers(copy, manifest))

    return mutate, exercise


# --- weight.bin ------------------------------------------------------------------------------


def weight_bin(package: Path, work: Path):
    copy = _copy(package, work)
    manifest, data = read_json(copy / MANIFEST_NAME), (copy / WEIGHTS).read_bytes()
    model = Model_pb2.Model()
    model.ParseFromString((copy / SPEC).read_bytes())
    offsets = sorted({v.blobFileValue.offset for op in _ops(model) for v in _values(op)
                      if v.WhichOneof("value") == "blobFileValue"})
    # storage_header count/version; per blob_metadata: sentinel, dtype, size, data offset, padding bits.
    fields = [(0, "<I"), (4, "<I")] + [(o + d, f) for o in offsets
                                       for d, f in ((0, "<I"), (4, "<I"), (8, "<Q"), (16, "<Q"), (24, "<Q"))]

    def mutate(rng):
        return mutate_bytes(data, rng, fields if rng.integers(4) else ())

    def exercise(mutant: bytes):
        (copy / WEIGHTS).write_bytes(mutant)
        _each(*_package_readers(copy, manifest))

    return mutate, exercise


# --- safetensors header ------------------------------------------------------------------------


def _library_view(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(path, "np") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def safetensors(bundle: Path, work: Path):
    copy = _copy(bundle, work)
    path, data = copy / WEIGHTS_NAME, (copy / WEIGHTS_NAME).read_bytes()
    length = int.from_bytes(data[:8], "little")
    header, tensors = json.loads(data[8:8 + length]), data[8 + length:]
    manifest = read_json(copy / MANIFEST_NAME)

    def mutate(rng):
        if rng.integers(2):
            prefix, what = mutate_bytes(data[:8 + length], rng, [(0, "<Q")])
            return prefix + tensors, what
        mutated, what = mutate_json(header, rng)
        text = json.dumps(mutated).encode()
        text += b" " * (-len(text) % 8)
        return len(text).to_bytes(8, "little") + text + tensors, what

    def exercise(mutant: bytes):
        path.write_bytes(mutant)
        # The inventory re-recorded (sizes; hashes are not checked), so the cross-checks run.
        files = {**manifest["files"], WEIGHTS_NAME: {**manifest["files"][WEIGHTS_NAME], "bytes": len(mutant)}}
        (copy / MANIFEST_NAME).write_bytes(canonical_json({**manifest, "files": files}))
        try:
            shapes = safetensors_header(path)
        except CmfdeployError:
            shapes = None
        if shapes is not None:  # a header we accept is one the safetensors library reads the same
            assert _library_view(path) == shapes, "the safetensors library reads another tensor set"
        _each(lambda: verify_bundle(copy, hashes=False))

    return mutate, exercise


# --- manifests -------------------------------------------------------------------------------------


def manifest_target(artifact: Path, work: Path):
    copy = _copy(artifact, work)
    original = (copy / MANIFEST_NAME).read_bytes()
    manifest = json.loads(original)
    recorded = sorted(manifest["files"])
    outside = work / "outside"
    outside.mkdir(exist_ok=True)

    def mutate(rng):
        kind = int(rng.integers(10))
        if kind == 0:
            return (original, recorded[int(rng.integers(len(recorded)))]), "a recorded file swapped for a symlink"
        if kind == 1:
            return (mutate_bytes(original, rng)[0], None), "raw JSON bytes"
        mutated, what = mutate_json(manifest, rng)
        return (canonical_json(mutated) if rng.integers(2) else json.dumps(mutated).encode(), None), what

    def exercise(mutant):
        text, linked = mutant
        (copy / MANIFEST_NAME).write_bytes(text)
        if linked is not None:  # same bytes, but outside the artifact
            target = outside / Path(linked).name
            shutil.copyfile(copy / linked, target)
            (copy / linked).unlink()
            (copy / linked).symlink_to(target)
        try:
            _each(lambda: verify_chain(copy))
            assert linked is None, f"{linked} verified as a symlink to a file outside the artifact"
        finally:
            if linked is not None:
                (copy / linked).unlink()
                shutil.copyfile(outside / Path(linked).name, copy / linked)
            (copy / MANIFEST_NAME).write_bytes(original)

    return mutate, exercise


# Each target from the artifacts {"bundle", "package" (chunk-KV), "gate" (its alignment)} and a work folder.
TARGETS = {
    "mlmodel": lambda artifacts, work: mlmodel(artifacts["package"], work),
    "weight_bin": lambda artifacts, work: weight_bin(artifacts["package"], work),
    "safetensors": lambda artifacts, work: safetensors(artifacts["bundle"], work),
    "bundle_manifest": lambda artifacts, work: manifest_target(artifacts["bundle"], work),
    "package_manifest": lambda artifacts, work: manifest_target(artifacts["package"], work),
    "gate_manifest": lambda artifacts, work: manifest_target(artifacts["gate"], work),
}
