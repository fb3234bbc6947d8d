"""Compression survey: every recipe applied to one gated FP32 package, each gated in three parts.

    survey = run_survey("out/chunk_kv", "out/align-fp32", "fixtures/reference",
                        "fixtures/scoring/cloze.jsonl", "out/survey", budget="ppl=2%,top1=0.95")

For each recipe of `coreml.recipes.RECIPES` the FP32 package is compressed
(`compress_package`, given the calibration text's token ids), the compressed manifest is
bound to the FP32 gate it was surveyed under, and the package is gated (`pipeline.stages.gates`):
exact against the reference of its own decoded weights, quality within the user's budget
of FP32 on the held-out quality text and the scoring set, invariants intact. The FP32 side
of the quality part is computed once for all recipes. A recipe that is exact but over
budget is a result; one that is not exact is a bug, and both are recorded like any other; a
recipe whose precondition does not hold is recorded with the reason, never dropped. The
deployed recipe is the smallest package that passed all three parts.

The survey folder holds `survey.json` (format `cmfdeploy.survey/1`), `survey.md`,
`size_vs_error.png`, and per recipe `packages/<recipe>/`, `gates/<recipe>/` and
`scores/<recipe>/` (the quality part's scoring run; plus `scores/fp32/`). It appears all at
once or not at all. Nested artifacts were written inside the staging folder; their
`source.relative_path` (`../../packages/<recipe>`) holds across the rename, and
`manifests.chain` follows it, pinned by manifest sha256.
"""

import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from coreml import manifest as package_manifest
from coreml.bits import bits_per_weight
from coreml.precisions import package_precision
from coreml.recipes import RECIPES, RecipePrecondition, compress_package
from coreml.targets import Target, target as target_unit
from manifests.identity import (
    MANIFEST_NAME,
    Manifest,
    artifact_source,
    check_files,
    environment,
    file_identity,
    inventory,
    load_manifest,
    read_json,
    relative_path,
    sha256_file,
    write_json,
)
from manifests.output import refuse_existing, staged_output
from manifests.schema import validate
from pipeline.stages import gates, scoring
from pipeline.ground.errors import CmfdeployError
from pipeline.stages.disk import check_disk
from pipeline.stages.report import md_table, scatter_plot
from pipeline.ground.text_roles import text_roles
from pipeline.ground.workers import LOCAL, WorkerEngine, bundle_job_memory, return_freed_memory, run_in_workers

FORMAT = "cmfdeploy.survey/1"
FOLDER_FORMAT = "cmfdeploy.survey_folder/1"
REPORT_NAME = "survey.json"
SHARED_CACHE = ".shared-cache"
ALL_RECIPES = tuple(RECIPES)
DEPLOY_RULE = ("the smallest package (bytes on disk) that passed all three parts (exact, within the budget, "
               "invariants) and whose program can claim the target's compute unit (coreml.ane)")


class SurveyError(CmfdeployError):
    """The survey's input is not a package it may survey, or a survey folder that does not check out."""


class ForeignGate(CmfdeployError):
    """A gate folder offered with a package is the gate of another package."""


def passed_gate_of(package_dir: Path, gate_dir: Path) -> dict:
    """The manifest of `gate_dir`: verified, passed, and of exactly the package at `package_dir`."""
    manifest = gates.require_passed(gate_dir)
    package_sha = sha256_file(Path(package_dir) / MANIFEST_NAME)
    if manifest["source"]["manifest_sha256"] != package_sha:
        raise ForeignGate(
            f"{Path(gate_dir) / MANIFEST_NAME}: field 'source.manifest_sha256' is "
            f"{manifest['source']['manifest_sha256']}, but {Path(package_dir) / MANIFEST_NAME} has sha256 "
            f"{package_sha}: this gate is of another package"
        )
    return manifest


def fp32_gate(package_dir: Path, alignment_dir: Path, survey_dir: Path) -> dict:
    """The FP32 gate this survey stands on, as the compressed manifests and survey.json record it
    (its path relative to the survey folder)."""
    manifest = passed_gate_of(package_dir, alignment_dir)
    return {
        "path": relative_path(alignment_dir, survey_dir),
        "manifest_sha256": sha256_file(Path(alignment_dir) / MANIFEST_NAME),
        "report_sha256": sha256_file(Path(alignment_dir) / gates.REPORT_NAME),
        "passed": True,
        "summary": manifest["summary"],
    }


def bind_fp32_gate(compressed_dir: Path, gate: dict, path_from_package: str) -> None:
    """Add the FP32 gate record (`fp32_gate`) to a freshly written compressed manifest (still in
    staging), the gate named by its path from the package's final folder.

    Its file inventory excludes manifest.json, so the added field leaves it valid; the
    rewrite is atomic.
    """
    path = compressed_dir / MANIFEST_NAME
    manifest = read_json(path)
    manifest["fp32_alignment"] = {k: gate[k] for k in ("manifest_sha256", "report_sha256", "passed")}
    manifest["fp32_alignment"]["path"] = path_from_package
    validate(manifest, where=str(path))
    write_json(path, manifest)


def calibration_ids(tokenizer, text_path: Path) -> np.ndarray:
    """int64 token ids of the text's calibration lines (`pipeline.ground.text_roles`): what
    calibration-aware recipes may look at, disjoint from the quality text and gate fixtures."""
    lines = Path(text_path).read_text(encoding="utf-8").splitlines()
    return np.asarray(tokenizer.encode(" ".join(text_roles(lines, str(text_path))["calibration"])), np.int64)


# --- one recipe -------------------------------------------------------------------------


def _unmet(name: str, stage: str, reason: str) -> dict:
    return {"name": name, "params": RECIPES[name].params_record(), "status": "precondition_unmet",
            "precondition": {"stage": stage, "reason": reason}}


def _scoring_effects(results, baseline) -> dict:
    summary = scoring.summarize(results)
    differences = scoring.rank_differences(baseline, results)
    changed = scoring.changed_items(baseline, results)
    return {
        "top1_accuracy": summary["top1_accuracy"],
        "mrr": summary["mrr"],
        "order_changed": len(differences.order_changed),
        "top1_changed": len(differences.top1_changed),
        "top1_changed_ids": list(differences.top1_changed),
        "improved": len(changed.improved),
        "regressed": len(changed.regressed),
        "max_abs_delta_score": differences.max_abs_delta,
    }


def survey_recipe(name: str, package_dir: Path, staging: Path, context: dict) -> dict:
    """Compress, bind, gate (all three parts) one recipe; its survey record."""
    compressed, gate_dir, run_dir = (staging / part / name for part in ("packages", "gates", "scores"))
    extra = {"shared_cache": context["shared_cache"]}
    if RECIPES[name].calibration:  # the recipe measures on calibration text itself
        extra["calibration_ids"] = context["calibration_ids"]
        if context["mixed_bpw"] is not None:
            extra["bpw"] = context["mixed_bpw"]
    try:
        manifest = compress_package(package_dir, name, compressed, **extra)
    except RecipePrecondition as error:
        return _unmet(name, "compress", str(error))
    return_freed_memory()  # the compression's copies of the program, before the gate loads its own
    # From packages/<recipe>/ to the survey folder, which the gate's path is relative to.
    bind_fp32_gate(compressed, context["fp32_gate"], f"../../{context['fp32_gate']['path']}")
    gate = gates.align_package(compressed, context["fixtures"].directory, gate_dir, budget=context["budget"],
                               backend=context["backend"], quality=context["quality"], scores_out=run_dir,
                               all_figures=context["all_figures"])
    report = gate.report
    summary, quality = report["summary"], report["quality"]
    size = manifest["size_bytes"]
    return {
        "name": name,
        "params": RECIPES[name].params_record(),
        "status": "measured",
        "package": {
            "path": f"packages/{name}",
            "manifest_sha256": sha256_file(compressed / MANIFEST_NAME),
            "size_bytes": size,
            "bytes_vs_fp32": size / context["fp32_bytes"],
            "bits_per_weight": bits_per_weight(compressed)["bits_per_weight"],
        },
        "gate": {
            "passed": bool(report["passed"]),
            "exact": summary["exact"],
            "within_budget": summary["within_budget"],
            "invariants_passed": summary["invariants_passed"],
            "report": {"path": f"gates/{name}/{gates.REPORT_NAME}",
                       "sha256": sha256_file(gate_dir / gates.REPORT_NAME),
                       "manifest_sha256": sha256_file(gate_dir / MANIFEST_NAME)},
            "tolerance": report["tolerance"],
            "max_abs": summary.get("max_abs"),  # absent where exactness was not measured
            "outside": summary.get("outside"),
            "compute_units": report["compute_units"]["claimable"],
            "quality": {k: quality[k] for k in ("ppl_change", "top1_agreement", "kl_mean", "items_top1_changed",
                                                "over_budget")},
        },
        "scoring": ({**_scoring_effects(gate.scores, context["quality"].fp32_scores),
                     "scores_sha256": read_json(run_dir / MANIFEST_NAME)["scores_sha256"], "run": f"scores/{name}"}
                    if quality["items_top1_changed"] is not None else {"not_measured": quality["items_not_measured"]}),
    }


def deployment_choice(records: list[dict], aim: Target) -> dict:
    """The survey's `deployed` record for target `aim`: the recipe `deployed_recipe` picks, the
    target it is deployed for (`deployed_for`), and where it fell back to the target's fallback
    because no passing package can claim the target's unit, why."""
    recipe = deployed_recipe(records, aim.claim)
    if recipe is not None or aim.fallback is None:
        return {"recipe": recipe, "rule": DEPLOY_RULE, "deployed_for": aim.name}
    fallback = target_unit(aim.fallback)
    recipe = deployed_recipe(records, fallback.claim)
    if recipe is None:
        return {"recipe": None, "rule": DEPLOY_RULE, "deployed_for": aim.name}
    passing = [f"{r['name']} ({', '.join(r['gate'].get('compute_units', []))})" for r in records
               if r["status"] == "measured" and r["gate"]["passed"]]
    return {"recipe": recipe, "rule": DEPLOY_RULE, "deployed_for": fallback.name,
            "fallback": (f"no package that passed all three parts can claim {aim.claim} by the static check "
                         f"(coreml.ane; each gate's compute_units.ane says which check failed): "
                         f"{'; '.join(passing)}; deployed for {fallback.name} instead ({fallback.description})")}


def deployed_recipe(records: Iterable[dict], claim: str = "cpu") -> str | None:
    """The smallest measured package that passed all three parts and can claim the target's
    unit `claim` (`coreml.targets`; ties: the first by name)."""
    passing = [r for r in records if r["status"] == "measured" and r["gate"]["passed"]
               and claim in r["gate"].get("compute_units", ["cpu", "gpu"])]
    return min(passing, key=lambda r: (r["package"]["size_bytes"], r["name"]))["name"] if passing else None


# --- the human forms ----------------------------------------------------------------------


def _exactness_cell(gate: dict) -> str:
    if gate["exact"] is None:
        return "not measured²"
    if gate["exact"]:
        return "exact"
    return f'<span style="color:red">**NOT EXACT** (max \\|Δ\\| {gate["max_abs"]:.3g}): a bug</span>'


def _ppl_cell(change: float | None) -> str:
    return "no finite logits" if change is None else f"{change:+.2%}"


def _budget_cell(gate: dict) -> str:
    return "within" if gate["within_budget"] else "over: " + ", ".join(gate["quality"]["over_budget"])


def _or_not_measured(value, note: str = "¹"):
    return f"not measured{note}" if value is None else value


def source_precision(survey: dict) -> str:
    """The precision of the package the recipes compressed (a survey from before targets: fp32)."""
    return target_unit(survey["target"]).precision if survey.get("target") else "fp32"


def survey_markdown(survey: dict) -> str:
    """One table a release engineer reads at a glance, then what could not be measured."""
    fp32 = survey["fp32"]
    deployed = survey["deployed"]["recipe"]
    measured = [r for r in survey["recipes"] if r["status"] == "measured"]
    unmet = [r for r in survey["recipes"] if r["status"] != "measured"]
    source = source_precision(survey)
    rows = [[f"{source} (source)", fp32["package"]["bits_per_weight"], fp32["package"]["size_bytes"], 1.0, "exact",
             0.0, 1.0, 0.0, 0.0, "within", True, fp32["scoring"]["top1_accuracy"], "", ""]]
    rows += [[r["name"], r["package"]["bits_per_weight"], r["package"]["size_bytes"], r["package"]["bytes_vs_fp32"],
              _exactness_cell(r["gate"]), _ppl_cell(r["gate"]["quality"]["ppl_change"]),
              r["gate"]["quality"]["top1_agreement"], r["gate"]["quality"]["kl_mean"],
              _or_not_measured(r["gate"]["quality"]["items_top1_changed"]), _budget_cell(r["gate"]),
              _or_not_measured(r["gate"]["invariants_passed"], "²"), _or_not_measured(r["scoring"].get("top1_accuracy")),
              ", ".join(r["gate"].get("compute_units", [])),
              "**deployed**" if r["name"] == deployed else ""] for r in measured]
    budget = survey["budget"]
    lines = [
        "# Compression survey",
        "",
        f"- source package ({source}): `{fp32['package']['path']}` ({fp32['package']['kind']}), gate passed "
        f"(`{fp32['gate']['path']}`)",
        f"- gates on **{survey['backend']}**; fixtures `{survey['fixtures']['path']}`; quality on "
        f"{survey['quality']['tokens']} held-out tokens of `{survey['quality']['text']['path']}` and the scoring set "
        f"`{survey['scoring_set']['name']}` ({survey['scoring_set']['n_items']} items)",
        f"- target: **{survey.get('target', 'cpu')}** (coreml.targets); budget: **{budget}** (perplexity change at "
        "most, pooled top-1 agreement with FP32 at least)",
        f"- deployed: **{deployed or 'none (no recipe passed all three parts)'}** ({survey['deployed']['rule']})"
        + (f"; **fell back**: {survey['deployed']['fallback']}" if "fallback" in survey["deployed"] else ""),
        "",
        "Exact but over budget is a result of the recipe on this model; not exact is a conversion or runtime bug.",
        "",
        md_table(["recipe", "bits/weight", "bytes", "× source", "exactness", "ppl change", "top-1 agreement",
                  "KL mean", "items top-1 changed", "budget", "invariants", "cloze accuracy", "can run on", ""], rows),
    ]
    if any("not_measured" in r["scoring"] for r in measured):
        lines += ["", "¹ The scoring set is scored only where it can change a verdict: under a budget with an items "
                  "limit (`items=`), for a package within budget on the held-out text. `survey --all-figures` (make "
                  "`ALL_FIGURES=1`) scores every recipe."]
    if any(r["gate"]["exact"] is None for r in measured):
        lines += ["", "² Exactness and the invariants are measured only for a package within budget: the quality part "
                  "measures the package's intended numerics, so over budget no other part can change its verdict. "
                  "`survey --all-figures` measures them for every recipe."]
    if unmet:
        lines += ["## Not measured (precondition unmet)", ""]
        lines += [f"- `{r['name']}` ({r['precondition']['stage']}): {r['precondition']['reason']}" for r in unmet]
        lines.append("")
    lines += ["![package size against perplexity change](size_vs_error.png)", ""]
    return "\n".join(lines)


def size_vs_error_plot(path: Path, survey: dict) -> Path:
    """Bits per weight against the perplexity change; the deployed recipe in red."""
    deployed = survey["deployed"]["recipe"]

    def label(r: dict) -> str:
        gate = r["gate"]
        return r["name"] + (" (deployed)" if r["name"] == deployed else "" if gate["passed"] else
                            " (NOT EXACT)" if gate["exact"] is False else " (over budget)")

    # A package with no finite logit has no perplexity to plot: the table says so.
    points = [(label(r), r["package"]["bits_per_weight"], 100 * r["gate"]["quality"]["ppl_change"],
               r["name"] == deployed) for r in survey["recipes"]
              if r["status"] == "measured" and r["gate"]["quality"]["ppl_change"] is not None]
    points.append((f"{source_precision(survey)} (source)", survey["fp32"]["package"]["bits_per_weight"], 0.0, False))
    return scatter_plot(path, points, title="Bits per weight against perplexity change",
                        xlabel="bits per weight", ylabel="perplexity change vs FP32 (%)")


# --- the stage --------------------------------------------------------------------------


def survey_context(settings: dict, manifest: dict | None = None) -> dict:
    """What `survey_recipe` needs, from the JSON-able `settings` run_survey records (a worker
    process rebuilds it from them). `manifest`: the FP32 package's, already verified by the
    caller (otherwise it is verified here). With `settings["baseline"]` (a scoring run
    folder) the FP32 side of the scoring set is read from that run instead of scored again."""
    package_dir = Path(settings["package_dir"])
    manifest = manifest or package_manifest.verify_package(package_dir).data
    _, _, bundle = gates.upstream_of(package_dir, manifest)
    _, fp32 = gates.intended_references(package_dir, manifest, bundle)
    quality = gates.QualityInputs(fp32, bundle, settings["quality_text"], Path(settings["items"]), fp32.context)
    if settings.get("baseline"):
        quality.use_fp32_scores(Path(settings["baseline"]))
    return {
        "backend": settings["backend"],
        "budget": gates.parse_budget(settings["budget"]),
        "fixtures": gates.ReferenceFixtures(settings["fixtures_dir"]),
        "fp32_gate": settings["fp32_gate"],
        "fp32_bytes": manifest["package_bytes"],
        "quality": quality,
        "calibration_ids": calibration_ids(quality.tokenizer, Path(settings["quality_text"])),
        "mixed_bpw": settings["mixed_bpw"],
        "all_figures": settings["all_figures"],
        "shared_cache": settings.get("shared_cache"),
    }


def _recipes_in_workers(recipes: tuple[str, ...], staging: Path, settings: dict, jobs: int, bar,
                        engine: WorkerEngine, memory_per_job: int | None) -> list[dict]:
    """Each recipe's record from `jobs` worker processes (`pipeline.ground.workers`), each with
    an equal share of the cores for its BLAS threads: two 1-thread processes get through
    ~1.2x the items of one 2-thread process on two cores, and overlap each other's
    single-threaded parts (MIL passes, GPTQ's column loop, k-means). A worker builds its
    context once, reads the FP32 baseline from scores/fp32, then surveys the recipes it is
    given into the same staging folder (its recipe's own subfolders)."""
    setup = {"staging": str(staging), "settings": {**settings, "baseline": str(staging / "scores" / "fp32")}}
    longest_first = survey_order(recipes, jobs)
    records = run_in_workers("pipeline.stages.survey:survey_worker", setup, longest_first, jobs, where=staging,
                             shared=(staging,), engine=engine, done=lambda recipe, record: bar.update(),
                             memory_per_job=memory_per_job)
    by_recipe = dict(zip(longest_first, records))
    return [by_recipe[name] for name in recipes]


def survey_order(recipes: tuple[str, ...], jobs: int) -> list[str]:
    """The order the workers take `recipes` in. Calibration-aware recipes measure the model before
    they code it, the longest compressions (mixed: 170 s of one worker on SmolLM2): started first,
    they do not leave one worker running alone at the end. But they share one set of Hessians
    (`coreml.cache`), which the first of them makes while the others wait for it, so the other
    workers start with a recipe that needs none. Records come back in the order asked."""
    calibrated = [name for name in recipes if RECIPES[name].calibration]
    others = [name for name in recipes if not RECIPES[name].calibration]
    return calibrated[:1] + others[:jobs - 1] + calibrated[1:] + others[jobs - 1:]


def survey_worker(setup: dict):
    """A worker of `_recipes_in_workers`: each recipe it is given, surveyed into the staging folder."""
    context = survey_context(setup["settings"])
    return lambda recipe: survey_recipe(recipe, Path(setup["settings"]["package_dir"]), Path(setup["staging"]), context)


def run_survey(
    package_dir: str | Path,
    fp32_alignment_dir: str | Path,
    fixtures_dir: str | Path,
    scoring_items: str | Path,
    out_dir: str | Path,
    recipes: Iterable[str] = ALL_RECIPES,
    force: bool = False,
    backend: str = "auto",
    budget: str | None = None,
    quality_text: str | Path = gates.DEFAULT_QUALITY_TEXT,
    mixed_bpw: float | None = None,
    progress: bool = True,
    all_figures: bool = False,
    jobs: int = 1,
    fp32_scores: str | Path | None = None,
    target: str = "cpu",
    engine: WorkerEngine = LOCAL,
) -> dict:
    """Survey `recipes` on the FP32 package at `package_dir`; the survey record (survey.json).

    Refuses a package whose FP32 gate (`fp32_alignment_dir`) did not pass or is another
    package's. `quality_text` gives both the calibration lines the recipes may look at and
    the held-out quality lines the gates measure on (`pipeline.ground.text_roles`).
    `mixed_bpw` overrides the mixed recipe's budget in bits per weight. `all_figures` scores
    the scoring set for every recipe, not only those within budget on the held-out text.
    `jobs` > 1 surveys that many recipes at a time, each in its own process (`_recipes_in_workers`);
    `engine` says where those run (the Ray engine surveys even one job's recipes on the cluster).
    `target` (`coreml.targets`): the package must be of the target's precision, and only a
    package that can claim the target's unit deploys. `budget` None: a compressed package's
    (`pipeline.stages.gates.budget.COMPRESSED_BUDGET`), on every target.
    `fp32_scores`: FP32's scoring run of the same scoring set and bundle (the FP32 gate's
    `scores_out`), read instead of scored again (`QualityInputs.use_fp32_scores` checks it).
    """
    package_dir, out_dir, items_path = Path(package_dir), Path(out_dir), Path(scoring_items)
    recipes = tuple(recipes)
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown or not recipes:
        raise SurveyError(f"{out_dir}: recipes {unknown or '(none)'} are not among {list(RECIPES)}")
    if jobs < 1:
        raise SurveyError(f"{out_dir}: jobs {jobs} must be at least 1")
    refuse_existing(out_dir, force)
    source = package_manifest.verify_package(package_dir)
    if source.format != package_manifest.COREML_FORMAT:
        raise SurveyError(f"{package_dir / MANIFEST_NAME}: field 'format' is {source.format!r}; "
                          f"a survey starts from an FP32 package ({package_manifest.COREML_FORMAT})")
    aim = target_unit(target)
    if package_precision(source["package"], package_dir).name != aim.precision:
        raise SurveyError(f"{package_dir / MANIFEST_NAME}: field 'package.precision' is "
                          f"{source['package'].get('precision', 'fp32')!r}; target {aim.name!r} surveys a "
                          f"{aim.precision} package")
    budget = budget or gates.default_budget(source.data, compressed=True)
    gate = fp32_gate(package_dir, Path(fp32_alignment_dir), out_dir)
    check_disk("survey", out_dir, package_dir, units=len(recipes), jobs=min(jobs, len(recipes)),
               quality_text=quality_text)
    settings = {"package_dir": str(package_dir), "fixtures_dir": str(fixtures_dir), "budget": budget,
                "backend": backend, "quality_text": str(quality_text), "items": str(items_path),
                "mixed_bpw": mixed_bpw, "all_figures": all_figures, "fp32_gate": gate,
                "baseline": str(fp32_scores) if fp32_scores else None}
    context = survey_context(settings, source.data)  # verified above: 538 MB not hashed twice on SmolLM2
    quality, fixtures, parsed_budget = context["quality"], context["fixtures"], context["budget"]
    with staged_output(out_dir, force) as staging:
        scoring.write_run(quality.fp32_scores, staging / "scores" / "fp32", artifact=package_dir,
                          backend_name=quality.fp32.name, items_path=items_path)
        baseline_run = read_json(staging / "scores" / "fp32" / MANIFEST_NAME)
        # The recipes' calibration Hessians, GPTQ codes and k-means centres, made once and shared
        # by every worker (coreml.cache), removed before the folder's inventory.
        cache = staging / SHARED_CACHE
        settings["shared_cache"] = context["shared_cache"] = str(cache)
        fp32_summary = scoring.summarize(quality.fp32_scores)
        identities = {"budget": parsed_budget.spec(), "fixtures": fixtures.identity(relative_to=out_dir),
                      "quality": quality.identity(relative_to=out_dir)}
        bar = tqdm(total=len(recipes), desc="survey", unit="recipe", disable=not progress)
        if jobs == 1 and engine.in_process:
            records = []
            for name in recipes:
                records.append(survey_recipe(name, package_dir, staging, context))
                bar.update()
        else:
            memory_per_job = bundle_job_memory(quality.bundle)
            # Each worker builds its own context: this process's (the reference model, the
            # quality inputs) would only wait beside theirs. An fp16 SmolLM2 survey's parent held
            # 0.50 GiB while its workers ran, 0.28 GiB of it the interpreter with its libraries.
            del context, quality, fixtures
            return_freed_memory()
            records = _recipes_in_workers(recipes, staging, settings, jobs, bar, engine, memory_per_job)
        bar.close()
        shutil.rmtree(cache, ignore_errors=True)
        survey = {
            "format": FORMAT,
            "status": "complete",
            "target": aim.name,
            "source": artifact_source(package_dir, relative_to=out_dir),
            "fp32": {
                "package": {"path": relative_path(package_dir, out_dir), "kind": source["package"]["kind"],
                            "manifest_sha256": sha256_file(package_dir / MANIFEST_NAME),
                            "size_bytes": source["package_bytes"],
                            "bits_per_weight": bits_per_weight(package_dir)["bits_per_weight"]},
                "gate": gate,
                "scoring": {"top1_accuracy": fp32_summary["top1_accuracy"], "mrr": fp32_summary["mrr"],
                            "scores_sha256": baseline_run["scores_sha256"], "run": "scores/fp32"},
            },
            "backend": records_backend(staging, records, backend),
            **identities,
            "scoring_set": baseline_run["scoring_set"],
            "recipes": records,
            "deployed": deployment_choice(records, aim),
        }
        (staging / "survey.md").write_text(survey_markdown(survey))
        size_vs_error_plot(staging / "size_vs_error.png", survey)
        survey.update(files=inventory(staging, exclude=(REPORT_NAME,)), environment=environment(
            package_manifest.ENVIRONMENT_PACKAGES))
        validate(survey, where=str(out_dir / REPORT_NAME))
        write_json(staging / REPORT_NAME, survey)
        write_survey_manifest(staging, survey)
    return survey


def write_survey_manifest(staging: Path, survey: dict) -> None:
    """The survey folder's manifest.json, written last: every file (survey.json included), the
    survey's source and its report, so `verify-artifact` walks a survey like any stage output."""
    write_json(staging / MANIFEST_NAME, {
        "format": FOLDER_FORMAT,
        "status": "complete",
        "source": survey["source"],
        "report": {"path": REPORT_NAME, "sha256": sha256_file(staging / REPORT_NAME), "format": FORMAT},
        "deployed": survey["deployed"]["recipe"],
        "files": inventory(staging),
        "environment": survey["environment"],
    })


def verify_survey(path: str | Path, hashes: bool = True):
    """Verifier of a survey folder for `cmfdeploy verify-artifact`: its manifest's inventory,
    survey.json (schema, and its own inventory), and every measured recipe's package and gate."""
    path = Path(path)
    manifest = load_manifest(path, FOLDER_FORMAT)
    check_files(path, manifest["files"], hashes=hashes)
    survey = load_survey(path, hashes=False)  # its bytes were just checked through the manifest's inventory
    measured = [r for r in survey["recipes"] if r["status"] == "measured"]
    for record in measured:
        package_manifest.verify_package(path / record["package"]["path"], hashes=False)
        gates.verify_alignment(path / "gates" / record["name"], hashes=False)
    return Manifest(path, manifest)


def records_backend(staging: Path, records: list[dict], asked: str) -> str:
    """The backend the gates ran the packages on, as their reports name it."""
    gated = [r for r in records if r["status"] == "measured"]
    if not gated:
        return asked
    return read_json(staging / gated[0]["gate"]["report"]["path"])["candidate_backend"]


def load_survey(survey_dir: str | Path, hashes: bool = True) -> dict:
    """A finished survey: survey.json valid against its schema and every file as recorded."""
    survey_dir = Path(survey_dir)
    survey = read_json(survey_dir / REPORT_NAME)
    validate(survey, where=str(survey_dir / REPORT_NAME))
    # survey.json cannot record its own hash; listing it as itself makes check_files
    # accept exactly that one extra file.
    check_files(survey_dir, {**survey["files"], REPORT_NAME: file_identity(survey_dir / REPORT_NAME)}, hashes=hashes)
    return survey
