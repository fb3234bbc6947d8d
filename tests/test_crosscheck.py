"""Claims a manifest makes are checked against the artifact's own statement.

Each tamper rewrites a manifest *and* its recorded hashes together (what anyone who can
write the folder can do), so only a cross-check with Model.mlmodel, config.json, the
safetensors header or the source CMF can catch it; each is refused by `verify-artifact`
and by the stage that takes the artifact next, naming the field.
"""

import re
import shutil
from pathlib import Path

import pytest

from coreml.manifest import verify_package
from manifests.identity import MANIFEST_NAME, file_identity, read_json, write_json
from pipeline.ground.bundle_format import safetensors_header, verify_bundle
from pipeline.cli import main
from pipeline.ground.errors import IdentityError

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "fixtures" / "reference"


def _copy(artifact: Path, tmp_path: Path, edit_manifest) -> Path:
    copy = tmp_path / artifact.name
    shutil.copytree(artifact, copy)
    _rewrite_manifest(copy, edit_manifest)
    return copy


def _rewrite_manifest(folder: Path, edit) -> None:
    manifest = read_json(folder / MANIFEST_NAME)
    edit(manifest)
    write_json(folder / MANIFEST_NAME, manifest)


def _context_64(m):
    m["package"]["context"] = 64


def _context_64_and_a_key(m):
    _context_64(m)
    m["package"]["verified_on"] = "macOS 15"


def _logits_width(m):
    m["package"]["outputs"][0]["shape"] = [1, "T", 1000]


def _cache_slots(m):
    for feature in m["package"]["inputs"][2:] + m["package"]["outputs"][1:]:
        feature["shape"][3] = 64


PACKAGE_TAMPERS = [
    (_context_64, r"field 'package.context' is 64, but .* says 128"),
    (_context_64_and_a_key, r"field 'package'.*'verified_on' was unexpected"),
    (_logits_width, r"field 'package.outputs\[logits\].shape \(function main\)' is \[1, 'flexible', 1000\], .* "
                    r"says \[1, 'flexible', 1024\]"),
    (_cache_slots, r"field 'package.inputs\[key_cache\].shape \(function main\)' is \[4, 1, 2, 64, 32\].* "
                   r"says \[4, 1, 2, 128, 32\]"),
    (lambda m: m.update(notes="x"), r"field '\(top level\)'.*'notes' was unexpected"),
    (lambda m: m["package"].update(compute_precision="float16"),
     r"field 'package.compute_precision' is 'float16', .* says 'float32'"),
    (lambda m: m["package"]["inputs"][0].update(dtype="float32"),
     r"field 'package.inputs\[input_ids\].dtype' is 'float32', .* says 'int32'"),
    (lambda m: m["package"].update(dims={"T": [1, 64]}), r"'package.inputs\[input_ids\].shape.*\[1, \[1, 64\]\].*"
                                                          r"\[1, \[1, 128\]\]"),
    (lambda m: m["op_histogram"]["main"].update(linear=28), r"field 'op_histogram.main.linear' is 28, .* says 29"),
    (lambda m: m["package"].update(kind="stateless"), r"field 'package.kind' is 'stateless', .* says 'chunk_kv'"),
    (lambda m: m["package"].update(functions={"main": {}, "decode": {}}),
     r"field 'package.functions' is \['decode', 'main'\], .* says \['main'\]"),
    (lambda m: m["architecture"].update(num_kv_heads=4), r"cache shape .* is \[4, 1, 4, 128, 32\].* \[4, 1, 2, 128, 32\]"),
]


@pytest.mark.parametrize("edit, message", PACKAGE_TAMPERS, ids=lambda v: getattr(v, "__name__", None))
def test_verify_package_refuses_a_claim_the_program_contradicts(fixture_packages, tmp_path, edit, message):
    copy = _copy(fixture_packages / "chunk_kv", tmp_path, edit)
    with pytest.raises(IdentityError, match=message):
        verify_package(copy)


def test_the_untampered_packages_check_out(fixture_packages, fixture_stateful):
    for package in (fixture_packages / "stateless", fixture_packages / "chunk_kv", fixture_stateful):
        verify_package(package)


def test_a_stateful_decode_function_claiming_a_range_is_refused(fixture_stateful, tmp_path):
    copy = _copy(fixture_stateful, tmp_path, lambda m: m["package"]["functions"]["decode"].update(dims={"T": [1, 2]}))
    with pytest.raises(IdentityError, match=r"input_ids\]\.shape \(function decode\)' is \[1, \[1, 2\]\]"):
        verify_package(copy)


def test_a_blob_header_that_disagrees_with_the_program_is_refused(fixture_packages, tmp_path):
    copy = _copy(fixture_packages / "chunk_kv", tmp_path, lambda m: None)
    weights = copy / "model.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    data = bytearray(weights.read_bytes())
    data[64 + 4] = 1  # the first blob_metadata's dtype: fp32 (2) -> fp16 (1)
    weights.write_bytes(bytes(data))
    _rewrite_manifest(copy, lambda m: m["files"].update(
        {"model.mlpackage/Data/com.apple.CoreML/weights/weight.bin": file_identity(weights)}))
    with pytest.raises(IdentityError, match=r"program cannot be read: .*mil_dtype is 1, the program declares fp32"):
        verify_package(copy)


@pytest.mark.parametrize("edit, field", [(_context_64_and_a_key, "'verified_on' was unexpected"),
                                         (_context_64, "field 'package.context' is 64"),
                                         (_logits_width, r"field 'package.outputs\[logits\].shape")],
                         ids=["context-and-key", "context", "output-shape"])
def test_verify_artifact_and_align_refuse_the_tampered_package(fixture_packages, tmp_path, capsys, edit, field):
    copy = _copy(fixture_packages / "chunk_kv", tmp_path, edit)
    for command in (["verify-artifact", str(copy)],
                    ["align", str(copy), "--fixtures", str(REFERENCE), "-o", str(tmp_path / "gate")]):
        assert main(command) == 1
        last = capsys.readouterr().err.splitlines()[-1]
        assert last.startswith(f"IdentityError: {copy / MANIFEST_NAME}: ") and re.search(field, last), (command, last)
    assert not (tmp_path / "gate").exists()


# --- bundles ---------------------------------------------------------------------------------


def _bundle_copy(bundle: Path, tmp_path: Path, edit_config, edit_manifest=lambda m: None) -> Path:
    """A bundle whose config.json is rewritten and re-recorded in its manifest's inventory."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    config = read_json(copy / "config.json")
    edit_config(config)
    write_json(copy / "config.json", config)

    def edit(manifest):
        manifest["files"]["config.json"] = file_identity(copy / "config.json")
        edit_manifest(manifest)

    _rewrite_manifest(copy, edit)
    return copy


def _three_layers(config):
    config["arch"]["num_layers"] = 3


def _claim_three_layers(manifest):
    _three_layers({"arch": manifest["architecture"]})


def _move_source_away(manifest):
    manifest["source"]["path"] = "/nonexistent/botchan-llama-1m.cmf"


@pytest.mark.parametrize("edit_manifest, message", [
    (lambda m: None, r"config.json: field 'arch.num_layers' is 3, but .*manifest.json architecture says 4"),
    (_claim_three_layers, r"config.json: field 'arch.num_layers' is 3, but the source CMF .* says 4"),
    (lambda m: (_claim_three_layers(m), _move_source_away(m)),
     r"weights.safetensors: the header disagrees with the tensors config.json derives: .*num_layers"),
], ids=["manifest-architecture", "source-cmf", "weight-ledger"])
def test_a_bundle_config_with_changed_num_layers_is_refused(fixture_bundle, tmp_path, capsys, edit_manifest, message):
    copy = _bundle_copy(fixture_bundle, tmp_path, _three_layers, edit_manifest)
    with pytest.raises(IdentityError, match=message):
        verify_bundle(copy)
    for command in (["verify-artifact", str(copy)],
                    ["coreml", str(copy), "-o", str(tmp_path / "coreml"), "--kinds", "stateless"]):
        assert main(command) == 1
        last = capsys.readouterr().err.splitlines()[-1]  # after the coreml stage's progress lines
        assert re.match(f"IdentityError: .*{message}", last), (command, last)
    assert not (tmp_path / "coreml").exists()


def test_a_bundle_header_that_disagrees_with_the_source_cmf_is_refused(fixture_bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(fixture_bundle, copy)
    weights = copy / "weights.safetensors"
    data = weights.read_bytes()
    length = int.from_bytes(data[:8], "little")
    # The shape [128] of model.norm.weight becomes [2, 64]: one byte more, taken from the padding.
    header = data[8:8 + length].replace(b'"model.norm.weight":{"dtype":"F32","shape":[128]',
                                        b'"model.norm.weight":{"dtype":"F32","shape":[2,64]', 1)
    assert header.endswith(b" ")
    weights.write_bytes(data[:8] + header[:-1] + data[8 + length:])
    _rewrite_manifest(copy, lambda m: m["files"].update({"weights.safetensors": file_identity(weights)}))
    assert safetensors_header(weights)["model.norm.weight"] == (2, 64)
    with pytest.raises(IdentityError, match=r"tensor 'model.norm.weight' has shape \[2, 64\], the source CMF .* "
                                            r"says \[128\]"):
        verify_bundle(copy)


# --- gates -----------------------------------------------------------------------------------


def test_a_gate_manifest_whose_verdict_or_summary_differs_from_its_report_is_refused(fixture_packages, tmp_path):
    from pipeline.stages.gates import align_package, verify_alignment

    gate = tmp_path / "gate"
    align_package(fixture_packages / "stateless", REFERENCE, gate)
    verify_alignment(gate)
    (tmp_path / "copies").mkdir()
    for edit, message in ((lambda m: m["summary"].update(max_abs=0.0), r"field 'summary' is .*'max_abs': 0.0"),
                          (lambda m: m.update(recipe="int8-b32"), r"field 'recipe' is 'int8-b32', but .*alignment.json "
                                                                   r"says 'fp32'")):
        copy = _copy(gate, tmp_path / "copies", edit)
        with pytest.raises(IdentityError, match=message):
            verify_alignment(copy)
        shutil.rmtree(copy)
