"""The release folder: packed from the fixture's survey, verified offline down to every byte and
binding, refused when a package's gate failed, and caught by verify-artifact when tampered."""

import json
import shutil

import pytest
from _survey_models import built_survey, failed_gate
from conftest import FIXTURE_REFERENCE

from pipeline.survey import ForeignGate
from manifests.chain import verify_chain
from manifests.identity import read_json, sha256_file
from pipeline.align import GateFailed, align_package
from pipeline.cli import main
from pipeline.errors import IdentityError, OutputExists
from pipeline.release import ReleaseError, make_release, verify_release


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
    tolerance = read_json(survey.path / "gates" / deployed / "alignment.json")["tolerance"]
    assert f"| {deployed} | {tolerance['atol']:.3g} |" in text and "| fp32 | 0.0003 | 0.0003 |" in text
    assert "coreml-executor" in text
    for entry in release["packages"]:
        assert f"| {entry['size_bytes']} |" in text
    for link in release["chain"]:
        assert link["sha256"] in text
    assert release["chain"][0]["sha256"] == sha256_file(FIXTURE_REFERENCE.parent / "botchan-llama-1m.cmf")


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
