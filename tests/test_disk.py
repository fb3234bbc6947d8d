"""Each stage checks its peak disk before it writes anything (manifests.disk, docs/DISK.md): on a
filesystem that reports too little free it is refused with NotEnoughDisk, naming the stage, the
output, the bytes needed and free, and leaves no output; with room it runs as before."""

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from _survey_models import built_survey
from conftest import FIXTURE_CMF, FIXTURE_REFERENCE

from manifests.disk import DISK_NEEDS, DiskNeed, nearest_existing, require_disk
from pipeline.ground.errors import NotEnoughDisk
from pipeline.stages.bundle import export_bundle
from pipeline.stages.deploy import deploy_package
from pipeline.stages.disk import weight_bytes
from pipeline.stages.gates import align_package, make_reference_fixtures
from pipeline.stages.importers.gguf import import_gguf
from pipeline.stages.preflight import run_preflight
from pipeline.stages.release import make_release
from pipeline.stages.survey import run_survey

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "fixtures" / "botchan.txt"
Usage = namedtuple("Usage", "total used free")


def _free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(2 * free + 1, free + 1, free))


@pytest.fixture
def little_disk(monkeypatch):
    _free(monkeypatch, 1000)


@pytest.fixture
def plenty_of_disk(monkeypatch):
    _free(monkeypatch, 1 << 50)


@pytest.fixture(scope="module")
def survey(fixture_packages, tmp_path_factory):
    return built_survey(fixture_packages, tmp_path_factory.mktemp("disk-survey"))


def _refused(stage: str, out: Path, run) -> NotEnoughDisk:
    with pytest.raises(NotEnoughDisk) as caught:
        run()
    message = str(caught.value)
    assert f"stage {stage!r}" in message and str(out) in message
    assert "which has 1000 B" in message and "W = " in message
    assert "Free space there, or pass another" in message
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))
    return caught.value


def test_bundle_is_refused_before_writing(little_disk, tmp_path):
    out = tmp_path / "bundle"
    error = _refused("bundle", out, lambda: export_bundle(FIXTURE_CMF, out))
    assert f"1 x W + 1048576 B fixed (W = {weight_bytes(FIXTURE_CMF)} B, the model's FP32 weight bytes" in str(error)


def test_import_is_refused_before_writing(little_disk, smollm2_gguf, tmp_path):
    out = tmp_path / "import" / "model.cmf"
    _refused("import", out, lambda: import_gguf(smollm2_gguf, out))
    assert not out.parent.exists()


def test_preflight_is_refused_before_writing(little_disk, fixture_bundle, tmp_path):
    out = tmp_path / "preflight"
    _refused("preflight", out, lambda: run_preflight(fixture_bundle, out, text=TEXT))


def test_reference_fixtures_are_refused_before_writing(little_disk, tmp_path):
    out = tmp_path / "reference"
    error = _refused("reference-fixtures", out,
                     lambda: make_reference_fixtures(FIXTURE_CMF, out, TEXT.read_text().splitlines()))
    assert "1 x L + 16777216 B fixed" in str(error)


def test_align_is_refused_before_writing(little_disk, fixture_packages, tmp_path):
    out = tmp_path / "gate"
    error = _refused("align", out, lambda: align_package(fixture_packages / "chunk_kv", FIXTURE_REFERENCE, out))
    assert "3.5 x W (temp folder)" in str(error)


def test_survey_is_refused_before_writing(survey, monkeypatch, tmp_path):
    _free(monkeypatch, 1000)
    out = tmp_path / "survey"
    error = _refused("survey", out, lambda: run_survey(survey.package, survey.fp32_gate, FIXTURE_REFERENCE, survey.items,
                                                       out, recipes=("int8-b32", "int4-b32", "palette4-gc32"), jobs=2))
    assert "3 x 0.5 x W + 2 x 1.5 x W" in str(error)


def test_deploy_is_refused_before_writing(survey, monkeypatch, tmp_path):
    _free(monkeypatch, 1000)
    out = tmp_path / "deployed"
    _refused("deploy", out, lambda: deploy_package(survey.path, survey.package, survey.fp32_gate, out,
                                                   fixtures_dir=FIXTURE_REFERENCE, items=survey.items))


def test_release_is_refused_before_writing(survey, monkeypatch, tmp_path):
    _free(monkeypatch, 1000)
    with pytest.raises(NotEnoughDisk, match=r"stage 'release' needs .* counted as 2 x 1 x W"):
        make_release(survey.path, tmp_path / "dist", name="fixture")
    assert list((tmp_path / "dist").glob("*")) == []


def test_stages_with_room_run_as_before(plenty_of_disk, fixture_bundle, tmp_path):
    assert export_bundle(FIXTURE_CMF, tmp_path / "bundle")["status"] == "complete"
    assert (make_reference_fixtures(FIXTURE_CMF, tmp_path / "reference", TEXT.read_text().splitlines())
            / "logits.npz").exists()
    assert run_preflight(fixture_bundle, tmp_path / "preflight", text=TEXT)["verdict"] == "safe"


def test_the_temp_folder_is_checked_apart_when_it_is_another_filesystem(monkeypatch, tmp_path):
    need = DiskNeed("align", 0.0, 100, "a test", scratch_multiple=2.0)
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(temp))
    monkeypatch.setattr("manifests.disk.same_filesystem", lambda a, b: False)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 0, 10**6 if Path(path) != temp else 1000))
    require_disk(tmp_path / "out", need, 400)  # 100 B beside the output, 800 B in the temp folder: fits each
    with pytest.raises(NotEnoughDisk, match=r"2 x W \(temp folder\).*another temp folder \(TMPDIR\)"):
        require_disk(tmp_path / "out", need, 600)


def test_every_stage_has_one_need_and_outputs_are_checked_where_they_will_be_made(tmp_path):
    assert all(stage == need.stage for stage, need in DISK_NEEDS.items())
    assert nearest_existing(tmp_path / "a" / "b" / "c") == tmp_path


def test_coreml_is_refused_before_writing(little_disk, fixture_bundle, tmp_path):
    from coreml.convert import export_coreml

    out = tmp_path / "coreml"
    _refused("coreml", out, lambda: export_coreml(fixture_bundle, out, kinds=("stateless", "stateful"), jobs=2))


def test_compress_is_refused_before_writing(little_disk, fixture_packages, tmp_path):
    from coreml.recipes.compress import compress_package

    out = tmp_path / "int8"
    _refused("compress", out, lambda: compress_package(fixture_packages / "chunk_kv", "int8-b32", out))
