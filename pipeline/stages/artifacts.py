"""Verify any stage output by its manifest's `format`, then walk its chain back to the CMF.

    links = verify_chain("build/m/align/chunk_kv")   # [Link(...), ..., Link(cmf)]

Each stage registers its verifier as one row of `VERIFIERS`: format -> "module:function".
A verifier is `verify(path, hashes=True) -> Manifest` and raises IdentityError on any
difference. The table holds import paths, not functions, so verifying a bundle never
imports Core ML; every path names a module on this floor or below it.

The walk verifies each artifact, checks that the upstream manifest is byte-for-byte the one
recorded (`manifests.chain` finds it), and re-hashes the CMF when it is still at its
recorded path.
"""

import importlib
from pathlib import Path

from manifests.chain import Link, check_cmf_source, upstream_path
from manifests.identity import MANIFEST_NAME, Manifest, is_recorded_file, read_json, sha256_file
from pipeline.ground.errors import IdentityError

VERIFIERS = {
    "cmfdeploy.bundle/1": "pipeline.ground.bundle_format:verify_bundle",
    "cmfdeploy.coreml/1": "coreml.manifest:verify_package",
    "cmfdeploy.alignment/1": "pipeline.stages.gates.report:verify_alignment",
    "cmfdeploy.compressed/1": "coreml.manifest:verify_package",
    "cmfdeploy.release/1": "pipeline.stages.release:verify_release",
    "cmfdeploy.app_release/1": "pipeline.stages.app_release:verify_app_release",
    "cmfdeploy.scores/1": "pipeline.stages.scoring:verify_scores",
    "cmfdeploy.survey_folder/1": "pipeline.stages.survey:verify_survey",
    "cmfdeploy.preflight/1": "pipeline.stages.preflight:verify_preflight",
    "cmfdeploy.deployment/1": "pipeline.stages.deploy:verify_deployment",
}
# What each verifier checks beyond the file inventory, as `verify-artifact` reports it.
CHECKS = {
    "cmfdeploy.bundle/1": "the tokenizer record against tokenizer.json",
    "cmfdeploy.coreml/1": "the tokenizer files against the record, and the record against its source's",
    "cmfdeploy.compressed/1": "the tokenizer files against the record, and the record against its source's",
    "cmfdeploy.alignment/1": "report, page and plot as recorded",
    "cmfdeploy.release/1": ("every package against its manifest, every gate passed and of exactly its package, "
                            "the compressed package's bindings to the FP32 package and gate, the survey's records, "
                            "tokenizer/ against every package's tokenizer, metadata.json against the manifest"),
    "cmfdeploy.app_release/1": ("the package against its manifest and the release's entry of it, tokenizer/ against "
                                "the package's tokenizer, metadata.json's package and recipe, and, where the release "
                                "is beside it, that the release ships this entry"),
    "cmfdeploy.scores/1": "scores and items as recorded",
    "cmfdeploy.survey_folder/1": "survey.json against its schema and inventory, every measured package and gate",
    "cmfdeploy.preflight/1": "the report's verdict, mitigations and source against the manifest",
    "cmfdeploy.deployment/1": ("the package and its gate (of exactly that package, the verdict as recorded), and the "
                               "package's codes against the digest of the survey's codes"),
}


def verifier_for(format_name: str):
    target = VERIFIERS.get(format_name) if isinstance(format_name, str) else None
    if target is None:
        raise IdentityError(f"no verifier for manifest format {format_name!r}; known formats: {sorted(VERIFIERS)}")
    module, function = target.split(":")
    return getattr(importlib.import_module(module), function)


def verify_artifact(path: str | Path, hashes: bool = True) -> Manifest:
    """Verify one artifact folder by the verifier its manifest's format names."""
    path = Path(path)
    format_name = read_json(path / MANIFEST_NAME).get("format")
    return verifier_for(format_name)(path, hashes=hashes)


def verify_chain(path: str | Path, hashes: bool = True) -> list[Link]:
    """Verify `path` and every artifact upstream of it, ending at the source CMF.

    Raises IdentityError at the first link that does not check out. A link that is no
    longer on disk ends the walk as "not available", which is reported, not hidden.
    """
    links: list[Link] = []
    current = Path(path)
    # No cycle check is needed: each link pins its upstream manifest by sha256, and no two
    # manifests can each contain the other's hash.
    while True:
        manifest = verify_artifact(current, hashes=hashes)
        checked = "; ".join(filter(None, (f"{len(manifest['files'])} files by {'sha256' if hashes else 'size'}",
                                          CHECKS.get(manifest.format))))
        links.append(Link(str(current), manifest.format, "verified", checked, manifest))
        source = manifest["source"]
        if source["kind"] == "cmf":
            links.append(check_cmf_source(source, hashes))
            return links
        upstream = upstream_path(current, source)
        if not is_recorded_file(upstream / MANIFEST_NAME):
            links.append(Link(str(upstream), source["format"], "not available: no manifest at the recorded path"))
            return links
        digest = sha256_file(upstream / MANIFEST_NAME)
        if digest != source["manifest_sha256"]:
            raise IdentityError(
                f"{current / MANIFEST_NAME}: field 'source.manifest_sha256' is {source['manifest_sha256']}, "
                f"but {upstream / MANIFEST_NAME} has sha256 {digest}"
            )
        current = upstream
