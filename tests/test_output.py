"""manifests.output: staged folders and files appear whole or not at all, never overwrite unasked."""

import os
import stat

import pytest

from manifests.output import refuse_existing, staged_file, staged_output, unfinished_output
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


def test_a_staging_folder_is_never_an_output_but_to_its_own_run(tmp_path):
    from manifests.identity import MANIFEST_NAME, load_manifest, write_json
    from pipeline.ground.errors import IdentityError

    out = tmp_path / "out"
    manifest = {"format": "cmfdeploy.scores/1", "status": "complete"}
    with staged_output(out, force=False) as staging:
        assert unfinished_output(staging) is None  # the run writing it may check it
    assert unfinished_output(tmp_path / f".out.{'0' * 12}.old") == out.resolve()  # set aside: refused alike
    dead = tmp_path / f".out.{'0' * 12}.partial"  # whole, one rename short: a kill's leftover
    dead.mkdir()
    write_json(dead / MANIFEST_NAME, manifest)
    with pytest.raises(IdentityError, match=r"\.out\.0{12}\.partial: the staging \(or set-aside\) folder of .*out, "
                                            "left by a run that did not finish"):
        load_manifest(dead)
    assert unfinished_output(out) is None and unfinished_output(tmp_path / ".out.lock") is None


def test_the_next_run_clears_what_killed_runs_left(tmp_path):
    out, other = tmp_path / "out", tmp_path / "out.b"
    for name in (f".out.{'1' * 12}.partial", f".out.b.{'2' * 12}.partial"):
        (tmp_path / name).mkdir()
    aside = tmp_path / f".out.{'3' * 12}.old"  # a forced run killed between its two renames
    aside.mkdir()
    (aside / "f").write_text("old")
    with pytest.raises(OutputExists), staged_output(out, force=False):
        pytest.fail("the old output was not put back")
    assert (out / "f").read_text() == "old"
    # Another output's staging folder, however alike its name, is not this one's to clear.
    assert sorted(os.listdir(tmp_path)) == [f".out.b.{'2' * 12}.partial", "out"]
    (tmp_path / f".out.{'4' * 12}.old").mkdir()  # killed after its rename: the old one is garbage
    with staged_output(out, force=True) as staging:
        (staging / "f").write_text("new")
    assert (out / "f").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == [f".out.b.{'2' * 12}.partial", "out"]
    assert not other.exists()


def test_a_staged_file_makes_a_missing_parent_folder(tmp_path):
    """`import-gguf -o new/model.cmf` once failed with an untyped FileNotFoundError."""
    path = tmp_path / "new" / "deeper" / "model.bin"
    with staged_file(path) as file:
        file.write(b"payload")
    assert path.read_bytes() == b"payload" and [p.name for p in path.parent.iterdir()] == ["model.bin"]
