"""Stages killed, starved of disk, or run twice at once never leave a complete-looking output.

Each stage runs as `cmfdeploy <stage>` in a child process, SIGKILLed at staggered delays
after its staging folder appears; then nothing at the output name claims to be complete
(the name is absent, or it holds a finished output that verifies; no staging folder
verifies as an artifact), and a plain re-run
succeeds beside whatever the kills left. A full tmpfs makes a forced rerun fail with a
clear error that leaves the old output as it was. Two runs writing one output: one wins,
the other fails saying why, and the output is one run's, never a mix.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURE_CMF, FIXTURE_REFERENCE, ROOT

from manifests.chain import verify_artifact, verify_chain
from pipeline.ground.errors import CmfdeployError

# Seconds after the staging folder appears: at once, early in the work, later in it.
KILL_DELAYS = (0.0, 0.4, 1.5)
ITEMS = 4
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *map(str, args)]


def _staging(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.*.partial"))


def _looks_complete(folder: Path) -> bool:
    try:
        verify_artifact(folder)
    except CmfdeployError:
        return False
    return True


def _kill_after(command: list[str], out: Path, delay: float) -> str:
    """Run `command`, SIGKILL it `delay` s after its staging folder appears; what happened."""
    before = set(_staging(out))
    child = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while child.poll() is None and not set(_staging(out)) - before and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(delay)
    finished = child.poll() is not None
    child.send_signal(signal.SIGKILL)
    child.wait()
    return "finished" if finished else "killed"


def _assert_killed_runs_leave_nothing_complete(command: list[str], out: Path, verify=verify_chain) -> None:
    """`verify(out)` checks a finished output (an artifact's chain by default)."""
    outcomes = []
    for delay in KILL_DELAYS:
        outcomes.append(_kill_after(command, out, delay))
        for partial in _staging(out):
            assert not _looks_complete(partial), f"{partial} verifies as a complete output"
        if out.exists():  # the run got to its rename before the kill: a whole, verified output
            verify(out)
            shutil.rmtree(out)
    assert "killed" in outcomes, f"no kill landed while the stage was working: {outcomes}"
    assert _staging(out), "the killed runs left no staging folder: the kills landed outside the work"
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    verify(out)


@pytest.fixture(scope="module")
def gate(fixture_packages, tmp_path_factory) -> Path:
    from pipeline.stages.align import align_package

    out = tmp_path_factory.mktemp("killed") / "gate-chunk_kv"
    align_package(fixture_packages / "chunk_kv", FIXTURE_REFERENCE, out)
    return out


@pytest.fixture(scope="module")
def items(tmp_path_factory) -> Path:
    from fixtures.make_scoring_set import OUT as CLOZE

    path = tmp_path_factory.mktemp("killed-items") / "items.jsonl"
    path.write_text("".join(CLOZE.read_text().splitlines(keepends=True)[:ITEMS]))
    return path


def _survey_command(fixture_packages, gate, items, out) -> list[str]:
    return _cli("survey", fixture_packages / "chunk_kv", "--fp32-gate", gate, "--fixtures", FIXTURE_REFERENCE,
                "--items", items, "-o", out, "--recipes", "int8-b32")


@pytest.fixture(scope="module")
def survey(fixture_packages, gate, items, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("killed-survey") / "survey"
    subprocess.run(_survey_command(fixture_packages, gate, items, out), cwd=ROOT, env=ENV, check=True,
                   capture_output=True, timeout=600)
    return out


def test_killed_bundle(tmp_path):
    out = tmp_path / "bundle"
    _assert_killed_runs_leave_nothing_complete(_cli("bundle", FIXTURE_CMF, "-o", out), out)


def test_killed_coreml(fixture_bundle, tmp_path):
    out = tmp_path / "coreml"
    command = _cli("coreml", fixture_bundle, "-o", out, "--kinds", "stateless")
    # The output is a folder of packages; each is an artifact with its own chain.
    _assert_killed_runs_leave_nothing_complete(command, out, lambda folder: verify_chain(folder / "stateless"))


def test_killed_align(fixture_packages, tmp_path):
    out = tmp_path / "gate"
    command = _cli("align", fixture_packages / "stateless", "--fixtures", FIXTURE_REFERENCE, "-o", out)
    _assert_killed_runs_leave_nothing_complete(command, out)


def test_killed_survey(fixture_packages, gate, items, tmp_path):
    from pipeline.stages.survey import load_survey

    def verify(folder):
        load_survey(folder)  # survey.json and every file it records
        verify_chain(folder / "packages" / "int8-b32")

    out = tmp_path / "survey"
    _assert_killed_runs_leave_nothing_complete(_survey_command(fixture_packages, gate, items, out), out, verify)


def test_killed_release(survey, tmp_path):
    out = tmp_path / "dist" / "m-int8-b32"
    _assert_killed_runs_leave_nothing_complete(_cli("release", survey, "-o", out.parent, "--name", "m"), out)


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


def test_a_full_disk_fails_clearly_and_keeps_the_old_output(small_disk):
    out = small_disk / "bundle"
    first = subprocess.run(_cli("bundle", FIXTURE_CMF, "-o", out), cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    again = subprocess.run(_cli("bundle", FIXTURE_CMF, "-o", out, "--force"), cwd=ROOT, env=ENV,
                           capture_output=True, text=True)
    assert again.returncode == 1
    assert again.stderr.startswith(f"OutputWriteFailed: {out}: writing the output failed (No space left on device"), \
        again.stderr
    assert sorted(os.listdir(small_disk)) == ["bundle"]  # no staging folder, no lock, no temp file
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    verify_chain(out)


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
