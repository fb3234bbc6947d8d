"""manifests.output: staged folders and files appear whole or not at all, never overwrite unasked."""

import os
import stat

import pytest

from manifests.output import refuse_existing, staged_file, staged_output
from pipeline.ground.errors import OutputBusy, OutputExists


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_staged_output_appears_whole_with_normal_modes(tmp_path):
    out = tmp_path / "nested" / "out"
    with staged_output(out, force=False) as staging:
        assert staging.parent == out.parent and not out.exists()
        (staging / "a.txt").write_text("a")
    assert (out / "a.txt").read_text() == "a"
    assert os.listdir(out.parent) == ["out"]  # no staging or aside folder left behind
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~_umask()


def test_existing_output_is_refused_without_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(OutputExists, match=str(out)):
        refuse_existing(out, force=False)
    with pytest.raises(OutputExists), staged_output(out, force=False):
        pass
    assert (out / "old").read_text() == "old" and os.listdir(tmp_path) == ["out"]


def test_output_created_meanwhile_is_refused_at_the_rename(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputExists), staged_output(out, force=False) as staging:
        (staging / "new").write_text("new")
        out.mkdir()  # another process finished first
    assert os.listdir(out) == [] and os.listdir(tmp_path) == ["out"]


def test_force_replaces_and_a_failure_keeps_the_old_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(RuntimeError), staged_output(out, force=True) as staging:
        (staging / "new").write_text("new")
        raise RuntimeError("stage failed")
    assert os.listdir(out) == ["old"] and os.listdir(tmp_path) == ["out"]
    with staged_output(out, force=True) as staging:
        (staging / "new").write_text("new")
    assert os.listdir(out) == ["new"] and os.listdir(tmp_path) == ["out"]


def test_staged_file_replaces_atomically_with_a_normal_mode(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError), staged_file(path) as f:
        f.write(b"partial")
        raise RuntimeError("writer failed")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]
    with staged_file(path) as f:
        f.write(b"new")
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["f.bin"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()


def test_a_second_writer_of_the_same_output_fails_at_once_and_the_first_wins(tmp_path):
    out = tmp_path / "out"
    with staged_output(out, force=False) as first:
        (first / "who").write_text("first")
        with pytest.raises(OutputBusy, match=r"another run is writing it now \(lock .*\.out\.lock\)"):
            with staged_output(out, force=True):
                pytest.fail("the second writer got in")
    assert (out / "who").read_text() == "first"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no staging folder, no lock file left
    with staged_output(out, force=True) as second:  # once the first is done, a forced run replaces it
        (second / "who").write_text("second")
    assert (out / "who").read_text() == "second"


def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path):
    out = tmp_path / "out"
    (tmp_path / ".out.lock").write_text("")  # the file a killed holder leaves (flock dies with it)
    with staged_output(out, force=False) as staging:
        (staging / "f").write_text("x")
    assert (out / "f").read_text() == "x"
