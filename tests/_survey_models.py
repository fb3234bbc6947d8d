"""The default fixture's compression survey, built once per test session and shared read-only.

test_survey and test_release both need it and a survey costs a compression, a gate and a
scoring run per recipe, so it is built on first use under pytest's session temp folder:
the FP32 chunk-KV package's gate, an 8-item slice of the cloze set, and a survey of
int8-b32, int4-b32, palette4-gc32, `mixed` with a bits-per-weight budget below its
smallest choice (its precondition fails, which the survey must report), and
gptq-int4-b32-zp-hot (its head summed from two products, gated through every part).
"""

import functools
from dataclasses import dataclass
from pathlib import Path

from conftest import FIXTURE_REFERENCE

from pipeline.stages.survey import run_survey
from fixtures.make_scoring_set import OUT as CLOZE
from pipeline.stages.gates import align_package

SURVEY_RECIPES = ("int8-b32", "int4-b32", "palette4-gc32", "mixed", "gptq-int4-b32-zp-hot")
# Surveyed again by worker processes: one recipe within budget on the fixture (its items scored), one over.
WORKER_RECIPES = ("int8-b32", "int4-b32")
SCORING_ITEMS = 8
# The compressed default with an items limit every package meets: the default sets none, so no
# gate would score the scoring set (test_align_stateful: not measured, and why), which these
# surveys are to show scored, ranked and chained for a package within budget on the text.
SURVEY_BUDGET = "ppl=2%,top1=0.95,items=1"
# Below what the smallest mixed choice (int4 everywhere, 5 bits per weight) needs.
IMPOSSIBLE_MIXED_BPW = 1.0


@dataclass(frozen=True)
class Survey:
    package: Path  # the FP32 chunk-KV package (shared, do not modify)
    fp32_gate: Path
    items: Path
    path: Path  # the survey folder
    record: dict  # what run_survey returned


def cloze_slice(path: Path, count: int = SCORING_ITEMS) -> Path:
    """The first `count` cloze items written to `path`: a scoring set small enough for CI."""
    path.write_text("".join(CLOZE.read_text().splitlines(keepends=True)[:count]))
    return path


@functools.cache
def built_survey(packages_dir: Path, root: Path) -> Survey:
    root = root / "survey-session"
    root.mkdir()
    package = packages_dir / "chunk_kv"
    items = cloze_slice(root / "items.jsonl")
    align_package(package, FIXTURE_REFERENCE, root / "gate-fp32", items=items)
    record = run_survey(package, root / "gate-fp32", FIXTURE_REFERENCE, items, root / "survey",
                        recipes=SURVEY_RECIPES, mixed_bpw=IMPOSSIBLE_MIXED_BPW, progress=False, budget=SURVEY_BUDGET)
    return Survey(package, root / "gate-fp32", items, root / "survey", record)


@functools.cache
def survey_in_workers(survey: Path, package: Path, fp32_gate: Path, items: Path) -> tuple[Path, dict]:
    """The session survey's gate, items and FP32 scores, surveyed for WORKER_RECIPES by two local
    worker processes (jobs=2): the folder and its record, which the Ray executor's survey is
    compared with too."""
    out = survey.parent / "survey-2-workers"
    record = run_survey(package, fp32_gate, FIXTURE_REFERENCE, items, out, recipes=WORKER_RECIPES, jobs=2,
                        progress=False, fp32_scores=survey / "scores" / "fp32", budget=SURVEY_BUDGET)
    return out, record


@functools.cache
def failed_gate(survey_dir: Path) -> Path:
    """A real failed gate: the survey's int4 package under a budget of top-1 agreement 1.0,
    which only a package computing FP32 itself can meet."""
    out = survey_dir.parent / "gate-int4-under-an-fp32-budget"
    if not align_package(survey_dir / "packages" / "int4-b32", FIXTURE_REFERENCE, out, budget="ppl=0%,top1=1.0",
                         items=survey_dir.parent / "items.jsonl").passed:
        return out
    raise AssertionError("int4-b32 met an FP32 budget: its weights were not compressed")


def greedy_of_release_and_survey(release, surveyed_package: Path, tokens: int = 8) -> tuple[list, list]:
    """`generate`'s greedy continuation of one prompt on a release (what it ships) and on the
    surveyed package its recipe came from."""
    import numpy as np

    from pipeline.ground.generation import generate
    from pipeline.stages.backends import open_backend

    prompt = np.array([1, 45, 120, 7, 300], dtype=np.int64)
    return tuple(list(generate(open_backend(artifact), prompt, max_tokens=tokens))
                 for artifact in (release.path, surveyed_package))

