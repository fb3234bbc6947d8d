"""The suite's caches of real-model imports never touch what `make all` writes.

`make test` once deleted a user's finished `make all` build: the suite cached its imports under
build/smollm2/<key>/ and build/gemma3/<key>/ and pruned every other entry there, and a model named
smollm2 builds into build/smollm2/.
"""

import os

import pytest

from conftest import ROOT, TEST_CACHE, _drop_stale_keys


def test_the_test_cache_is_outside_every_make_build():
    assert ROOT / "build" not in TEST_CACHE.parents and TEST_CACHE != ROOT / "build"
    assert "/.test-cache/" in (ROOT / ".gitignore").read_text().split()


def test_pruning_stale_keys_leaves_a_finished_build_whole(tmp_path):
    """A cache's pruning removes its own stale keys and nothing beside its folder; a cache
    folder outside TEST_CACHE is refused before anything is removed."""
    build = tmp_path / "build" / "smollm2"  # what `make all MODEL=smollm2.cmf` leaves
    for stage in ("bundle", "coreml", "align", "survey"):
        (build / stage).mkdir(parents=True)
        (build / stage / "manifest.json").write_text('{"status": "complete"}')
    with pytest.raises(ValueError, match="must lie under"):
        _drop_stale_keys(build, build / "key")
    assert sorted(p.name for p in build.iterdir()) == ["align", "bundle", "coreml", "survey"]

    cache = TEST_CACHE / f"prune-check-{os.getpid()}"
    try:
        for key in ("old-1", "old-2", "current"):
            (cache / key).mkdir(parents=True)
            (cache / key / "model.cmf").write_bytes(b"x")
        (cache / ".lock").write_text("")
        _drop_stale_keys(cache, cache / "current")
        assert sorted(p.name for p in cache.iterdir()) == [".lock", "current"]
    finally:
        import shutil

        shutil.rmtree(cache, ignore_errors=True)
    assert all((build / s / "manifest.json").read_text() for s in ("bundle", "coreml", "align", "survey"))
