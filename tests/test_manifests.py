"""manifests: streamed hashes, inventories, canonical JSON, safe paths, schemas, the chain walk."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from manifests.chain import Link
from pipeline.stages.artifacts import VERIFIERS, verify_artifact, verify_chain
from manifests.identity import (
    MANIFEST_NAME,
    Manifest,
    artifact_source,
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
from pipeline.stages.bundle import export_bundle
from pipeline.ground.errors import IdentityError

CONFORMANCE = Path("/work/shared/cmf-conformance")


def test_sha256_file_and_file_identity(tmp_path):
    data = os.urandom(3 * (1 << 20) + 123)  # several of hashlib's read buffers and a partial one
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    assert file_identity(tmp_path / "f") == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


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


IDENTITY_FIELDS = {"format", "status", "source", "files", "environment"}


@pytest.mark.parametrize("format_name", sorted(SCHEMA_FILES))
def test_every_stage_schema_pins_its_format_and_requires_the_identity_fields(format_name):
    schema = load_schema(SCHEMA_FILES[format_name])
    assert schema["properties"]["format"] == {"const": format_name}
    required = set(schema["required"])
    if {"$ref": "cmfdeploy:common#/$defs/stage_common"} in schema.get("allOf", []):
        required |= set(load_schema(COMMON_FILE)["$defs"]["stage_common"]["required"])
    assert IDENTITY_FIELDS <= required


def test_a_bundle_manifest_validates_and_each_missing_field_is_named(bundle):
    validate(bundle.data)
    for field in sorted(set(load_schema(SCHEMA_FILES["cmfdeploy.bundle/1"])["required"]) - {"format"}):
        broken = {k: v for k, v in bundle.data.items() if k != field}
        with pytest.raises(IdentityError, match=f"m.json: field '\\(top level\\)': '{field}' is a required property"):
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
    # A runnable model: once the CMF is gone, verify_bundle derives the tensor set from the
    # config, which a conformance vector's arch block does not describe.
    cmf = tmp_path / "model.cmf"
    cmf.write_bytes((Path(__file__).parent.parent / "fixtures" / "botchan-llama-1m.cmf").read_bytes())
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


def _verify_stage(path, hashes=True) -> Manifest:
    """A later stage's verifier, as a stage registers one (its schema is the stage's business)."""
    manifest = read_json(Path(path) / MANIFEST_NAME)
    check_files(path, manifest["files"], hashes)
    return Manifest(Path(path), manifest)


def test_chain_walks_through_an_upstream_artifact(bundle, tmp_path, monkeypatch):
    """A later stage's output points at the bundle; the walk verifies the bundle's manifest
    bytes against the recorded sha256, then the bundle, then the CMF."""
    monkeypatch.setitem(VERIFIERS, "cmfdeploy.stage/1", f"{__name__}:_verify_stage")
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "result.jsonl").write_text('{"item": 0}\n')
    source = {"kind": "artifact", "format": "cmfdeploy.bundle/1", "path": str(bundle.path),
              "manifest_sha256": sha256_file(bundle.path / MANIFEST_NAME)}
    manifest = {"format": "cmfdeploy.stage/1", "status": "complete", "source": source, "files": inventory(stage)}
    write_json(stage / MANIFEST_NAME, manifest)
    assert [link.format for link in verify_chain(stage)] == ["cmfdeploy.stage/1", "cmfdeploy.bundle/1", "cmf"]

    write_json(stage / MANIFEST_NAME, {**manifest, "source": {**source, "manifest_sha256": "1" * 64}})
    with pytest.raises(IdentityError, match="source.manifest_sha256"):
        verify_chain(stage)

    write_json(stage / MANIFEST_NAME, {**manifest, "source": {**source, "path": str(tmp_path / "gone")}})
    assert verify_chain(stage)[-1] == Link(str(tmp_path / "gone"), "cmfdeploy.bundle/1",
                                           "not available: no manifest at the recorded path")


def _stage_over(upstream: Path, stage: Path) -> dict:
    """A later stage's output at `stage`, bound to `upstream` as a stage binds it."""
    stage.mkdir(parents=True)
    (stage / "result.jsonl").write_text('{"item": 0}\n')
    manifest = {"format": "cmfdeploy.stage/1", "status": "complete",
                "source": artifact_source(upstream, relative_to=stage), "files": inventory(stage)}
    write_json(stage / MANIFEST_NAME, manifest)
    return manifest


def test_chain_follows_the_relative_path_of_a_tree_moved_as_a_whole(tmp_path, monkeypatch):
    monkeypatch.setitem(VERIFIERS, "cmfdeploy.stage/1", f"{__name__}:_verify_stage")
    cmf = tmp_path / "model.cmf"
    cmf.write_bytes((CONFORMANCE / "model_q8_row_a.cmf").read_bytes())
    export_bundle(cmf, tmp_path / "build" / "bundle")
    source = _stage_over(tmp_path / "build" / "bundle", tmp_path / "build" / "stages" / "one")["source"]
    assert source["relative_path"] == "../../bundle"
    assert "path" not in source  # no path of the build machine

    shutil.move(tmp_path / "build", tmp_path / "moved")
    links = verify_chain(tmp_path / "moved" / "stages" / "one")
    assert links == [Link(str(tmp_path / "moved" / "stages" / "one"), "cmfdeploy.stage/1", "verified"),
                     Link(str((tmp_path / "moved" / "bundle").resolve()), "cmfdeploy.bundle/1", "verified"),
                     Link(str(cmf.resolve()), "cmf", "verified")]

    # An upstream at the relative path that is not the recorded one is reported, not looked past,
    # even though the recorded path would no longer lead anywhere else.
    bundle_manifest = tmp_path / "moved" / "bundle" / MANIFEST_NAME
    write_json(bundle_manifest, {**read_json(bundle_manifest), "license": "edited"})
    with pytest.raises(IdentityError, match="source.manifest_sha256"):
        verify_chain(tmp_path / "moved" / "stages" / "one")


def test_an_artifact_moved_alone_verifies_and_reports_its_upstream_not_available(bundle, tmp_path, monkeypatch):
    monkeypatch.setitem(VERIFIERS, "cmfdeploy.stage/1", f"{__name__}:_verify_stage")
    upstream = shutil.copytree(bundle.path, tmp_path / "bundle")
    manifest = _stage_over(upstream, tmp_path / "stage")
    (tmp_path / "away").mkdir()
    shutil.move(tmp_path / "stage", tmp_path / "away" / "stage")  # ../bundle from here is not there
    links = verify_chain(tmp_path / "away" / "stage")
    assert [(link.path, link.result) for link in links] == [
        (str(tmp_path / "away" / "stage"), "verified"),
        (str((tmp_path / "away" / "bundle").resolve()), "not available: no manifest at the recorded path")]

    # A record made before links were relative also holds the absolute path, tried second.
    stage = tmp_path / "away" / "stage"
    write_json(stage / MANIFEST_NAME, {**manifest, "source": {**manifest["source"], "path": str(upstream.resolve())}})
    links = verify_chain(stage)
    assert [(link.path, link.result) for link in links] == [
        (str(stage), "verified"), (str(upstream.resolve()), "verified"), (bundle["source"]["path"], "verified")]
    write_json(upstream / MANIFEST_NAME, {**read_json(upstream / MANIFEST_NAME), "license": "edited"})
    with pytest.raises(IdentityError, match="source.manifest_sha256"):
        verify_chain(stage)


def test_verify_artifact_refuses_a_format_without_verifier(tmp_path):
    write_json(tmp_path / MANIFEST_NAME, {"format": "cmfdeploy.unregistered/1"})
    with pytest.raises(IdentityError, match="no verifier for manifest format 'cmfdeploy.unregistered/1'"):
        verify_artifact(tmp_path)
