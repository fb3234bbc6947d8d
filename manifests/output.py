"""Atomic stage outputs: a folder or file appears complete, all at once, or not at all.

    refuse_existing(out_dir, force)          # before the expensive work, to fail early
    with staged_output(out_dir, force) as staging:
        ...                                  # write everything into `staging`
    # here `out_dir` holds exactly what was written

Staging happens in a hidden sibling (the same filesystem, so the final rename is atomic)
created with a normal folder's or file's mode (the umask's, not tempfile's 0700/0600: an
artifact is meant to be read by others). Everything staged is fsynced before the rename
and the parent after it, so a crash cannot leave the final name pointing at empty files.
An existing output is refused with OutputExists unless `force`; with `force` it is moved
aside first and removed only once the new one is in place (and put back if that rename
fails), so the final name never holds a half-written output.

The rename is the one commit point, for a run killed at any instant: a folder is an output
only at its final name. A staging folder may already hold every file and a complete manifest
(a kill just before the rename), so `unfinished_output` names staging and set-aside folders
by their names, and `manifests.identity.load_manifest` refuses them to every reader but the
run writing them. The next run of the same output, once it holds the lock, removes what
killed runs staged and puts back an old output that a killed `force` run had set aside.

Two runs writing the same output at once: `staged_output` holds an exclusive lock on a
hidden `.<name>.lock` beside the output from the first staged byte to the rename, and a
second run that finds it held fails at once with OutputBusy (the first one wins; the output
is only ever one run's). The lock is an flock, so a killed run never leaves it held. A write
that fails (a full disk, a quota) raises OutputWriteFailed naming the output; so does any error of
a stage that leaves the output's or the temp folder's disk full (`filled_disk`), naming that disk,
whatever words the library that filled it used. The staging folder is removed and an old output
is left as it was.
"""

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from pipeline.ground.errors import OutputBusy, OutputExists, OutputWriteFailed


def refuse_existing(path: str | os.PathLike, force: bool) -> None:
    path = Path(path)
    if (path.exists() or path.is_symlink()) and not force:
        raise OutputExists(f"{path}: already exists; pass force=True (--force) to replace it")


def _sibling(path: Path, tag: str) -> Path:
    """An unused hidden name beside `path` (random, so concurrent stages never collide)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.{tag}")


# `_sibling` names of a folder being staged, or of an old output set aside by a forced run.
_UNFINISHED = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{12}\.(?:partial|old)")
# The staging folders this process is writing now: only their own run may read them.
_WRITING: set[Path] = set()


def unfinished_output(path: str | os.PathLike) -> Path | None:
    """The final path of the output that the folder at `path` is staged (or set aside) for,
    unless this process is writing it now; None for any other folder."""
    path = Path(path).resolve()
    match = _UNFINISHED.fullmatch(path.name)
    if match is None or path in _WRITING:
        return None
    return path.with_name(match["name"])


def _leftovers(out_dir: Path, tag: str) -> list[Path]:
    final = out_dir.resolve()
    return sorted(p for p in out_dir.parent.iterdir() if p.name.endswith(f".{tag}") and unfinished_output(p) == final)


def _clear_leftovers(out_dir: Path) -> None:
    """What killed runs of `out_dir` left: only a run holding its lock stages it, so every
    staging folder found by the holder is a dead run's. A set-aside old output is put back
    when the kill came before the new one's rename, and removed when it came after."""
    for staging in _leftovers(out_dir, "partial"):
        # Best effort: what a dead run's orphaned worker still writes there is refused by its
        # name all the same, and cleared by a later run.
        shutil.rmtree(staging, ignore_errors=True)
    for aside in _leftovers(out_dir, "old"):
        if out_dir.exists() or out_dir.is_symlink():
            _remove(aside)
        else:
            os.rename(aside, out_dir)


def temp_file_beside(path: Path, tag: str = "tmp") -> BinaryIO:
    """A new hidden file beside `path`, opened read/write, with a normal file's mode. A missing
    parent folder is made, as `staged_output` makes one (`import-gguf -o new/model.cmf`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(_sibling(path, tag), "x+b")  # noqa: SIM115 - the caller owns and closes it


@contextlib.contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a temporary file beside `path`; on success fsync it and rename it onto `path`.

    Replaces unconditionally: callers that must not overwrite call `refuse_existing` first.
    """
    path = Path(path)
    file = temp_file_beside(path)
    try:
        with file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(file.name, path)
    except BaseException:
        Path(file.name).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def output_lock(out_dir: Path) -> Iterator[None]:
    """Hold the exclusive lock of `out_dir`, or raise OutputBusy when another run holds it."""
    lock_path = out_dir.with_name(f".{out_dir.name}.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # A holder unlinks the file as it lets go: a lock won on that unlinked file
            # guards nothing, so it must still be the file at the path.
            held = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
        except (BlockingIOError, FileNotFoundError):
            held = False
        if not held:
            raise OutputBusy(f"{out_dir}: another run is writing it now (lock {lock_path}); "
                             "wait for it to finish, or write elsewhere")
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)
    finally:
        os.close(fd)


@contextlib.contextmanager
def staged_output(out_dir: str | os.PathLike, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling folder of `out_dir`; on success move it into place."""
    out_dir = Path(out_dir)
    refuse_existing(out_dir, force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(out_dir):
        _clear_leftovers(out_dir)
        refuse_existing(out_dir, force)  # again: an output put back by `_clear_leftovers` is one
        staging = _sibling(out_dir, "partial")
        staging.mkdir()
        live = staging.resolve()
        _WRITING.add(live)
        try:
            yield staging
            _fsync_tree(staging)
            _move_into_place(staging, out_dir, force)
        except OSError as error:
            full = filled_disk(staging)
            shutil.rmtree(staging, ignore_errors=True)
            if error.errno not in NO_SPACE:
                raise
            raise OutputWriteFailed(f"{out_dir}: writing the output failed ({error.strerror}: {error.filename})"
                                    + (f"; {full}" if full else "") + "; nothing was replaced") from error
        except Exception as error:
            # A library that writes files itself (coremltools' MIL FileWriter, its package saver)
            # reports a full disk in words of its own, or as a missing file a later step looks
            # for: the disk it filled is named here, while what was staged still holds it.
            full = filled_disk(staging)
            shutil.rmtree(staging, ignore_errors=True)
            if full is None:
                raise
            raise OutputWriteFailed(f"{out_dir}: writing the output failed, {full}, when the stage failed with "
                                    f"{type(error).__name__}: {error}; nothing was replaced. Free space there, "
                                    "or write elsewhere (-o, TMPDIR)") from error
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            _WRITING.discard(live)


# A write that fails for want of room leaves its filesystem with at most a few blocks free: the
# kernel writes what fits before it refuses the rest, and a library's buffered writer flushes the
# same way. Less than this free where a stage failed is a full disk, not a coincidence.
FULL_DISK_BYTES = 1 << 20


def filled_disk(staging: Path) -> str | None:
    """Which disk a failed stage found full, in words (the filesystem, its free bytes, what the
    staging folder held), or None: the output's filesystem, where the stage stages and coremltools
    works (`coreml.manifest.working_files_in`), and the temp folder's, where gates keep scratch."""
    staged = sum(f.stat().st_size for f in staging.rglob("*") if f.is_file() and not f.is_symlink()) \
        if staging.exists() else 0
    for folder, what in ((staging if staging.exists() else staging.parent, "the output's"),
                         (Path(tempfile.gettempdir()), "the temp folder's (TMPDIR)")):
        free = shutil.disk_usage(folder).free
        if free < FULL_DISK_BYTES:
            return (f"{what} filesystem, at {_mount_point(folder)}, filled ({free} B free; the staging folder held "
                    f"{staged} B)")
    return None


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path):
        path = path.parent
    return path


NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    # Files before the folders that list them, so every entry is durable before its name.
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(folder, name))
        _fsync(Path(folder))


def _move_into_place(staging: Path, out_dir: Path, force: bool) -> None:
    # Checked again: another process may have created `out_dir` while this one worked.
    refuse_existing(out_dir, force)
    aside = None
    if out_dir.exists() or out_dir.is_symlink():
        aside = _sibling(out_dir, "old")
        os.rename(out_dir, aside)
    try:
        os.rename(staging, out_dir)
    except BaseException:
        if aside is not None:
            os.rename(aside, out_dir)
        raise
    _fsync(out_dir.parent)
    if aside is not None:
        _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
