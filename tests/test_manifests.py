"""manifests: streamed hashes, inventories, canonical JSON, safe paths, schemas, the chain walk."""

import hashlib
import json
import os
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

import manifests.identity as identity
from manifests.chain import VERIFIERS, Link, verify_artifact, verify_chain
from manifests.identity import (
    MANIFEST_NAME,
    Manifest,
    canonical_json,
    check_files,
    file_identity,
    inventory,
    read_json,
    resolve_inside,
    sha256_file,
    write_json,
)
from manifests.schema import COMMON_FILE, SCHEMA_FILES, load_schema, validate
from pipeline.bundle import export_bundle
from pipeline.errors import IdentityError

CONFORMANCE = Path("/work/shared/cmf-conformance")


def test_sha256_file_streams_across_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "HASH_CHUNK", 1000)  # many chunks, and a partial last one
    data = os.urandom(10_500)
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    assert file_identity(tmp_path / "f") == {"bytes": 10_500, "sha256": hashlib.sha256(data).hexdigest()}


def test_inventory_lists_nested_files_but_not_the_manifest(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.bin").write_bytes(b"abc")
    (tmp_path / "b.txt").write_bytes(b"")
    (tmp_path / MANIFEST_NAME).write_text("{}")
    assert inventory(tmp_path) == {
        "b.txt": {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()},
        "sub/a.bin": {"bytes": 3, "sha256": hashlib.sha256(b"abc").hexdigest()},
    }


def test_inventory_refuses_symlinks(tmp_path):
    (tmp_path / "real").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(IdentityError, match="'link'"):
        inventory(tmp_path)


def test_canonical_json_is_order_independent_and_refuses_nan():
    a = canonical_json({"b": 1, "a": {"y": [1, 2], "x": "é"}})
    b = canonical_json({"a": {"x": "é", "y": [1, 2]}, "b": 1})
    assert a == b and a.endswith(b"\n") and "é".encode() in a
    assert json.loads(a) == {"a": {"x": "é", "y": [1, 2]}, "b": 1}
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_write_json_is_atomic_and_leaves_no_temp(tmp_path):
    write_json(tmp_path / "m.json", {"k": 1})
    write_json(tmp_path / "m.json", {"k": 2})
    assert read_json(tmp_path / "m.json") == {"k": 2}
    assert os.listdir(tmp_path) == ["m.json"]


@pytest.mark.parametrize(
    "content, message",
    [(None, "not found"), (b"{nope", "not valid JSON"), (b"[1, 2]", "expected a JSON object"), (b"\xff", "not valid JSON")],
)
def test_read_json_errors_are_typed(tmp_path, content, message):
    path = tmp_path / "m.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(IdentityError, match=message):
        read_json(path)


def test_resolve_inside_accepts_plain_relative_names(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "inner").symlink_to(tmp_path / "a")  # a link that stays inside is fine
    assert resolve_inside(tmp_path, "a/b.bin") == tmp_path.resolve() / "a" / "b.bin"
    assert resolve_inside(tmp_path, "a/inner/c") == tmp_path.resolve() / "a" / "c"


@pytest.mark.parametrize(
    "name, message",
    [("/etc/passwd", "not a relative path"), ("", "not a relative path"), ("../x", "contains '..'"),
     ("a/../../x", "contains '..'"), ("a\\..\\x", "not a relative path"), ("C:/x", "not a relative path"),
     ("out/secret", "resolves outside")],
)
def test_resolve_inside_refuses_escapes(tmp_path, name, message):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (root / "out").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(IdentityError, match=message):
        resolve_inside(root, name)


# -- schemas


def test_every_schema_is_valid_draft_2020_12():
    for name in [COMMON_FILE, *SCHEMA_FILES.values()]:
        Draft202012Validator.check_schema(load_schema(name))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return export_bundle(CONFORMANCE / "model_masks_tok_a.cmf", tmp_path_factory.mktemp("b") / "bundle")


def _common(bundle) -> dict:
    return {key: bundle[key] for key in ("status", "files", "environment")}


def _artifact_source(bundle) -> dict:
    return {"kind": "artifact", "format": "cmfdeploy.bundle/1", "path": str(bundle.path),
            "manifest_sha256": sha256_file(bundle.path / MANIFEST_NAME)}


METRIC = {"name": "ppl_ratio", "value": 1.01, "threshold": 1.05, "comparison": "<=", "passed": True}
DATASET = {"name": "botchan-heldout", "sha256": "0" * 64, "n_tokens": 512}


def _examples(bundle) -> dict[str, dict]:
    """One minimal valid manifest per format, built on a real bundle's common fields."""
    common, source = _common(bundle), _artifact_source(bundle)
    feature = {"name": "input_ids", "shape": [1, "T"], "dtype": "int32"}
    return {
        "cmfdeploy.bundle/1": bundle.data,
        "cmfdeploy.coreml/1": {**common, "format": "cmfdeploy.coreml/1", "source": source,
                               "architecture": bundle["architecture"], "special_tokens": bundle["special_tokens"],
                               "package": {"name": "model.mlpackage", "kind": "stateful", "context": 256,
                                           "compute_precision": "float32", "minimum_deployment_target": "iOS18",
                                           "inputs": [feature], "outputs": [feature]}},
        "cmfdeploy.compressed/1": {**common, "format": "cmfdeploy.compressed/1", "source": source,
                                   "recipe": {"name": "palettize-4", "params": {"nbits": 4}},
                                   "package": {"name": "model.mlpackage"}, "size_bytes": 10, "base_size_bytes": 40},
        "cmfdeploy.alignment/1": {**common, "format": "cmfdeploy.alignment/1", "source": source,
                                  "candidate_backend": "coreml-executor",
                                  "reference": {"backend": "torch-fp32", "source": bundle["source"]},
                                  "dataset": DATASET, "metrics": [METRIC], "passed": True},
        "cmfdeploy.survey/1": {**common, "format": "cmfdeploy.survey/1", "source": source, "dataset": DATASET,
                               "baseline": {"size_bytes": 40, "metrics": [METRIC]},
                               "candidates": [{"recipe": {"name": "q4", "params": {}}, "size_bytes": 10,
                                               "metrics": [METRIC], "pareto": True}]},
        "cmfdeploy.scores/1": {**common, "format": "cmfdeploy.scores/1", "source": bundle["source"],
                               "backend": "torch-fp32", "scoring_set": DATASET, "summary": [METRIC]},
    }


@pytest.mark.parametrize("format_name", sorted(SCHEMA_FILES))
def test_each_format_accepts_a_valid_manifest_and_names_a_missing_field(bundle, format_name):
    manifest = _examples(bundle)[format_name]
    validate(manifest)
    schema = load_schema(SCHEMA_FILES[format_name])
    required = set(schema["required"])
    if "allOf" in schema:  # the stage schemas inherit the common required fields
        required |= set(load_schema(COMMON_FILE)["$defs"]["stage_common"]["required"])
    for field in sorted(required - {"format"}):  # a missing format is test_validate_refuses_unknown_formats
        broken = {k: v for k, v in manifest.items() if k != field}
        with pytest.raises(IdentityError, match=f"'{field}' is a required property"):
            validate(broken, where="m.json")


def test_validate_names_the_file_and_the_bad_field(bundle):
    broken = json.loads(json.dumps(bundle.data))
    broken["files"]["weights.safetensors"]["sha256"] = "XYZ"
    with pytest.raises(IdentityError, match=r"m\.json: field 'files/weights.safetensors/sha256'"):
        validate(broken, where="m.json")
    broken = {**bundle.data, "files": {"../escape": {"bytes": 1, "sha256": "0" * 64}}}
    with pytest.raises(IdentityError, match="'files'"):
        validate(broken)


@pytest.mark.parametrize("value", ["cmfdeploy.bundle/9", None, "something"])
def test_validate_refuses_unknown_formats(bundle, value):
    with pytest.raises(IdentityError, match="field 'format'"):
        validate({**bundle.data, "format": value})


# -- check_files


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"hello")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.bin").write_bytes(b"world")
    return tmp_path, inventory(tmp_path)


def test_check_files_passes_on_the_recorded_inventory(folder):
    root, recorded = folder
    check_files(root, recorded)


@pytest.mark.parametrize(
    "change, message",
    [(lambda r: (r / "extra").write_bytes(b""), "unexpected file 'extra'"),
     (lambda r: (r / "d" / "b.bin").unlink(), "'d/b.bin' listed in the manifest is missing"),
     (lambda r: (r / "a.bin").write_bytes(b"hello!"), "'a.bin' has 6 bytes"),
     (lambda r: (r / "a.bin").write_bytes(b"jello"), "'a.bin' has sha256")],
)
def test_check_files_names_the_first_difference(folder, change, message):
    root, recorded = folder
    change(root)
    with pytest.raises(IdentityError, match=message):
        check_files(root, recorded)


def test_check_files_sizes_only_misses_a_same_size_edit(folder):
    root, recorded = folder
    (root / "a.bin").write_bytes(b"jello")
    check_files(root, recorded, hashes=False)


def test_check_files_refuses_a_recorded_name_that_escapes(folder):
    root, recorded = folder
    with pytest.raises(IdentityError, match="contains '..'"):
        check_files(root, {**recorded, "../x": {"bytes": 0, "sha256": "0" * 64}})


# -- the chain


def test_chain_of_a_bundle_ends_at_its_verified_cmf(tmp_path):
    cmf = tmp_path / "model.cmf"
    cmf.write_bytes((CONFORMANCE / "model_q8_row_a.cmf").read_bytes())
    manifest = export_bundle(cmf, tmp_path / "bundle")
    assert verify_artifact(tmp_path / "bundle").data == manifest.data
    links = verify_chain(tmp_path / "bundle")
    assert links == [Link(str(tmp_path / "bundle"), "cmfdeploy.bundle/1", "verified"),
                     Link(str(cmf.resolve()), "cmf", "verified")]

    cmf.write_bytes(cmf.read_bytes()[:-1] + b"\0")  # same size, one byte changed
    with pytest.raises(IdentityError, match="sha256"):
        verify_chain(tmp_path / "bundle")
    assert verify_chain(tmp_path / "bundle", hashes=False)[-1].result == "verified (sizes only)"

    cmf.unlink()
    assert verify_chain(tmp_path / "bundle")[-1].result.startswith("not available")


def _verify_scores(path, hashes=True) -> Manifest:
    manifest = identity.load_manifest(path, "cmfdeploy.scores/1")
    check_files(path, manifest["files"], hashes)
    return Manifest(Path(path), manifest)


def test_chain_walks_through_an_upstream_artifact(bundle, tmp_path, monkeypatch):
    """A later stage's output (here a scores folder) points at the bundle; the walk verifies
    the bundle's manifest bytes against the recorded sha256, then the bundle, then the CMF."""
    monkeypatch.setitem(VERIFIERS, "cmfdeploy.scores/1", f"{__name__}:_verify_scores")
    scores = tmp_path / "scores"
    scores.mkdir()
    (scores / "scores.jsonl").write_text('{"item": 0}\n')
    manifest = {**_examples(bundle)["cmfdeploy.scores/1"], "source": _artifact_source(bundle),
                "files": inventory(scores)}
    write_json(scores / MANIFEST_NAME, manifest)
    assert [link.format for link in verify_chain(scores)] == ["cmfdeploy.scores/1", "cmfdeploy.bundle/1", "cmf"]

    write_json(scores / MANIFEST_NAME, {**manifest, "source": {**manifest["source"], "manifest_sha256": "1" * 64}})
    with pytest.raises(IdentityError, match="source.manifest_sha256"):
        verify_chain(scores)

    write_json(scores / MANIFEST_NAME, {**manifest, "source": {**manifest["source"], "path": str(tmp_path / "gone")}})
    assert verify_chain(scores)[-1] == Link(str(tmp_path / "gone"), "cmfdeploy.bundle/1",
                                            "not available: no manifest at the recorded path")


def test_verify_artifact_refuses_a_format_without_verifier(tmp_path):
    write_json(tmp_path / MANIFEST_NAME, {"format": "cmfdeploy.unregistered/1"})
    with pytest.raises(IdentityError, match="no verifier for manifest format 'cmfdeploy.unregistered/1'"):
        verify_artifact(tmp_path)
