"""`make all release` as a user runs it, and every folder it writes verified afterwards.

The Makefile's stamps once sat inside the folders they stood for (`survey/release.done`), so
`verify-artifact` of a survey after `make release` failed on a file its manifest does not list.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURE_CMF, ROOT
from pipeline.cli import main

pytestmark = pytest.mark.slow


def _verified_folders(*roots: Path) -> list[Path]:
    """Every folder under `roots` with a manifest of its own (a package's .mlpackage is its
    folder's content, not a folder of its own)."""
    return sorted({path.parent for root in roots for path in root.rglob("manifest.json")
                   if not any(part.endswith(".mlpackage") for part in path.parts)})


def test_every_folder_make_all_release_writes_verifies(tmp_path, capsys):
    name = f"make-all-check-{os.getpid()}"
    model = tmp_path / f"{name}.cmf"
    shutil.copyfile(FIXTURE_CMF, model)
    out, dist = ROOT / "build" / name, ROOT / "dist"
    try:
        # Two recipes keep the survey short; every stage and stamp is the default run's (TARGET=ane).
        made = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "all", "release", f"MODEL={model}",
                               "RECIPES=int8-pc palette6-gc32", f"PYTHON={sys.executable}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
        assert made.returncode == 0, made.stdout[-4000:]
        released = sorted(dist.glob(f"{name}-*"))
        assert len(released) == 2 and released[1].name == f"{released[0].name}-app", released
        folders = _verified_folders(out, *released)
        assert set(released) <= set(folders)
        kinds = {path.relative_to(out).as_posix() for path in folders if out in path.parents}
        assert {"bundle", "preflight", "coreml-fp16/stateless", "coreml-fp16/chunk_kv", "coreml-fp16/stateful",
                "align-fp16/stateless", "align-fp16/chunk_kv", "align-fp16/stateful", "survey-ane",
                "survey-ane-deployed", "scores/fp32-reference"} <= kinds
        for folder in folders:
            assert main(["verify-artifact", str(folder)]) == 0, (folder, capsys.readouterr().err)
        # The survey is made again when its recipes change, and only then (`make compress
        # RECIPES=...` once ran nothing, its inputs' files being unchanged).
        for recipes, again in (("int8-pc palette6-gc32", False), ("int8-pc", True), ("int8-pc", False)):
            remade = subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "compress", f"MODEL={model}",
                                     f"RECIPES={recipes}", f"PYTHON={sys.executable}"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
            assert remade.returncode == 0, remade.stdout[-4000:]
            assert ("pipeline.cli survey" in remade.stdout) == again, (recipes, remade.stdout[-4000:])
        assert [r["name"] for r in json.loads((out / "survey-ane" / "survey.json").read_text())["recipes"]] == ["int8-pc"]
        stamps = [path for path in out.rglob("*") if path.suffix in (".passed", ".released", ".done", ".settings")]
        assert stamps and not any((parent / "manifest.json").exists() for stamp in stamps for parent in stamp.parents
                                  if out in parent.parents or parent == out), stamps
    finally:
        shutil.rmtree(out, ignore_errors=True)
        for path in dist.glob(f"{name}-*"):
            shutil.rmtree(path, ignore_errors=True)
