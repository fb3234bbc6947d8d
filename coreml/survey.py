"""Compression survey: every recipe applied to one gated FP32 package, gated and scored.

    survey = run_survey("out/chunk_kv", "out/align-fp32", "fixtures/reference",
                        "fixtures/scoring/cloze.jsonl", "out/survey")

For each recipe the FP32 package is compressed (`coreml.recipes.compress_package`), the
compressed manifest is bound to the FP32 gate report it was surveyed under, the package
is gated against the frozen FP32 fixtures with the recipe's own tolerance
(`pipeline.align`), and the scoring set is ranked with it and compared with the FP32
package's ranking (`pipeline.scoring`). A failed gate is a result, recorded like any
other; a recipe whose precondition does not hold (a block size that does not divide, no
gate policy) is recorded with the reason, never dropped. The deployed recipe is the
smallest package whose gate passed.

The survey folder holds `survey.json` (format `cmfdeploy.survey/1`), `survey.md`,
`size_vs_error.png`, and per recipe `packages/<recipe>/`, `gates/<recipe>/` and
`scores/<recipe>/` (plus `scores/fp32/`). It appears all at once or not at all. Nested
artifacts were written inside the staging folder, so the absolute `source.path` recorded
by a gate or a scoring run of a compressed package names the staging path, gone once the
survey is in place; their `source.relative_path` (`../../packages/<recipe>`) holds across
the rename, and `manifests.chain` follows it, pinned by manifest sha256.
"""

from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from coreml import manifest as package_manifest
from coreml.recipes import RECIPES, RecipePrecondition, compress_package
from manifests.chain import upstream_path
from manifests.identity import (
    MANIFEST_NAME,
    artifact_source,
    check_files,
    environment,
    file_identity,
    inventory,
    read_json,
    relative_path,
    sha256_file,
    write_json,
)
from manifests.output import refuse_existing, staged_output
from manifests.schema import validate
from pipeline import align, scoring
from pipeline.backends import open_backend
from pipeline.errors import CmfdeployError
from pipeline.report import md_table, scatter_plot
from pipeline.tokenizer import tokenizer_from_artifact

FORMAT = "cmfdeploy.survey/1"
FOLDER_FORMAT = "cmfdeploy.survey_folder/1"
REPORT_NAME = "survey.json"
ALL_RECIPES = tuple(RECIPES)
DEPLOY_RULE = "the smallest package (bytes on disk) whose alignment gate passed"


class SurveyError(CmfdeployError):
    """The survey's input is not a package it may survey, or a survey folder that does not check out."""


class ForeignGate(CmfdeployError):
    """A gate folder offered with a package is the gate of another package."""


def passed_gate_of(package_dir: Path, gate_dir: Path) -> dict:
    """The manifest of `gate_dir`: verified, passed, and of exactly the package at `package_dir`."""
    manifest = align.require_passed(gate_dir)
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
        "report_sha256": sha256_file(Path(alignment_dir) / align.REPORT_NAME),
        "passed": True,
        "summary": manifest["summary"],
    }


def bind_fp32_gate(compressed_dir: Path, gate: dict) -> None:
    """Add the FP32 gate record to a freshly written compressed manifest (still in staging).

    Its file inventory excludes manifest.json, so the added field leaves it valid; the
    rewrite is atomic.
    """
    path = compressed_dir / MANIFEST_NAME
    manifest = read_json(path)
    manifest["fp32_alignment"] = {k: gate[k] for k in ("manifest_sha256", "report_sha256", "passed")}
    manifest["fp32_alignment"]["path"] = f"../../{gate['path']}"  # from packages/<recipe>/ to the survey folder
    validate(manifest, where=str(path))
    write_json(path, manifest)


# --- one recipe -------------------------------------------------------------------------


def _unmet(name: str, stage: str, reason: str) -> dict:
    return {"name": name, "params": RECIPES[name], "status": "precondition_unmet",
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


def _score_run(package_dir: Path, run_dir: Path, context: dict) -> tuple[list, dict]:
    backend = open_backend(package_dir, context["backend"])
    results = scoring.score_items(backend, context["tokenizer"], context["items"])
    scoring.write_run(results, run_dir, artifact=package_dir, backend_name=backend.name,
                      items_path=context["items_path"])
    return results, read_json(run_dir / MANIFEST_NAME)


def survey_recipe(name: str, package_dir: Path, staging: Path, context: dict) -> dict:
    """Compress, bind, gate and score one recipe; its survey record."""
    compressed, gate_dir = staging / "packages" / name, staging / "gates" / name
    if name not in align.TOLERANCES:
        return _unmet(name, "gate", f"pipeline.align.TOLERANCES has no gate policy for recipe {name!r}")
    extra = {}
    if RECIPES[name].get("calibration"):  # the recipe measures on calibration text itself
        extra["calibration_ids"] = context["calibration_ids"]
        if context["mixed_bpw"] is not None:
            extra["bpw"] = context["mixed_bpw"]
    try:
        manifest = compress_package(package_dir, name, compressed, **extra)
    except RecipePrecondition as error:
        return _unmet(name, "compress", str(error))
    bind_fp32_gate(compressed, context["fp32_gate"])
    try:
        align.align_package(compressed, context["fixtures"].directory, gate_dir, recipe=name,
                            backend=context["backend"])
    except align.GateFailed:
        if not (gate_dir / align.REPORT_NAME).is_file():
            raise  # the gate could not run at all: a problem of the survey's inputs
    report = read_json(gate_dir / align.REPORT_NAME)
    summary = report["summary"]
    results, run = _score_run(compressed, staging / "scores" / name, context)
    size = manifest["size_bytes"]
    return {
        "name": name,
        "params": RECIPES[name],
        "status": "measured",
        "package": {
            "path": f"packages/{name}",
            "manifest_sha256": sha256_file(compressed / MANIFEST_NAME),
            "size_bytes": size,
            "bytes_vs_fp32": size / context["fp32_bytes"],
        },
        "gate": {
            "passed": bool(report["passed"]),
            "report": {"path": f"gates/{name}/{align.REPORT_NAME}",
                       "sha256": sha256_file(gate_dir / align.REPORT_NAME),
                       "manifest_sha256": sha256_file(gate_dir / MANIFEST_NAME)},
            "tolerance": report["tolerance"],
            "max_abs": summary["max_abs"],
            "p99_abs_max": summary["p99_abs_max"],
            "mean_abs": summary["mean_abs"],
            "outside": summary["outside"],
            "top1_agreement_min": summary["top1_agreement_min"],
            "kl_mean_max": summary["kl_mean_max"],
            "invariants_passed": summary["invariants_passed"],
        },
        "scoring": {**_scoring_effects(results, context["baseline"]), "scores_sha256": run["scores_sha256"],
                    "run": f"scores/{name}"},
    }


def deployed_recipe(records: Iterable[dict]) -> str | None:
    """The smallest measured package whose gate passed (ties: the first by name)."""
    passing = [r for r in records if r["status"] == "measured" and r["gate"]["passed"]]
    return min(passing, key=lambda r: (r["package"]["size_bytes"], r["name"]))["name"] if passing else None


# --- the human forms ----------------------------------------------------------------------


def survey_markdown(survey: dict) -> str:
    """One table a release engineer reads at a glance, then what could not be measured."""
    fp32 = survey["fp32"]
    deployed = survey["deployed"]["recipe"]
    measured = [r for r in survey["recipes"] if r["status"] == "measured"]
    unmet = [r for r in survey["recipes"] if r["status"] != "measured"]
    rows = [["fp32 (source)", fp32["package"]["size_bytes"], 1.0, True, fp32["gate"]["summary"]["max_abs"],
             fp32["gate"]["summary"]["top1_agreement_min"], fp32["gate"]["summary"]["kl_mean_max"],
             fp32["scoring"]["top1_accuracy"], fp32["scoring"]["mrr"], 0, 0, 0.0, ""]]
    rows += [[r["name"], r["package"]["size_bytes"], r["package"]["bytes_vs_fp32"], r["gate"]["passed"],
              r["gate"]["max_abs"], r["gate"]["top1_agreement_min"], r["gate"]["kl_mean_max"],
              r["scoring"]["top1_accuracy"], r["scoring"]["mrr"], r["scoring"]["order_changed"],
              r["scoring"]["top1_changed"], r["scoring"]["max_abs_delta_score"],
              "**deployed**" if r["name"] == deployed else ""] for r in measured]
    lines = [
        "# Compression survey",
        "",
        f"- FP32 package: `{fp32['package']['path']}` ({fp32['package']['kind']}), gate passed "
        f"(`{fp32['gate']['path']}`)",
        f"- gates and scoring on **{survey['backend']}**; fixtures `{survey['fixtures']['path']}`; scoring set "
        f"`{survey['scoring_set']['name']}` ({survey['scoring_set']['n_items']} items)",
        f"- deployed: **{deployed or 'none (no recipe passed its gate)'}** ({survey['deployed']['rule']})",
        "",
        md_table(["recipe", "bytes", "× FP32", "gate", "max |Δ logit|", "top-1 agreement", "KL mean max",
                  "accuracy", "MRR", "order changed", "top-1 changed", "max |Δ score|", ""], rows),
    ]
    if unmet:
        lines += ["## Not measured (precondition unmet)", ""]
        lines += [f"- `{r['name']}` ({r['precondition']['stage']}): {r['precondition']['reason']}" for r in unmet]
        lines.append("")
    lines += ["![package size against gate error](size_vs_error.png)", ""]
    return "\n".join(lines)


def size_vs_error_plot(path: Path, survey: dict) -> Path:
    """Package MB against the gate's max |Δ logit|; the deployed recipe in red."""
    deployed = survey["deployed"]["recipe"]
    def label(r: dict) -> str:
        return r["name"] + (" (deployed)" if r["name"] == deployed else "" if r["gate"]["passed"] else " (gate failed)")

    points = [(label(r), r["package"]["size_bytes"] / 1e6,
               r["gate"]["max_abs"], r["name"] == deployed)
              for r in survey["recipes"] if r["status"] == "measured"]
    points.append(("fp32", survey["fp32"]["package"]["size_bytes"] / 1e6, survey["fp32"]["gate"]["summary"]["max_abs"],
                   False))
    return scatter_plot(path, points, title="Package size against alignment-gate error",
                        xlabel="package size (MB)", ylabel="max |Δ logit| vs FP32 reference")


# --- the stage --------------------------------------------------------------------------


def run_survey(
    package_dir: str | Path,
    fp32_alignment_dir: str | Path,
    fixtures_dir: str | Path,
    scoring_items: str | Path,
    out_dir: str | Path,
    recipes: Iterable[str] = ALL_RECIPES,
    force: bool = False,
    backend: str = "auto",
    mixed_bpw: float | None = None,
    calibration_ids: np.ndarray | None = None,
    progress: bool = True,
) -> dict:
    """Survey `recipes` on the FP32 package at `package_dir`; the survey record (survey.json).

    Refuses a package whose FP32 gate (`fp32_alignment_dir`) did not pass or is another
    package's. The tokenizer for the scoring set is the one of the package's bundle.
    `calibration_ids` (token ids of calibration text, pipeline.text_roles) go to the
    calibration-aware recipes, which are recorded as unmet without them; `mixed_bpw`
    overrides the mixed recipe's budget in bits per weight.
    """
    package_dir, out_dir, items_path = Path(package_dir), Path(out_dir), Path(scoring_items)
    recipes = tuple(recipes)
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown or not recipes:
        raise SurveyError(f"{out_dir}: recipes {unknown or '(none)'} are not among {list(RECIPES)}")
    refuse_existing(out_dir, force)
    source = package_manifest.verify_package(package_dir)
    if source.format != package_manifest.COREML_FORMAT:
        raise SurveyError(f"{package_dir / MANIFEST_NAME}: field 'format' is {source.format!r}; "
                          f"a survey starts from an FP32 package ({package_manifest.COREML_FORMAT})")
    gate = fp32_gate(package_dir, Path(fp32_alignment_dir), out_dir)
    fixtures = align.ReferenceFixtures(fixtures_dir)
    context = {
        "backend": backend,
        "fixtures": fixtures,
        "fp32_gate": gate,
        "fp32_bytes": source["package_bytes"],
        "mixed_bpw": mixed_bpw,
        "calibration_ids": calibration_ids,
        "items": scoring.load_items(items_path),
        "items_path": items_path,
        "tokenizer": tokenizer_from_artifact(upstream_path(package_dir, source["source"])),
    }
    with staged_output(out_dir, force) as staging:
        baseline, baseline_run = _score_run(package_dir, staging / "scores" / "fp32", context)
        context["baseline"] = baseline
        records = [survey_recipe(name, package_dir, staging, context)
                   for name in tqdm(recipes, desc="survey", unit="recipe", disable=not progress)]
        fp32_summary = scoring.summarize(baseline)
        survey = {
            "format": FORMAT,
            "status": "complete",
            "source": artifact_source(package_dir, relative_to=out_dir),
            "fp32": {
                "package": {"path": relative_path(package_dir, out_dir), "kind": source["package"]["kind"],
                            "manifest_sha256": sha256_file(package_dir / MANIFEST_NAME),
                            "size_bytes": source["package_bytes"]},
                "gate": gate,
                "scoring": {"top1_accuracy": fp32_summary["top1_accuracy"], "mrr": fp32_summary["mrr"],
                            "scores_sha256": baseline_run["scores_sha256"], "run": "scores/fp32"},
            },
            "backend": baseline_run["backend"],
            "fixtures": fixtures.identity(relative_to=out_dir),
            "scoring_set": baseline_run["scoring_set"],
            "recipes": records,
            "deployed": {"recipe": deployed_recipe(records), "rule": DEPLOY_RULE},
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
    from manifests.identity import Manifest, load_manifest

    path = Path(path)
    manifest = load_manifest(path, FOLDER_FORMAT)
    check_files(path, manifest["files"], hashes=hashes)
    survey = load_survey(path, hashes=False)  # its bytes were just checked through the manifest's inventory
    measured = [r for r in survey["recipes"] if r["status"] == "measured"]
    for record in measured:
        package_manifest.verify_package(path / record["package"]["path"], hashes=False)
        align.verify_alignment(path / "gates" / record["name"], hashes=False)
    return Manifest(path, manifest)


def load_survey(survey_dir: str | Path, hashes: bool = True) -> dict:
    """A finished survey: survey.json valid against its schema and every file as recorded."""
    survey_dir = Path(survey_dir)
    survey = read_json(survey_dir / REPORT_NAME)
    validate(survey, where=str(survey_dir / REPORT_NAME))
    # survey.json cannot record its own hash; listing it as itself makes check_files
    # accept exactly that one extra file.
    check_files(survey_dir, {**survey["files"], REPORT_NAME: file_identity(survey_dir / REPORT_NAME)}, hashes=hashes)
    return survey
