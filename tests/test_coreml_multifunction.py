"""coreml.multifunction.merge_functions against coremltools' own save_multifunction.

The default fixture's stateful prefill and decode functions are converted once as
single-function packages, then merged both ways; the two merged packages must describe the
same functions, hold the same programs and constants, share weights as well, and run
bitwise alike on the MIL executor.
"""

import dataclasses
import shutil

import coremltools as ct
import numpy as np
import pytest
from coremltools.proto import Model_pb2

from coreml.kinds import package_kind
from coreml.kinds.export import reference_for_export
from coreml.mil.errors import MilError
from coreml.mil.loader import BlobEntry, BlobStorage, load_program, mil_dtype, model_path
from coreml.multifunction import MergeError, merge_functions
from coreml.package import open_package

CONTEXT = 64
DEFAULT = "decode"


@pytest.fixture(scope="module")
def sources(fixture_bundle, tmp_path_factory):
    """prefill.mlpackage and decode.mlpackage, single-function (do not modify)."""
    ref = reference_for_export(fixture_bundle, context=CONTEXT)
    return package_kind("stateful").convert_functions(ref, tmp_path_factory.mktemp("functions"), lambda stage: None)


@pytest.fixture(scope="module")
def merged(sources, tmp_path_factory):
    """(ours, coremltools') merged packages."""
    out = tmp_path_factory.mktemp("merged")
    merge_functions(sources, DEFAULT).save(str(out / "ours.mlpackage"))
    descriptor = ct.utils.MultiFunctionDescriptor()
    for name, path in sources.items():
        descriptor.add_function(str(path), src_function_name="main", target_function_name=name)
    descriptor.default_function_name = DEFAULT
    ct.utils.save_multifunction(descriptor, str(out / "coremltools.mlpackage"))
    return out / "ours.mlpackage", out / "coremltools.mlpackage"


def _spec(package) -> Model_pb2.Model:
    return ct.utils.load_spec(str(package))


def _weights(package):
    return model_path(package).parent / "weights" / "weight.bin"


def _signature(value):
    """A comparable form of a decoded program piece: arrays by dtype, shape and bytes."""
    if isinstance(value, np.ndarray):
        data = value.ravel().tolist() if value.dtype == object else np.ascontiguousarray(value).tobytes()
        return value.dtype.str, value.shape, data
    if dataclasses.is_dataclass(value):
        return type(value).__name__, tuple(_signature(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, dict):
        return tuple(sorted((key, _signature(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_signature(item) for item in value)
    return value


def _ops(function, drop_unbound_names: bool = False) -> list:
    """The function's operations, constants decoded. coremltools renumbers the `name`
    attribute of output-less ops (write_state) when it reloads a program for merging, so a
    comparison with its result sets those aside."""
    ops = function.block.operations
    if drop_unbound_names:
        ops = [op if op.outputs else dataclasses.replace(op, attributes={k: v for k, v in op.attributes.items()
                                                                          if k != "name"}) for op in ops]
    return [_signature(op) for op in ops]


def _blob_consts(spec: Model_pb2.Model, function: str) -> list:
    block = spec.mlProgram.functions[function]
    return [op.attributes["val"] for op in block.block_specializations[block.opset].operations
            if op.type == "const" and op.attributes["val"].WhichOneof("value") == "blobFileValue"]


def _blob_offsets(spec: Model_pb2.Model, function: str) -> list[int]:
    return [value.blobFileValue.offset for value in _blob_consts(spec, function)]


def _header_count(weights) -> int:
    return int(np.fromfile(weights, BlobStorage.HEADER, count=1)["count"][0])


def test_merged_spec_matches_save_multifunction(merged):
    ours, theirs = map(_spec, merged)
    assert sorted(ours.mlProgram.functions) == sorted(theirs.mlProgram.functions) == ["decode", "prefill"]
    assert [f.name for f in ours.description.functions] == ["prefill", "decode"]
    assert ours.description.defaultFunctionName == theirs.description.defaultFunctionName == DEFAULT
    assert list(ours.description.functions) == list(theirs.description.functions)
    assert ours.specificationVersion == theirs.specificationVersion
    assert ours.mlProgram.version == theirs.mlProgram.version


def test_merged_programs_and_constants_match_the_sources_and_save_multifunction(sources, merged):
    ours, theirs = (load_program(path) for path in merged)
    for name, path in sources.items():
        source = load_program(path).functions["main"]
        assert _ops(ours.functions[name]) == _ops(source)
        assert _ops(ours.functions[name], True) == _ops(theirs.functions[name], True)
        assert ours.functions[name].inputs == theirs.functions[name].inputs == source.inputs


def test_functions_share_weights_as_save_multifunction_does(sources, merged):
    ours, theirs = map(_spec, merged)
    ours_offsets = {o for name in sources for o in _blob_offsets(ours, name)}
    theirs_offsets = {o for name in sources for o in _blob_offsets(theirs, name)}
    # Decode reuses prefill's weights: both functions' distinct blobs are prefill's alone.
    assert ours_offsets == set(_blob_offsets(ours, "prefill"))
    assert len(ours_offsets) == len(theirs_offsets) == _header_count(_weights(merged[0]))
    assert _weights(merged[0]).stat().st_size <= _weights(merged[1]).stat().st_size
    assert _weights(merged[0]).stat().st_size < sum(_weights(p).stat().st_size for p in sources.values())


def test_merged_package_runs_bitwise_like_save_multifunction(merged):
    decode_description = next(f for f in _spec(merged[1]).description.functions if f.name == "decode")
    vocab = decode_description.output[0].type.multiArrayType.shape[-1]
    ids = np.random.default_rng(3).integers(0, vocab, 12).astype(np.int32)
    runs = []
    for path in merged:
        prefill, decode = (open_package(path, backend="executor", function_name=f) for f in ("prefill", "decode"))
        state = prefill.make_state()
        logits = [prefill.predict({"input_ids": ids[None, :9], "position": np.array([0], np.int32)}, state)["logits"]]
        for position in range(9, 12):
            inputs = {"input_ids": ids[None, position : position + 1], "position": np.array([position], np.int32)}
            logits.append(decode.predict(inputs, state)["logits"])
        runs.append((np.concatenate(logits, axis=1), state.read_state("key_cache"), state.read_state("value_cache")))
    for ours, theirs in zip(*runs):
        assert ours.tobytes() == theirs.tobytes()
    assert np.abs(runs[0][0]).max() > 0 and np.abs(runs[0][1]).max() > 0


def _largest_blob(package) -> BlobEntry:
    """The blob of the largest const in a single-function package."""
    storage = BlobStorage(_weights(package))
    values = _blob_consts(_spec(package), "main")
    return max((storage.entry(v.blobFileValue.offset, mil_dtype(v.type.tensorType.dataType, str(package)))
                for v in values), key=lambda entry: entry.size)


def test_a_blob_only_one_function_has_is_appended(sources, merged, tmp_path):
    decode = tmp_path / "decode.mlpackage"
    shutil.copytree(sources["decode"], decode)
    entry = _largest_blob(decode)
    with open(_weights(decode), "r+b") as fh:
        fh.seek(entry.data_offset)
        data = np.frombuffer(fh.read(entry.size), np.float32)
        fh.seek(entry.data_offset)
        fh.write((-data).tobytes())
    out = tmp_path / "merged.mlpackage"
    merge_functions({"prefill": sources["prefill"], "decode": decode}, DEFAULT).save(str(out))
    program = load_program(out)
    assert _ops(program.functions["decode"]) == _ops(load_program(decode).functions["main"])
    assert _ops(program.functions["prefill"]) == _ops(load_program(sources["prefill"]).functions["main"])
    # Exactly one blob more than the shared merge: its metadata record and aligned data.
    grown = _weights(out).stat().st_size - _weights(merged[0]).stat().st_size
    assert grown == 64 + -(-entry.size // 64) * 64
    assert _header_count(_weights(out)) == _header_count(_weights(merged[0])) + 1
    assert len(set(_blob_offsets(_spec(out), "decode")) - set(_blob_offsets(_spec(out), "prefill"))) == 1


@pytest.mark.parametrize(("field", "byte", "message"), [
    ("sentinel", 0, r"blob_metadata.sentinel is 0xdeadbe00, expected 0xdeadbeef"),
    ("dtype", 4, r"blob_metadata.mil_dtype is 0, the program declares fp32"),
])
def test_a_corrupt_blob_header_is_refused_naming_file_and_offset(sources, tmp_path, field, byte, message):
    decode = tmp_path / "decode.mlpackage"
    shutil.copytree(sources["decode"], decode)
    offset = _largest_blob(decode).offset
    with open(_weights(decode), "r+b") as fh:
        fh.seek(offset + byte)
        fh.write(b"\0")
    with pytest.raises(MilError, match=rf"{_weights(decode).resolve()} @ {offset}: {message}"):
        merge_functions({"prefill": sources["prefill"], "decode": decode}, DEFAULT)


def test_sources_that_are_not_single_function_packages_are_refused(sources, merged):
    with pytest.raises(MergeError, match=r"default function 'main' is not among \['decode', 'prefill'\]"):
        merge_functions(sources, "main")
    with pytest.raises(MergeError, match=r"model.mlmodel: expected a single-function ML Program"):
        merge_functions({"prefill": sources["prefill"], "decode": merged[0]}, DEFAULT)
