"""The gate over any backend (`gate_backend`), and the stage over a Core ML package (`align_package`).

A gate speaks only the Backend protocol (`pipeline.ground.backend_protocol`), so an MLX
artifact is gated by the same code. No bound here is set from a measurement of the artifact
it gates.
"""

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from manifests.identity import portable_name, sha256_file
from pipeline.ground.workers import return_freed_memory
from pipeline.stages.gates.budget import COMPRESSED_BUDGET, Budget, parse_budget
from pipeline.stages.gates.exactness import (
    ALL_PATTERNS,
    COMPRESSED_PATTERNS,
    Tolerance,
    exact_tolerances,
    exactness_chunks,
    exactness_one_shot,
    noise_tolerances,
)
from pipeline.stages.gates.fixtures import ReferenceFixtures
from pipeline.stages.gates.invariants import GateRun, PatternsEqualOneShot, run_invariants
from pipeline.stages.gates.lineage import resolve_lineage
from pipeline.stages.gates.quality import QualityInputs, measure_quality, quality_identity, reuse_quality
from pipeline.stages.gates.references import intended_numerics, intended_references
from pipeline.stages.gates.report import FORMAT, REPORT_NAME, GateFailed, failure, markdown, samples_plot, summarize

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_QUALITY_TEXT = ROOT / "fixtures" / "botchan.txt"
DEFAULT_ITEMS = ROOT / "fixtures" / "scoring" / "cloze.jsonl"


class _Clock:
    """Wall seconds per step of a gate, recorded in its report and shown on its page
    (benchmarks/pipeline_bench.py reads them): loading (lineage, the package opened, the
    references built), then each part (`gate_backend`), then FP32's scores of the scoring set
    where an FP32 gate scores them for the others (`align_package`'s `scores_out`)."""

    def __init__(self):
        self.laps, self._last = {}, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 3)
        self._last = now


@dataclass(frozen=True)
class Unopened:
    """A candidate the gate opens only where parts 1 and 3 run (`gate_backend`): a package over
    budget is never opened, and opening a compressed one decodes its weights (37 s for one of
    Gemma 3's). `name` is the backend it will be, as the report names it."""
    name: str
    open: Callable[[], object]


def gate_backend(candidate, intended, fixtures: ReferenceFixtures, quality: QualityInputs, budget: Budget, *,
                 frozen: bool, patterns=ALL_PATTERNS, check: str = "chunked", all_figures: bool = False,
                 reused_quality: dict | None = None) -> dict:
    """All three parts on `candidate` (any Backend, or one `Unopened`; its `chunks`, where it has
    them, for the chunk patterns and the snapshot checks) against `intended` (a TorchBackend of
    the numerics it intends): quality first, then exactness and the invariants where the
    package is within budget or `all_figures` asks. `frozen`: the fixtures' logits are the
    intended one-shot logits (FP32 weights). Returns the report body and, under "_scores", the
    item scores of the quality part (None where they were not measured; `measure_quality`).
    `reused_quality`: the quality record, taken from a gate of the same intended numerics
    (`reuse_quality`), not measured again."""
    samples, clock = {}, _Clock()
    tolerance, cache_tolerance = exact_tolerances(intended.model, intended.context, intended.hot_rows_head_norm)
    candidate_name = candidate.name
    # Quality first: it is measured on the intended numerics, not on the package, so a package
    # over budget fails whatever parts 1 and 3 say. Those then run only where asked
    # (`all_figures`): they cost most of a compressed gate (on Gemma 3, 250-360 s of chunk
    # patterns against 100-200 s of quality), and a survey's low-bit recipes are mostly over.
    quality_record, scores = (reused_quality, None) if reused_quality is not None else \
        measure_quality(intended, quality, budget, all_figures)
    clock.lap("quality")
    records, invariants, not_measured = [], [], None
    if quality_record["within_budget"] or all_figures:
        if isinstance(candidate, Unopened):
            candidate = candidate.open()
            clock.lap("open_package")
        tolerance, cache_tolerance = noise_tolerances((tolerance, cache_tolerance), intended, fixtures)
        clock.lap("rounding_noise")
        records, invariants = _exactness_and_invariants(candidate, intended, fixtures, samples, clock, tolerance,
                                                        cache_tolerance, frozen=frozen, patterns=patterns, check=check)
        exact = all(r["passed"] for r in records)
        invariants_passed = all(i["passed"] is not False for i in invariants)
    else:
        exact = invariants_passed = None
        not_measured = (f"over the budget on {', '.join(quality_record['over_budget'])} already, so neither "
                        "exactness nor the invariants can change the verdict (--all-figures measures them)")
    return {
        "passed": bool(exact and quality_record["within_budget"] and invariants_passed),
        "numerics": intended.numerics,
        "candidate_backend": candidate_name,
        "exactness": {"passed": exact, "reference": intended.name,
                      "patterns": (list(patterns) if getattr(candidate, "chunks", None) is not None else ["one_shot"])
                      if records else [],
                      **({"not_measured": not_measured} if not_measured else {})},
        "quality": quality_record,
        "tolerance": asdict(tolerance),
        "cache_tolerance": asdict(cache_tolerance),
        "summary": {**summarize(records), "exact": exact, "within_budget": quality_record["within_budget"],
                    "invariants_passed": invariants_passed},
        "records": records,
        "invariants": invariants,
        "seconds": clock.laps,
        "_samples": samples,
        "_scores": scores,
    }


def _exactness_and_invariants(candidate, intended, fixtures: ReferenceFixtures, samples: dict, clock: _Clock,
                              tolerance: Tolerance, cache_tolerance: Tolerance, *, frozen: bool, patterns,
                              check: str) -> tuple[list, list]:
    """Parts 1 and 3: every chunk pattern (a backend with `chunks`) or one shot, then the
    invariants over those runs; their records."""
    chunks = getattr(candidate, "chunks", None)
    fp16_cache = intended.cache_dtype == np.float16
    records, runs = [], None
    if chunks is not None:
        records, runs = exactness_chunks(
            chunks, intended, fixtures, patterns, samples, check, (tolerance, cache_tolerance),
            lambda one_shot_run, run, case: PatternsEqualOneShot.reduce(one_shot_run, run, tolerance.for_case(case),
                                                                        fp16_cache))
        one_shot = {name: runs[name, "one_shot"]["got"] for name in fixtures.cases}
        clock.lap("chunk_patterns")
    else:
        one_shot = {name: candidate.logits(case.input_ids) for name, case in fixtures.cases.items()}
    # FP32 weights: the same one-shot logits against the frozen fixtures as well.
    if frozen or chunks is None:
        records = exactness_one_shot(one_shot, intended, fixtures, frozen, samples, tolerance) + records
    clock.lap("one_shot")
    invariants = run_invariants(GateRun(candidate, fixtures, one_shot, runs, tolerance, fp16_cache, intended.args,
                                         intended.model.named_weights()))
    del one_shot, runs  # the cases' logits, both sides (2 GB for Gemma 3's long case)
    return_freed_memory()
    clock.lap("branching")
    return records, invariants


def default_budget(manifest: dict, compressed: bool | None = None) -> str:
    """The quality budget a package is held to when the user declares none: a compressed
    package's is `COMPRESSED_BUDGET`, an uncompressed one's its precision's. `compressed`
    None: as the manifest's recipe says (a survey asks for its recipes before they exist)."""
    from coreml.precisions import package_precision

    if compressed is None:
        compressed = "recipe" in manifest
    return COMPRESSED_BUDGET if compressed else package_precision(manifest["package"]).default_budget


@dataclass(frozen=True)
class GateResult:
    """A gate that ran, passed or not: its report (as written to `out_dir`) and the item scores
    of its quality part (what `scores_out` received; None where none were written)."""
    package_dir: Path
    out_dir: Path
    report: dict
    scores: list | None

    @property
    def passed(self) -> bool:
        return self.report["passed"]

    def failure(self) -> str:
        """The failed gate in one line: the package, what failed, where the report is."""
        return f"{self.package_dir}: {failure(self.report)}; report at {self.out_dir / REPORT_NAME}"


def align_package(package_dir, fixtures_dir, out_dir, *, budget: Budget | str | None = None,
                  quality_text=DEFAULT_QUALITY_TEXT, items=DEFAULT_ITEMS, backend: str = "auto",
                  force: bool = False, quality: QualityInputs | None = None, scores_out=None,
                  all_figures: bool = False, fp32_scores=None, quality_from=None) -> GateResult:
    """Gate the package at `package_dir`; write `out_dir/{alignment.json,.md,.png}` and a manifest.

    The report is written and returned whatever the outcome (`GateResult.passed`); GateFailed
    is raised only where the gate cannot run (a kind without a gate, fixtures of another
    model, a foreign FP32 baseline). `quality` shares one FP32 side across calls (the
    survey); `scores_out` writes the quality part's scoring run there
    (`pipeline.stages.scoring.write_run`) where the scoring set was measured; `all_figures`
    measures it even over budget (`measure_quality`); `fp32_scores` reads FP32's side of it
    from that run (`QualityInputs.use_fp32_scores`); `quality_from` takes the quality record
    from that gate's report where it is of the same identity (`quality_identity`), and refuses
    it by field where not.
    """
    from coreml.ane import package_ane_report
    from coreml.kinds import KINDS
    from coreml.package import package_class
    from coreml.runner import open_package_backend
    from manifests.identity import MANIFEST_NAME, artifact_source, environment, inventory, write_json
    from manifests.output import refuse_existing, staged_output
    from pipeline.stages.disk import check_disk
    from pipeline.stages.scoring import write_run

    package_dir, out_dir = Path(package_dir), Path(out_dir)
    refuse_existing(out_dir, force)  # before minutes of gating, not after
    if scores_out is not None:
        refuse_existing(Path(scores_out), force)
        if quality_from is not None:
            raise GateFailed(f"{package_dir}: --scores-out with --quality-from: a reused quality record "
                             "carries no item scores to write")
    clock = _Clock()  # the loading steps' cost; gate_backend's parts follow them in the report
    lineage = resolve_lineage(package_dir)
    budget = parse_budget(budget if budget is not None else default_budget(lineage.manifest)) \
        if not isinstance(budget, Budget) else budget
    kind = lineage.kind
    if kind not in KINDS:
        raise GateFailed(f"{package_dir}: package kind {kind!r} has no alignment gate; gated: {list(KINDS)}")
    fixtures = ReferenceFixtures(fixtures_dir)
    if lineage.source_cmf_sha256 != fixtures.checkpoint_sha256:
        raise GateFailed(f"{fixtures.directory / 'index.json'}: fixtures were made from CMF sha256 "
                         f"{fixtures.checkpoint_sha256}, but {package_dir} comes from {lineage.source_cmf_sha256}")
    check_disk("align", out_dir, package_dir, quality_text=quality.text_path if quality else quality_text)
    clock.lap("lineage")
    candidate = Unopened(package_class(package_dir, backend).backend,
                         lambda: open_package_backend(package_dir, backend=backend))
    numerics = intended_numerics(package_dir, lineage.manifest, lineage.bundle)
    identity = quality_identity(numerics, quality.text_path if quality else Path(quality_text),
                                quality.items_path if quality else Path(items), budget, all_figures)
    # Checked before the references are built: a record of other numerics or inputs is refused at once.
    reused = reuse_quality(Path(quality_from), identity, out_dir) if quality_from is not None else None
    intended, fp32 = intended_references(package_dir, lineage.manifest, lineage.bundle, numerics)
    clock.lap("references")
    quality = quality or QualityInputs(fp32, lineage.bundle, quality_text, items, fp32.context)
    if fp32_scores is not None:
        quality.use_fp32_scores(fp32_scores)
    recipe = lineage.recipe
    body = gate_backend(candidate, intended, fixtures, quality, budget, frozen=recipe == "fp32",
                        patterns=ALL_PATTERNS if recipe == "fp32" else COMPRESSED_PATTERNS, check=kind,
                        all_figures=all_figures, reused_quality=reused)
    body["quality"]["identity"] = identity
    samples, scores = body.pop("_samples"), body.pop("_scores")
    if scores_out is not None and intended is quality.fp32:
        # FP32 is its own quality baseline: its scores are the baseline's, scored here (minutes
        # on a 262k vocabulary) and timed with the parts, so the report shows what the gate cost.
        scoring = _Clock()
        scores = quality.fp32_scores
        scoring.lap("fp32_scores")
        body["seconds"].update(scoring.laps)
    ane = package_ane_report(package_dir, lineage.manifest["package"])
    body["seconds"] = {**clock.laps, **body["seconds"]}
    # Every path the gate records is relative to its own folder: gates ship in releases.
    fixtures_identity = fixtures.identity(relative_to=out_dir)
    report = {
        "format": FORMAT,
        "recipe": recipe,
        **body,
        "reference": {"backend": intended.name, "fixtures": {
            "kind": "artifact", "format": "cmfdeploy.fixtures/1", "path": fixtures_identity["path"],
            "manifest_sha256": fixtures_identity["sha256"]}},
        "package": {"path": portable_name(package_dir, out_dir), "kind": kind,
                    "manifest_sha256": sha256_file(package_dir / MANIFEST_NAME)},
        "fixtures": fixtures_identity,
        "quality_inputs": quality.identity(relative_to=out_dir),
        "compute_units": {"intended": lineage.manifest["package"].get("compute_units", "CPU_ONLY"),
                          "claimable": ane["compute_units"], "ane": ane},
        "chain": [str(link.relative_to(out_dir)) for link in lineage.chain],
    }
    with staged_output(out_dir, force) as staging:
        write_json(staging / REPORT_NAME, report)
        (staging / "alignment.md").write_text(markdown(report))
        samples_plot(staging / "alignment.png", samples, report["tolerance"]["atol"])
        write_json(staging / MANIFEST_NAME, {
            "format": FORMAT, "status": "complete", "passed": report["passed"], "recipe": recipe,
            "candidate_backend": report["candidate_backend"], "budget": budget.spec(),
            "source": artifact_source(package_dir, relative_to=out_dir),
            "fixtures": fixtures_identity,
            "summary": report["summary"],
            "files": inventory(staging),
            "environment": environment(),
        })
    if scores_out is not None and scores is not None:
        write_run(scores, scores_out, artifact=package_dir, backend_name=intended.name, items_path=quality.items_path,
                  force=force)
    return GateResult(package_dir, out_dir, report, scores if scores_out is not None else None)
