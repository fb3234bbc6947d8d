"""The context a build takes when none is asked (issue 50): the model's own limit or 2048,
whichever is smaller, in every stage that takes one, and make passes none unless CONTEXT is set."""

import dataclasses
import json
import subprocess
import sys

from conftest import FIXTURE_CMF, ROOT

from pipeline.ground.models.args import DEPLOYED_CONTEXT
from pipeline.ground.reference import load_reference
from pipeline.stages.gates import make_reference_fixtures


def test_the_deployed_context_is_the_smaller_of_2048_and_the_models_limit():
    _, args, _ = load_reference(FIXTURE_CMF)
    assert DEPLOYED_CONTEXT == 2048 and args.deployed_context == args.max_position_embeddings == 128
    assert dataclasses.replace(args, max_position_embeddings=8192).deployed_context == 2048


def test_reference_fixtures_without_a_context_cover_the_deployed_one(tmp_path):
    lines = (ROOT / "fixtures" / "botchan.txt").read_text(encoding="utf-8").splitlines()
    out = make_reference_fixtures(FIXTURE_CMF, tmp_path / "reference", lines)
    assert json.loads((out / "index.json").read_text())["cases"]["long"]["tokens"] == 128


def _planned(*variables: str) -> str:
    return subprocess.run(["make", "-C", str(ROOT), "-n", "--no-print-directory", "-B", "coreml",
                           f"MODEL={FIXTURE_CMF}", f"PYTHON={sys.executable}", *variables],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True).stdout


def test_make_passes_a_context_only_where_one_is_asked():
    assert "--context" not in _planned()
    assert "--context 512" in _planned("CONTEXT=512")
