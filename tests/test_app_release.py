"""The app folder (issue 50): the package an app loads, its tokenizer and metadata.json, cut from the
fixture's release. It holds nothing else, verifies offline and back through the release to the
CMF, runs as the release runs, and refuses a manifest that claims another entry than the release
ships."""

import json
import shutil

import numpy as np
import pytest
from _survey_models import built_survey

from manifests.identity import read_json, write_json
from pipeline.cli import main
from pipeline.ground.errors import IdentityError, OutputExists
from pipeline.stages.app_release import make_app_release, verify_app_release
from pipeline.stages.artifacts import verify_chain
from pipeline.stages.backends import open_backend, shipped_entry
from pipeline.stages.release import make_release


@pytest.fixture(scope="module")
def release(fixture_packages, tmp_path_factory):
    survey = built_survey(fixture_packages, tmp_path_factory.getbasetemp())
    return make_release(survey.path, tmp_path_factory.mktemp("app") / "dist")


@pytest.fixture(scope="module")
def app(release):
    return make_app_release(release.path)


def test_the_app_folder_holds_the_shipped_package_tokenizer_and_descriptor_only(release, app):
    shipped = shipped_entry(release.data)
    assert app.path == release.path.parent / f"{release.path.name}-app"
    assert app["shipped"] == shipped
    tops = sorted(p.name for p in app.path.iterdir())
    assert tops == ["RELEASE.md", "manifest.json", "metadata.json", "packages", "tokenizer"]
    assert sorted(p.name for p in (app.path / "packages").iterdir()) == [shipped["name"]]
    for name in app["files"]:  # the package's and tokenizer's files are the release's, byte for byte
        if name.startswith(("packages/", "tokenizer/")):
            assert (app.path / name).read_bytes() == (release.path / name).read_bytes(), name
    metadata, release_metadata = read_json(app.path / "metadata.json"), read_json(release.path / "metadata.json")
    assert metadata["assets"]["packages"] == {shipped["name"]: release_metadata["assets"]["packages"][shipped["name"]]}
    assert {k: v for k, v in metadata.items() if k != "assets"} == {k: v for k, v in release_metadata.items()
                                                                     if k != "assets"}
    assert app["inventory"]["total_bytes"] < release["inventory"]["total_bytes"]


def test_its_page_loads_it_from_this_folder_and_gives_its_gate(app):
    text = (app.path / "RELEASE.md").read_text()
    folder = f"dist/{app.path.name}"
    assert f'release = "{folder}"  # this folder' in text
    assert f'URL(fileURLWithPath: "{folder}")' in text or f'"{folder}/' in text
    assert f"cmfdeploy generate {folder} " in text
    assert f"| {app['shipped']['name']} | {app['shipped']['gate']['recipe']} |" in text


def test_it_verifies_through_the_release_to_the_cmf_and_runs_as_the_release_runs(release, app, capsys):
    links = verify_chain(app.path)
    assert [link.format for link in links][:2] == ["cmfdeploy.app_release/1", "cmfdeploy.release/1"]
    assert links[-1].format == "cmf" and all(link.result == "verified" for link in links)
    assert main(["verify-artifact", str(app.path)]) == 0
    ids = np.array([[1, 40, 41, 42, 43]], dtype=np.int64)
    ours, theirs = open_backend(app.path), open_backend(release.path)
    # The same package files run by the same executor in one process, on the same inputs: the
    # same arithmetic in the same order, so bit for bit on any CPU.
    np.testing.assert_array_equal(ours.logits(ids), theirs.logits(ids))


def test_a_copy_without_its_release_verifies_on_its_own(app, tmp_path):
    copy = tmp_path / app.path.name
    shutil.copytree(app.path, copy)
    verify_app_release(copy)
    links = verify_chain(copy)
    assert links[0].result == "verified" and links[1].result != "verified"


def test_a_manifest_claiming_another_entry_than_the_release_ships_is_refused(release, app, tmp_path):
    forged = release.path.parent / f"{app.path.name}-forged"
    shutil.copytree(app.path, forged)
    manifest = read_json(forged / "manifest.json")
    manifest["shipped"]["gate"]["summary"]["max_abs"] = 0.0  # a better verdict than the gate's
    write_json(forged / "manifest.json", manifest)
    with pytest.raises(IdentityError, match="field 'shipped' is not the entry the release at"):
        verify_app_release(forged)
    (forged / "metadata.json").write_text(json.dumps({"edited": True}))
    with pytest.raises(IdentityError, match="metadata.json"):
        verify_app_release(forged)


def test_an_existing_app_folder_is_kept_without_force(release, app):
    with pytest.raises(OutputExists):
        make_app_release(release.path)
    assert main(["app-release", str(release.path), "--force"]) == 0
    verify_app_release(app.path)
