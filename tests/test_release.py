"""The release folder: packed from the fixture's survey, verified offline down to every byte and
binding, refused when a package's gate failed, and caught by verify-artifact when tampered."""

import json
import shutil

import pytest
from _survey_models import built_survey, failed_gate
from conftest import FIXTURE_REFERENCE

from pipeline.stages.survey import ForeignGate
from pipeline.stages.artifacts import verify_chain
from manifests.identity import read_json, sha256_file
from pipeline.stages.gates import GateFailed, align_package
from pipeline.cli import main
from pipeline.ground.errors import IdentityError, OutputExists
from pipeline.stages.release import ReleaseError, make_release, verify_release


@pytest.fixture(scope="module")
def survey(fixture_packages, tmp_path_factory):
    return built_survey(fixture_packages, tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def stateless_gate(fixture_packages, tmp_path_factory):
    out = tmp_path_factory.mktemp("release-gates") / "stateless"
    align_package(fixture_packages / "stateless", FIXTURE_REFERENCE, out)
    return out


@pytest.fixture(scope="module")
def release(survey, fixture_packages, stateless_gate, tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    return make_release(survey.path, dist, packages=[(fixture_packages / "stateless", stateless_gate)])


def test_release_holds_the_deployed_package_the_fp32_packages_gates_and_survey(release, survey, fixture_packages):
    deployed = survey.record["deployed"]["recipe"]
    assert deployed is not None, "no recipe passed its gate: nothing to release"
    assert release.path.name == f"botchan-llama-1m-{deployed}"
    assert release["recipe"] == deployed and release["deployed"] is True
    entries = {e["name"]: e for e in release["packages"]}
    assert set(entries) == {"fp32-chunk_kv", deployed, "fp32-stateless"}
    sources = {"fp32-chunk_kv": survey.package, deployed: survey.path / "packages" / deployed,
               "fp32-stateless": fixture_packages / "stateless"}
    for name, source in sources.items():
        copy = release.path / entries[name]["path"]
        assert sha256_file(copy / "manifest.json") == sha256_file(source / "manifest.json")
        assert entries[name]["gate"]["passed"] is True
        gate = read_json(release.path / entries[name]["gate"]["path"] / "manifest.json")
        assert gate["source"]["manifest_sha256"] == sha256_file(source / "manifest.json")
    assert sha256_file(release.path / "survey" / "survey.json") == sha256_file(survey.path / "survey.json")
    assert release["inventory"]["total_bytes"] == sum(
        p.stat().st_size for p in release.path.rglob("*") if p.is_file() and p != release.path / "manifest.json")


def test_release_page_states_interface_tolerances_backend_sizes_and_chain(release, survey):
    text = (release.path / "RELEASE.md").read_text()
    for feature in ("input_ids", "position", "key_cache", "logits", "new_value_cache"):
        assert f"| {feature} |" in text
    deployed = release["recipe"]
    fp32_gate = survey.path / read_json(survey.path / "survey.json")["fp32"]["gate"]["path"]
    for recipe, gate in ((deployed, survey.path / "gates" / deployed), ("fp32", fp32_gate)):
        assert f"| {recipe} | {read_json(gate / 'alignment.json')['tolerance']['atol']:.3g} |" in text
    assert "coreml-executor" in text
    for entry in release["packages"]:
        assert f"| {entry['size_bytes']} |" in text
    for link in release["chain"]:
        assert link["sha256"] in text
    assert release["chain"][0]["sha256"] == sha256_file(FIXTURE_REFERENCE.parent / "botchan-llama-1m.cmf")


def test_a_release_under_the_default_budget_says_its_package_was_not_scored(survey, tmp_path):
    """The default budget sets no items limit, so the deployed package's gate did not score the
    scoring set: the release page says so and why, with FP32's figures, and the release verifies."""
    from pipeline.stages.survey import run_survey

    default = run_survey(survey.package, survey.fp32_gate, FIXTURE_REFERENCE, survey.items, tmp_path / "survey",
                         recipes=("int8-b32",), progress=False, fp32_scores=survey.path / "scores" / "fp32")
    record = default["recipes"][0]
    assert default["deployed"]["recipe"] == "int8-b32" and "items=" in record["scoring"]["not_measured"]
    released = make_release(tmp_path / "survey", tmp_path / "dist")
    text = (released.path / "RELEASE.md").read_text()
    assert f"not scored for this package ({record['scoring']['not_measured']})" in text
    fp32 = default["fp32"]["scoring"]
    assert f"FP32's top-1 accuracy {fp32['top1_accuracy']:.3f}, MRR {fp32['mrr']:.3f}" in text
    assert all(link.result == "verified" for link in verify_chain(released.path))


def test_verify_artifact_checks_the_release_and_walks_its_chain_to_the_cmf(release, capsys):
    links = verify_chain(release.path)
    assert [link.format for link in links] == [
        "cmfdeploy.release/1", "cmfdeploy.compressed/1", "cmfdeploy.coreml/1", "cmfdeploy.bundle/1", "cmf"]
    assert all(link.result == "verified" for link in links)
    assert main(["verify-artifact", str(release.path)]) == 0
    assert "cmfdeploy.release/1" in capsys.readouterr().out


def _tampered_copy(release, tmp_path):
    copy = tmp_path / release.path.name
    shutil.copytree(release.path, copy)
    return copy


def test_verify_artifact_catches_a_flipped_byte_in_a_released_weight(release, tmp_path, capsys):
    copy = _tampered_copy(release, tmp_path)
    weights = next((copy / "packages" / release["recipe"]).rglob("weight.bin"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x80
    weights.write_bytes(bytes(data))
    assert main(["verify-artifact", str(copy)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("IdentityError: ") and "weight.bin" in err and "sha256" in err


@pytest.mark.parametrize("victim", ["RELEASE.md", "survey/survey.json", "gates/fp32-chunk_kv/alignment.json"])
def test_verify_release_names_any_edited_file(release, tmp_path, victim):
    copy = _tampered_copy(release, tmp_path)
    path = copy / victim
    path.write_bytes(path.read_bytes().replace(b"0", b"1", 1))
    with pytest.raises(IdentityError, match=f"file '{victim}' has sha256"):
        verify_release(copy)


def test_verify_release_catches_a_rebound_package_manifest_even_with_a_matching_inventory(release, tmp_path):
    """Edit a package manifest and re-record its hash in the release inventory: the binding
    recorded in the release's package list (and the gate's source) still catches it."""
    copy = _tampered_copy(release, tmp_path)
    name = f"packages/{release['recipe']}/manifest.json"
    manifest = read_json(copy / name)
    manifest["size_bytes"] += 1
    (copy / name).write_text(json.dumps(manifest))
    outer = read_json(copy / "manifest.json")
    outer["files"][name] = {"bytes": (copy / name).stat().st_size, "sha256": sha256_file(copy / name)}
    (copy / "manifest.json").write_text(json.dumps(outer))
    with pytest.raises(IdentityError, match=r"field 'packages/1/manifest_sha256'"):
        verify_release(copy)


def test_verify_release_refuses_numbers_the_release_or_survey_copied_wrongly(release, tmp_path):
    """Rewritten with their hashes, so only the comparison with the gate's own report catches them."""
    copy = _tampered_copy(release, tmp_path)
    name, recipe = "survey/survey.json", release["recipe"]
    survey = read_json(copy / name)
    next(r for r in survey["recipes"] if r["name"] == recipe)["gate"]["max_abs"] = 0.0
    (copy / name).write_text(json.dumps(survey))
    outer = read_json(copy / "manifest.json")
    outer["files"][name] = {"bytes": (copy / name).stat().st_size, "sha256": sha256_file(copy / name)}
    outer["survey"]["sha256"] = sha256_file(copy / name)
    (copy / "manifest.json").write_text(json.dumps(outer))
    with pytest.raises(IdentityError, match=rf"survey.json: field 'recipes\[{recipe}\].gate.max_abs' is 0.0, but "
                                            rf".*gates/{recipe}/alignment.json says"):
        verify_release(copy)
    outer["packages"][0]["gate"]["tolerance"]["atol"] = 1.0
    (copy / "manifest.json").write_text(json.dumps(outer))
    with pytest.raises(IdentityError, match=r"field 'packages/0/gate.tolerance' is .*'atol': 1.0"):
        verify_release(copy)


def test_release_refuses_a_package_whose_gate_failed(survey, tmp_path):
    gate = failed_gate(survey.path)
    with pytest.raises(GateFailed, match=f"{gate}.*did not pass"):
        make_release(survey.path, tmp_path, packages=[(survey.path / "packages" / "int4-b32", gate)])
    assert not any(tmp_path.iterdir())


def test_release_refuses_a_gate_of_another_package(survey, fixture_packages, tmp_path):
    with pytest.raises(ForeignGate, match="this gate is of another package"):
        make_release(survey.path, tmp_path, packages=[(fixture_packages / "stateless", survey.fp32_gate)])


def test_release_refuses_unmeasured_recipes_and_existing_output(survey, release, capsys):
    with pytest.raises(ReleaseError, match="recipe 'mixed' was not measured"):
        make_release(survey.path, release.path.parent, recipe="mixed")
    with pytest.raises(OutputExists):
        make_release(survey.path, release.path.parent)
    assert main(["release", str(survey.path), "-o", str(release.path.parent)]) == 1
    assert capsys.readouterr().err.startswith("OutputExists: ")


# --- a release is a thing you copy to another machine ------------------------------------------


def _json_strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _json_strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _json_strings(item)


def test_nothing_in_a_release_names_a_path_of_the_build_machine(release, survey, tmp_path_factory):
    build_roots = {str(tmp_path_factory.getbasetemp().resolve()), str(FIXTURE_REFERENCE.parent.parent.resolve())}
    texts = [p for p in release.path.rglob("*") if p.suffix in (".json", ".md")]
    assert {p.name for p in texts} >= {"manifest.json", "metadata.json", "RELEASE.md", "survey.md", "alignment.json",
                                       "alignment.md", "survey.json", "tokenizer_config.json"}
    for path in texts:
        text = path.read_text()
        for root in build_roots:
            assert root not in text, f"{path.relative_to(release.path)} names {root}"
        if path.suffix == ".json":
            absolute = [s for s in _json_strings(json.loads(text)) if s.startswith("/")]
            assert absolute == [], f"{path.relative_to(release.path)}: {absolute}"
    # The survey page's first line names the source package relative to the survey folder.
    survey_md = (release.path / "survey" / "survey.md").read_text().splitlines()
    first = next(line for line in survey_md if line.startswith("- source package"))
    assert (survey.path / first.split("`")[1]).resolve() == survey.package.resolve()


@pytest.fixture(scope="module")
def relocated(release, tmp_path_factory):
    """The release copied alone to a folder that shares no ancestry with the build tree but /tmp,
    at another depth, so no relative link can reach the build tree."""
    copy = tmp_path_factory.mktemp("elsewhere") / "a" / "b" / release.path.name
    shutil.copytree(release.path, copy)
    return copy


def test_a_relocated_release_verifies_everything_inside_it(relocated, capsys):
    links = verify_chain(relocated)
    assert [(link.format, link.result.split(":")[0]) for link in links] == [
        ("cmfdeploy.release/1", "verified"), ("cmfdeploy.compressed/1", "not available")]
    assert main(["verify-artifact", str(relocated)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"cmfdeploy.release/1 {relocated}: verified"
    # It names what it checked: every file, the packages, gates, tokenizer and descriptor.
    files = len(read_json(relocated / "manifest.json")["files"])
    assert out[1].startswith(f"  checked: {files} files by sha256; every package against its manifest")
    assert "tokenizer/" in out[1] and "metadata.json" in out[1]
    assert out[2].startswith("cmfdeploy.compressed/1 ") and out[2].endswith("not available: no manifest at the recorded path")


def test_a_relocated_release_carries_its_tokenizer_and_describes_itself(release, relocated):
    deployed = relocated / "packages" / release["recipe"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (relocated / "tokenizer" / name).read_bytes() == (deployed / name).read_bytes()
    assert release["tokenizer"] == read_json(deployed / "manifest.json")["tokenizer"]
    metadata = read_json(relocated / "metadata.json")
    assert metadata["context_length"] == release["interface"]["context"] == 128
    assert metadata["compression"]["recipe"] == release["recipe"]
    for asset in ("model", "tokenizer", "tokenizer_config"):
        assert (relocated / metadata["assets"][asset]).exists()
    edited = dict(metadata, context_length=4096)
    (relocated / "metadata.json").write_text(json.dumps(edited))
    with pytest.raises(IdentityError, match="metadata.json"):
        verify_release(relocated)
    (relocated / "metadata.json").write_text(json.dumps(metadata, sort_keys=True, indent=2) + "\n")
    verify_release(relocated)


def test_text_commands_run_on_a_relocated_release_with_text_alone(release, relocated, survey, tmp_path, capsys):
    from pipeline.stages.backends import open_backend
    from pipeline.ground.generation import generate
    from pipeline.ground.tokenizer import tokenizer_from_artifact

    deployed = relocated / "packages" / release["recipe"]
    tokenizer = tokenizer_from_artifact(relocated)
    prompt = tokenizer.encode("I was sent to", add_bos=True)
    assert main(["generate", str(relocated), "--prompt", "I was sent to", "--bos", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert out == tokenizer.decode(list(generate(open_backend(deployed), prompt, max_tokens=8))) + "\n"

    (tmp_path / "t.txt").write_text("I was sent to a middle school in the country.")
    assert main(["ppl", str(relocated), "--text", str(tmp_path / "t.txt")]) == 0
    assert main(["ppl", str(deployed), "--text", str(tmp_path / "t.txt")]) == 0
    release_line, package_line = capsys.readouterr().out.splitlines()
    assert release_line == package_line  # the release runs as the package it ships
    assert main(["logits", str(relocated), "--text", str(tmp_path / "t.txt"), "-o", str(tmp_path / "x.npz")]) == 0
    assert main(["score", str(relocated), str(survey.items)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"{relocated}: 8 items, top-1 accuracy")


def test_the_release_page_shows_how_to_load_package_and_tokenizer_on_a_mac(release):
    text = (release.path / "RELEASE.md").read_text()
    python = text.split("```python\n")[1].split("```")[0]
    compile(python, "RELEASE.md", "exec")  # prediction itself needs macOS
    assert "ct.models.MLModel(" in python and "Tokenizer.from_file(" in python
    assert f"packages/{release['recipe']}/model.mlpackage" in python and "tokenizer/tokenizer.json" in python
    assert "key_cache=cache" in python  # the deployed package is chunk-KV: its caches are inputs
    assert "```swift\n" in text and "not compiled here" in text
    assert f"cmfdeploy score dist/{release.path.name} items.jsonl" in text


def test_verify_artifact_checks_a_survey_folder_and_names_what_it_checked(survey, tmp_path, capsys):
    assert main(["verify-artifact", str(survey.path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"cmfdeploy.survey_folder/1 {survey.path}: verified"
    files = len(read_json(survey.path / "manifest.json")["files"])
    assert out[1] == (f"  checked: {files} files by sha256; survey.json against its schema and inventory, "
                      "every measured package and gate")
    assert [line.split(" ")[0] for line in out if not line.startswith(" ")] == [
        "cmfdeploy.survey_folder/1", "cmfdeploy.coreml/1", "cmfdeploy.bundle/1", "cmf"]
    copy = tmp_path / "survey"
    shutil.copytree(survey.path, copy)
    report = copy / "survey.json"
    report.write_text(report.read_text().replace('"deployed"', '"deployed" ', 1))
    assert main(["verify-artifact", str(copy)]) == 1
    assert "survey.json" in capsys.readouterr().err
# --- signed releases ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def signing_key(tmp_path_factory):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    folder = tmp_path_factory.mktemp("keys")
    keys = {}
    for name in ("ours", "theirs"):
        key = Ed25519PrivateKey.generate()
        (folder / name).write_bytes(key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                                      serialization.NoEncryption()))
        public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        keys[name] = (folder / name, public.hex())
    return keys


@pytest.fixture(scope="module")
def signed(survey, signing_key, tmp_path_factory):
    dist = tmp_path_factory.mktemp("signed-dist")
    assert main(["release", str(survey.path), "-o", str(dist), "--sign", str(signing_key["ours"][0])]) == 0
    (release,) = dist.iterdir()
    return release


def test_a_signed_release_verifies_with_its_public_key(signed, signing_key, capsys):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    sig = json.loads((signed / "manifest.json.sig").read_text())
    # One statement over every file: the signed manifest lists each file's sha256.
    assert sig["sha256"] == sha256_file(signed / "manifest.json")
    Ed25519PublicKey.from_public_bytes(bytes.fromhex(signing_key["ours"][1])).verify(
        bytes.fromhex(sig["sig"]), bytes.fromhex(sig["sha256"]))
    files = read_json(signed / "manifest.json")["files"]
    assert all(sha256_file(signed / name) == entry["sha256"] for name, entry in files.items())
    capsys.readouterr()
    assert main(["verify-artifact", str(signed), "--pubkey", signing_key["ours"][1]]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"signature {signed / 'manifest.json.sig'}: verified, by {signing_key['ours'][1]}")


def test_verify_artifact_with_a_key_refuses_an_unsigned_release_and_another_key(release, signed, signing_key, capsys):
    capsys.readouterr()
    assert main(["verify-artifact", str(release.path), "--pubkey", signing_key["ours"][1]]) == 1
    err = capsys.readouterr().err
    assert err.startswith("SignatureError: ") and "the artifact is unsigned" in err, err
    assert main(["verify-artifact", str(signed), "--pubkey", signing_key["theirs"][1]]) == 1
    assert "signed by an untrusted key" in capsys.readouterr().err


def test_a_release_manifest_rewritten_with_its_hashes_fails_the_signature(signed, signing_key, tmp_path, capsys):
    copy = tmp_path / signed.name
    shutil.copytree(signed, copy)
    manifest = read_json(copy / "manifest.json")
    manifest["packages"][1]["gate"]["summary"]["max_abs"] = 0.0
    (copy / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["verify-artifact", str(copy)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("IdentityError: ") and "max_abs" in err, err
    # With the key, any rewrite fails on the signed digest before its content is read.
    manifest = read_json(signed / "manifest.json")
    manifest["model"] = "someone-else"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify-artifact", str(copy), "--pubkey", signing_key["ours"][1]]) == 1
    err = capsys.readouterr().err
    assert err.startswith("SignatureError: ") and f"actual {sha256_file(copy / 'manifest.json')}" in err, err
