"""Stages killed, starved of disk, or run twice at once never leave a complete-looking output.

Each stage runs as `cmfdeploy <stage>` in a child stopped before every filesystem step it
takes in the output's folder (`_stepped_stage.py`), so the instants are steps of the write,
not delays that the machine's load would move. At each one the disk is what a SIGKILL there
would leave, and it must hold the contract: the output name is absent or holds a finished
output that verifies, no staging or set-aside folder is taken as an output, not even the
whole one of the instant before the rename, and the stage's temp folder is empty. A first
run is SIGKILLed a few steps into its staging folder; a second, checked at every step, runs to the end beside what it left and
leaves the output and nothing else. A full tmpfs makes a forced rerun fail with a clear error
that leaves the old output as it was. Two runs writing one output: one wins, the other fails
saying why, and the output is one run's, never a mix.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURE_CMF, FIXTURE_REFERENCE, ROOT

from manifests.output import unfinished_output
from pipeline.stages.artifacts import verify_artifact, verify_chain
from pipeline.ground.errors import CmfdeployError, OutputWriteFailed

ITEMS = 4
# The killed run dies before this many steps on paths in its staging folder (mkdir, the first
# manifest, early work), so what it leaves is half-written; the run after it is stopped at
# every step, the one before its rename included.
KILL_AT_STAGED_STEP = 3
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *map(str, args)]


def _leftovers(out: Path) -> list[Path]:
    """Staging folders of `out`, and old outputs a forced run set aside."""
    return sorted(p for p in out.parent.iterdir() if unfinished_output(p) == out.resolve())


def _looks_complete(folder: Path) -> bool:
    try:
        verify_artifact(folder)
    except CmfdeployError:
        return False
    return True


class SteppedStages:
    """The fork server of `_stepped_stage.py`: each `run` is one stage, stopped at every step."""

    def __init__(self, log: Path, temp: Path):
        self.log = log.open("w")
        self.temp = temp  # the stages' temp folder (TMPDIR)
        self.server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_stepped_stage.py"))],
                                       cwd=ROOT, env={**ENV, "TMPDIR": str(temp)}, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=self.log)

    def _read(self) -> str:
        line = self.server.stdout.readline().decode()
        assert line, f"the stage server died; see {self.log.name}"
        return line.rstrip("\n")

    def run(self, argv: list, watch: Path, at_step) -> tuple[int, int]:
        """(exit status, steps taken) of `cmfdeploy argv`; before each of its steps in or under
        `watch`, `at_step(event, paths)` says whether it may go on (False: SIGKILL it and its
        workers there)."""
        request = {"argv": [str(a) for a in argv], "watch": str(watch)}
        self.server.stdin.write((json.dumps(request) + "\n").encode())
        self.server.stdin.flush()
        pid, steps = int(self._read().removeprefix("pid ")), 0
        while (line := self._read()).startswith("step "):
            event, *paths = line.removeprefix("step ").split("\t")
            steps += 1
            if at_step(event, [Path(p) for p in paths]):
                self.server.stdin.write(b"go\n")
                self.server.stdin.flush()
            else:
                os.killpg(pid, signal.SIGKILL)
        return int(line.removeprefix("exit ")), steps

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)
        self.log.close()


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    runs = SteppedStages(tmp_path_factory.mktemp("stepped") / "server.log", tmp_path_factory.mktemp("stages-temp"))
    yield runs
    runs.close()


def _assert_the_contract_holds(out: Path, verify, temp: Path) -> None:
    """What a kill at this instant would leave: nothing taken as output but a verified `out`,
    and nothing in the temp folder (what a stage keeps there is unlinked, or in its staging folder)."""
    assert list(temp.iterdir()) == []
    for folder in _leftovers(out):
        assert not _looks_complete(folder), f"{folder} verifies as a complete output"
    if out.exists():
        verify(out)


def _assert_killed_runs_leave_nothing_complete(stages: SteppedStages, argv: list, out: Path,
                                               verify=verify_chain) -> None:
    """`verify(out)` checks a finished output (an artifact's chain by default)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    watch = out.parent.resolve()
    staged = []

    def until_a_few_staged_steps(event, paths):
        _assert_the_contract_holds(out, verify, stages.temp)
        staged.extend(p for p in paths if any(p.is_relative_to(folder) for folder in _leftovers(out)))
        return len(staged) < KILL_AT_STAGED_STEP

    status, _ = stages.run(argv, watch, until_a_few_staged_steps)
    assert status == -9, f"the run was not killed in its staging folder (exit {status}); see {stages.log.name}"
    assert not out.exists() and len(_leftovers(out)) == 1
    _assert_the_contract_holds(out, verify, stages.temp)
    renamed = []

    def every_step(event, paths):
        _assert_the_contract_holds(out, verify, stages.temp)
        if event == "os.rename" and paths[-1] == out.resolve():
            (staging,) = _leftovers(out)  # the killed run's is gone
            # The instant of the race: whole, its manifest complete, one rename from its final
            # name; a copy at a final name verifies, the folder itself did not just above.
            probe = out.with_name(out.name + "-probe")
            shutil.copytree(staging, probe)
            verify(probe)
            shutil.rmtree(probe)
            renamed.append(staging)
        return True

    status, steps = stages.run(argv, watch, every_step)
    assert status == 0, f"the run beside the killed one failed (exit {status}); see {stages.log.name}"
    assert renamed, f"none of the {steps} filesystem steps seen was the rename into place"
    verify(out)
    assert _leftovers(out) == [], "the finished run left a staging folder behind"


@pytest.fixture(scope="module")
def gate(fixture_packages, items, tmp_path_factory) -> Path:
    from pipeline.stages.gates import align_package

    out = tmp_path_factory.mktemp("killed") / "gate-chunk_kv"
    align_package(fixture_packages / "chunk_kv", FIXTURE_REFERENCE, out, items=items)
    return out


@pytest.fixture(scope="module")
def items(tmp_path_factory) -> Path:
    from fixtures.make_scoring_set import OUT as CLOZE

    path = tmp_path_factory.mktemp("killed-items") / "items.jsonl"
    path.write_text("".join(CLOZE.read_text().splitlines(keepends=True)[:ITEMS]))
    return path


def _survey_argv(fixture_packages, gate, items, out) -> list:
    return ["survey", fixture_packages / "chunk_kv", "--fp32-gate", gate, "--fixtures", FIXTURE_REFERENCE,
            "--items", items, "-o", out, "--recipes", "int8-b32"]


@pytest.fixture(scope="module")
def survey(stages, fixture_packages, gate, items, tmp_path_factory) -> Path:
    """The survey of a run beside a killed one, each checked at every step; the release's input."""
    from pipeline.stages.survey import load_survey

    def verify(folder):
        load_survey(folder)  # survey.json and every file it records
        verify_chain(folder / "packages" / "int8-b32")

    out = tmp_path_factory.mktemp("killed-survey").resolve() / "survey"
    _assert_killed_runs_leave_nothing_complete(stages, _survey_argv(fixture_packages, gate, items, out), out, verify)
    return out


def test_killed_bundle(stages, tmp_path):
    out = tmp_path.resolve() / "bundle"
    _assert_killed_runs_leave_nothing_complete(stages, ["bundle", FIXTURE_CMF, "-o", out], out)


def test_killed_coreml(stages, fixture_bundle, tmp_path):
    out = tmp_path.resolve() / "coreml"
    argv = ["coreml", fixture_bundle, "-o", out, "--kinds", "stateless"]
    # The output is a folder of packages; each is an artifact with its own chain.
    _assert_killed_runs_leave_nothing_complete(stages, argv, out, lambda folder: verify_chain(folder / "stateless"))


def test_killed_align(stages, fixture_packages, items, tmp_path):
    out = tmp_path.resolve() / "gate"
    argv = ["align", fixture_packages / "stateless", "--fixtures", FIXTURE_REFERENCE, "--items", items, "-o", out]
    _assert_killed_runs_leave_nothing_complete(stages, argv, out)


def test_killed_survey(survey):
    assert sorted(p.name for p in survey.parent.iterdir()) == ["survey"]


def test_killed_release(stages, survey, tmp_path):
    out = tmp_path.resolve() / "dist" / "m-int8-b32"
    _assert_killed_runs_leave_nothing_complete(stages, ["release", survey, "-o", out.parent, "--name", "m"], out)


# --- a full disk -------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs: room for one fixture bundle (3.7 MB), not two."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_fails_clearly_and_keeps_the_old_output(small_disk, monkeypatch):
    import pipeline.stages.bundle as bundle_stage

    out = small_disk / "bundle"
    first = subprocess.run(_cli("bundle", FIXTURE_CMF, "-o", out), cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # The stage's disk check refuses a second bundle before it writes a byte (manifests.disk)...
    again = subprocess.run(_cli("bundle", FIXTURE_CMF, "-o", out, "--force"), cwd=ROOT, env=ENV,
                           capture_output=True, text=True)
    assert again.returncode == 1
    assert again.stderr.startswith(f"NotEnoughDisk: {out}: stage 'bundle' needs "), again.stderr
    assert sorted(os.listdir(small_disk)) == ["bundle"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # ...and a disk that fills anyway (another writer took the room the check saw; here, the
    # check skipped) fails as OutputWriteFailed, the old output kept.
    monkeypatch.setattr(bundle_stage, "check_disk", lambda *args, **kwargs: None)
    with pytest.raises(OutputWriteFailed, match=re.escape(f"{out}: writing the output failed (No space left on device")):
        bundle_stage.export_bundle(FIXTURE_CMF, out, force=True)
    assert sorted(os.listdir(small_disk)) == ["bundle"]  # no staging folder, no lock, no temp file
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    verify_chain(out)


def test_a_disk_that_fills_inside_coremltools_is_named_not_its_library_error(small_disk, fixture_bundle,
                                                                              monkeypatch):
    """Issue 51: coremltools reports a full disk in words of its own ('[MIL FileWriter]: Unknown
    error occurred while writing data to the file', or a missing Manifest.json at its merge).
    Another writer took the room the disk check saw (here, the check skipped): the conversion
    fails as OutputWriteFailed naming the filesystem that filled, with the library's error
    after it, and leaves nothing behind."""
    import coreml.convert as convert

    monkeypatch.setattr(convert, "require_disk", lambda *args, **kwargs: None)
    out = small_disk / "coreml"
    with pytest.raises(OutputWriteFailed, match=re.escape(f"{out}: writing the output failed, the output's "
                                                          f"filesystem, at {small_disk}, filled (")) as failed:
        convert.export_coreml(fixture_bundle, out, kinds=("chunk_kv",))
    assert "when the stage failed with RuntimeError: " in str(failed.value)
    assert os.listdir(small_disk) == []


def test_an_error_on_a_disk_with_room_is_not_called_a_full_disk(tmp_path):
    from manifests.output import staged_output

    with pytest.raises(RuntimeError, match="^a library's own failure$"), staged_output(tmp_path / "out", False):
        raise RuntimeError("a library's own failure")
    assert os.listdir(tmp_path) == []


# --- two runs at once ----------------------------------------------------------------------------


def test_two_runs_writing_one_output_one_wins_and_it_is_never_a_mix(tmp_path):
    other = Path("/work/shared/cmf-conformance/model_masks_tok_a.cmf")
    sources = {str(FIXTURE_CMF.resolve()), str(other.resolve())}
    for round_ in range(3):
        out = tmp_path / f"bundle-{round_}"
        runs = [subprocess.Popen(_cli("bundle", cmf, "-o", out), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for cmf in (FIXTURE_CMF, other)]
        results = [(run.wait(timeout=300), run.stderr.read()) for run in runs]
        codes = sorted(code for code, _ in results)
        assert codes == [0, 1], results
        (loser,) = [err for code, err in results if code == 1]
        assert loser.startswith(("OutputBusy: ", "OutputExists: ")) and str(out) in loser, loser
        links = verify_chain(out)  # one run's bundle, whole: its files, config and header match its CMF
        assert links[-1].path in sources and links[-1].result == "verified"
        assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # nothing staged or locked left
