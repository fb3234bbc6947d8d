"""The survey's deployed recipe on the stateful package (issue 50): the codes the survey measured,
stored once for prefill and decode, gated in three parts, and what the release ships and runs."""

import json
import shutil

import pytest
from _survey_models import built_survey, greedy_of_release_and_survey
from conftest import FIXTURE_REFERENCE

from coreml.recipes.compress import code_digests
from manifests.identity import read_json, write_json
from pipeline.ground.errors import IdentityError
from pipeline.stages import deploy as deploy_module
from pipeline.stages.backends import release_package
from pipeline.stages.deploy import DeployError, deploy_package, verify_deployment
from pipeline.stages.gates import align_package
from pipeline.stages.release import ReleaseError, make_release, verify_release


def _weight_bytes(package) -> int:
    return (package / "model.mlpackage" / "Data" / "com.apple.CoreML" / "weights" / "weight.bin").stat().st_size


@pytest.fixture(scope="module")
def survey(fixture_packages, tmp_path_factory):
    return built_survey(fixture_packages, tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def stateful_gate(fixture_stateful, survey, tmp_path_factory):
    out = tmp_path_factory.mktemp("deploy-gates") / "stateful"
    assert align_package(fixture_stateful, FIXTURE_REFERENCE, out, items=survey.items).passed
    return out


@pytest.fixture(scope="module")
def deployment(survey, fixture_stateful, stateful_gate, tmp_path_factory):
    return deploy_package(survey.path, fixture_stateful, stateful_gate, tmp_path_factory.mktemp("deploy") / "deployed",
                          fixtures_dir=FIXTURE_REFERENCE, items=survey.items)


def test_the_stateful_package_carries_the_surveyed_codes_once_and_passes_its_gate(deployment, survey):
    recipe = survey.record["deployed"]["recipe"]
    assert recipe is not None and deployment.manifest["recipe"] == recipe
    surveyed = survey.path / "packages" / recipe
    codes = code_digests(deployment.package_dir)
    assert codes == code_digests(surveyed) and len(codes) == deployment.manifest["codes"]["weights"] > 0
    # Prefill and decode read one copy of the codes: the two-function package's weight file is
    # the single-function chunk-KV package's, within the few small tables the kinds differ by.
    assert _weight_bytes(deployment.package_dir) <= 1.02 * _weight_bytes(surveyed)
    # Nothing but the program and its records: no working package of coremltools' (each function
    # made apart over a copy of the weights) left in the folder, its manifest and the release.
    assert sorted(p.name for p in deployment.package_dir.iterdir()) == [
        "manifest.json", "model.mlpackage", "tokenizer.json", "tokenizer_config.json"]
    report = read_json(deployment.gate_dir / "alignment.json")
    assert deployment.passed and report["passed"] and report["package"]["kind"] == "stateful"
    assert report["recipe"] == recipe and report["summary"]["exact"] and report["summary"]["invariants_passed"]
    assert verify_deployment(deployment.manifest.path)["gate"]["passed"]


def test_a_deployment_whose_codes_are_not_the_surveys_is_refused(survey, fixture_stateful, stateful_gate,
                                                                  tmp_path, monkeypatch):
    """A seeded fault: the stateful package compressed by another recipe than the one surveyed."""
    recipe = survey.record["deployed"]["recipe"]
    other = "int4-b32" if recipe != "int4-b32" else "int8-b32"
    compress = deploy_module.compress_package
    monkeypatch.setattr(deploy_module, "compress_package",
                        lambda package, _recipe, out, **kw: compress(package, other, out, **kw))
    with pytest.raises(DeployError, match="coded .* weights other than the survey's"):
        deploy_package(survey.path, fixture_stateful, stateful_gate, tmp_path / "deployed",
                       fixtures_dir=FIXTURE_REFERENCE, items=survey.items)
    assert not (tmp_path / "deployed").exists()


def test_verify_deployment_catches_a_codes_record_that_differs(deployment, tmp_path):
    copy = tmp_path / "deployed"
    shutil.copytree(deployment.manifest.path, copy)
    manifest = read_json(copy / "manifest.json")
    manifest["codes"]["sha256"] = "0" * 64
    write_json(copy / "manifest.json", manifest)
    with pytest.raises(IdentityError, match="codes.sha256"):
        verify_deployment(copy)


def test_a_deployment_refuses_a_package_of_another_bundle(survey, tmp_path):
    """The survey's own FP32 gate is passed, but of the chunk-KV package: refused as another package's gate."""
    with pytest.raises(Exception, match="another package"):
        deploy_package(survey.path, survey.package.parent / "stateless", survey.fp32_gate, tmp_path / "d",
                       fixtures_dir=FIXTURE_REFERENCE, items=survey.items)


@pytest.fixture(scope="module")
def release(survey, deployment, fixture_stateful, stateful_gate, tmp_path_factory):
    return make_release(survey.path, tmp_path_factory.mktemp("dist"), packages=[(fixture_stateful, stateful_gate)],
                        deployment=deployment.manifest.path)


def test_the_release_ships_the_stateful_package_and_describes_it(release, deployment):
    roles = {e["role"]: e for e in release["packages"]}
    shipped = roles["shipped"]
    assert shipped["kind"] == "stateful" and release["interface"]["kind"] == "stateful"
    assert roles["deployed"]["kind"] == "chunk_kv"  # the surveyed package, beside it
    metadata = json.loads((release.path / "metadata.json").read_text())
    assert metadata["assets"]["model"] == f"{shipped['path']}/model.mlpackage"
    assert metadata["compression"]["size_bytes"] == shipped["size_bytes"]
    page = (release.path / "RELEASE.md").read_text()
    assert page.index(f"{shipped['path']}/model.mlpackage") < page.index("## Use it")
    assert release_package(release.path) == release.path / shipped["path"]
    verify_release(release.path)


def test_generate_on_the_release_runs_the_stateful_package_as_the_surveyed_one_runs(release, survey):
    released, surveyed = greedy_of_release_and_survey(release, survey.path / "packages" / release["recipe"])
    assert released == surveyed


def test_a_release_refuses_a_deployment_without_its_fp32_package(survey, deployment, tmp_path):
    with pytest.raises(ReleaseError, match="manifest of no FP32 package in this release"):
        make_release(survey.path, tmp_path, deployment=deployment.manifest.path)
