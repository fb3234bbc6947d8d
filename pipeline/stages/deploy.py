"""Deploy: the survey's deployed recipe on the package an app runs, with the surveyed codes, gated.

    deployment = deploy_package("out/survey", "out/coreml/stateful", "out/align/stateful",
                                "out/deployed", fixtures_dir="out/reference")

A survey measures every recipe on the chunk-KV package, whose copied-in cache makes it the
gates' workhorse; what an app loads is the stateful package, whose cache stays on the device
(issue 50). So the survey's deployed recipe is applied to the stateful package
(`compress_package`, which compresses a multifunction package function by function), and the
result is refused unless every weight carries exactly the codes the survey measured
(`code_digests`: the sha256 of each decompression op's constants, by bundle weight). It is then
gated in all three parts like any package, against the same fixtures and budget.

    out/deployed/
      manifest.json   cmfdeploy.deployment/1: the survey record it applies, the codes' digest,
                      the gate's verdict; its source is the survey folder
      package/        the compressed package (its fp32_alignment binds it to the stateful FP32 gate)
      gate/           its three-part gate (kept whatever the verdict: a failing gate's report is
                      the result, and `passed` is false)
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from coreml import manifest as package_manifest
from coreml.recipes import RECIPES
from coreml.recipes.compress import code_digests, compress_package
from manifests.identity import (MANIFEST_NAME, Manifest, artifact_source, check_files, environment, inventory,
                                load_manifest, read_json, relative_path, sha256_file, write_json)
from manifests.output import refuse_existing, staged_output
from manifests.schema import validate
from pipeline.ground.errors import CmfdeployError, IdentityError
from pipeline.ground.tokenizer import tokenizer_from_artifact
from pipeline.stages import gates
from pipeline.stages.disk import check_disk
from pipeline.stages.survey import REPORT_NAME as SURVEY_NAME
from pipeline.stages.survey import bind_fp32_gate, calibration_ids, fp32_gate, load_survey

FORMAT = "cmfdeploy.deployment/1"
PACKAGE_DIR = "package"
GATE_DIR = "gate"


class DeployError(CmfdeployError):
    """The survey deploys nothing, or the package offered is not one the survey's codes may go on."""


@dataclass(frozen=True)
class Deployment:
    """A written deployment folder: its manifest, and the gate's verdict on the package."""

    manifest: Manifest
    gate: gates.GateResult | None

    @property
    def passed(self) -> bool:
        return bool(self.manifest["gate"]["passed"])

    @property
    def package_dir(self) -> Path:
        return self.manifest.path / PACKAGE_DIR

    @property
    def gate_dir(self) -> Path:
        return self.manifest.path / GATE_DIR


def codes_digest(digests: dict[str, str]) -> str:
    """One sha256 over every weight's code digest (`code_digests`), in the weights' name order."""
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def deploy_package(survey_dir, package_dir, gate_dir, out_dir, *, fixtures_dir, quality_text=gates.DEFAULT_QUALITY_TEXT,
                   items=gates.DEFAULT_ITEMS, backend: str = "auto", fp32_scores=None, force: bool = False) -> Deployment:
    """Apply `survey_dir`'s deployed recipe to the package at `package_dir` (gated passed by
    `gate_dir`), check its codes are the surveyed ones, and gate it under the survey's budget.

    `quality_text` must be the text the survey calibrated on: a calibration-aware recipe's codes
    depend on it, and the codes check refuses any difference. The folder is written whatever the
    gate's verdict (`Deployment.passed`)."""
    survey_dir, package_dir, gate_dir, out_dir = map(Path, (survey_dir, package_dir, gate_dir, out_dir))
    refuse_existing(out_dir, force)
    survey = load_survey(survey_dir)
    where = survey_dir / SURVEY_NAME
    recipe = survey["deployed"]["recipe"]
    if recipe is None:
        raise DeployError(f"{where}: field 'deployed.recipe' is null: no recipe passed its gate, nothing to deploy")
    record = next(r for r in survey["recipes"] if r["name"] == recipe)
    surveyed_dir = survey_dir / record["package"]["path"]
    package = package_manifest.verify_package(package_dir)
    surveyed_fp32 = read_json(survey_dir / survey["fp32"]["package"]["path"] / MANIFEST_NAME)
    if package["source"]["manifest_sha256"] != surveyed_fp32["source"]["manifest_sha256"]:
        raise DeployError(f"{package_dir / MANIFEST_NAME}: field 'source.manifest_sha256' is "
                          f"{package['source']['manifest_sha256']}, but the survey's FP32 package was converted "
                          f"from bundle manifest {surveyed_fp32['source']['manifest_sha256']}: another bundle's package")
    if package["package"].get("precision") != surveyed_fp32["package"].get("precision"):
        raise DeployError(f"{package_dir / MANIFEST_NAME}: field 'package.precision' is "
                          f"{package['package'].get('precision')!r}; the survey's is "
                          f"{surveyed_fp32['package'].get('precision')!r}")
    gate = fp32_gate(package_dir, gate_dir, out_dir / PACKAGE_DIR)
    check_disk("deploy", out_dir, package_dir, quality_text=quality_text)
    extra = {}
    if RECIPES[recipe].calibration:
        bundle = gates.upstream_of(package_dir, package.data)[2]
        extra["calibration_ids"] = calibration_ids(tokenizer_from_artifact(bundle), Path(quality_text))
        if "bpw" in record["params"]:
            extra["bpw"] = record["params"]["bpw"]
    surveyed_codes = code_digests(surveyed_dir)
    with staged_output(out_dir, force) as staging:
        compressed = staging / PACKAGE_DIR
        compress_package(package_dir, recipe, compressed, **extra)
        bind_fp32_gate(compressed, gate, gate["path"])
        codes = code_digests(compressed)
        differ = sorted(name for name in surveyed_codes.keys() | codes.keys()
                        if surveyed_codes.get(name) != codes.get(name))
        if differ:
            raise DeployError(f"{compressed.name}: recipe {recipe} coded {len(differ)} weights other than the survey's "
                              f"{surveyed_dir} did ({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''}); "
                              "a deployed package must carry the codes its survey measured")
        result = gates.align_package(compressed, fixtures_dir, staging / GATE_DIR, budget=survey["budget"],
                                     quality_text=quality_text, items=items, backend=backend,
                                     fp32_scores=fp32_scores)
        manifest = {
            "format": FORMAT,
            "status": "incomplete",
            "source": artifact_source(survey_dir, relative_to=out_dir),
            "recipe": recipe,
            "survey": {"path": relative_path(where, out_dir), "sha256": sha256_file(where),
                       "package_manifest_sha256": record["package"]["manifest_sha256"],
                       "target": survey.get("target", "cpu")},
            "codes": {"weights": len(codes), "sha256": codes_digest(codes),
                      "equal_to": f"recipes[{recipe}].package of the survey"},
            "package": {"path": PACKAGE_DIR, "kind": package["package"]["kind"],
                        "manifest_sha256": sha256_file(compressed / MANIFEST_NAME),
                        "size_bytes": read_json(compressed / MANIFEST_NAME)["size_bytes"]},
            "gate": {"path": GATE_DIR, "passed": result.passed,
                     "manifest_sha256": sha256_file(staging / GATE_DIR / MANIFEST_NAME),
                     "report_sha256": sha256_file(staging / GATE_DIR / gates.REPORT_NAME)},
        }
        files = inventory(staging)
        manifest.update(files=files, environment=environment(package_manifest.ENVIRONMENT_PACKAGES),
                        status="complete")
        validate(manifest, where=str(out_dir / MANIFEST_NAME))
        write_json(staging / MANIFEST_NAME, manifest)
    return Deployment(Manifest(out_dir, manifest), result)


def verify_deployment(path: str | Path, hashes: bool = True) -> Manifest:
    """Offline check of a deployment folder: its files, its package and gate (of exactly that
    package, with the verdict recorded), and the package's codes against the recorded digest."""
    path = Path(path)
    manifest = load_manifest(path, FORMAT)
    check_files(path, manifest["files"], hashes=hashes)
    where = path / MANIFEST_NAME
    package_dir, gate_dir = path / manifest["package"]["path"], path / manifest["gate"]["path"]
    package_manifest.verify_package(package_dir, hashes=hashes)
    gate = gates.verify_alignment(gate_dir, hashes=hashes)
    for field, recorded, file in (("package.manifest_sha256", manifest["package"]["manifest_sha256"],
                                   package_dir / MANIFEST_NAME),
                                  ("gate.manifest_sha256", manifest["gate"]["manifest_sha256"], gate_dir / MANIFEST_NAME),
                                  ("gate.report_sha256", manifest["gate"]["report_sha256"], gate_dir / gates.REPORT_NAME)):
        if sha256_file(file) != recorded:
            raise IdentityError(f"{where}: field {field!r} is {recorded}, but {file} differs")
    if gate["source"]["manifest_sha256"] != manifest["package"]["manifest_sha256"]:
        raise IdentityError(f"{gate_dir / MANIFEST_NAME}: field 'source.manifest_sha256' is not {package_dir}'s")
    if bool(gate["passed"]) != manifest["gate"]["passed"]:
        raise IdentityError(f"{where}: field 'gate.passed' is {manifest['gate']['passed']}, the gate says {gate['passed']}")
    digest = codes_digest(code_digests(package_dir))
    if digest != manifest["codes"]["sha256"]:
        raise IdentityError(f"{where}: field 'codes.sha256' is {manifest['codes']['sha256']}, but the codes of "
                            f"{package_dir} digest to {digest}")
    return Manifest(path, manifest)
