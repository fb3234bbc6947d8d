"""Verify any stage output by its manifest's `format`, then walk its chain back to the CMF.

Each stage registers its verifier as one row of `VERIFIERS`: format -> "module:function".
A verifier is `verify(path, hashes=True) -> Manifest` and raises IdentityError on any
difference. The table holds import paths, not functions, so verifying a bundle never
imports Core ML.

Every manifest's `source` is either an earlier artifact (`kind: artifact`, its folder by
`relative_path` from the manifest's own folder, and the sha256 of its manifest.json) or the
CMF the chain starts from (`kind: cmf`, its size, sha256, envelope hashes). The walk
verifies each artifact, checks that the upstream manifest is byte-for-byte the one
recorded, and re-hashes the CMF when it is still at its recorded path. Links are relative,
so a build tree moved or copied as a whole verifies within itself, and an artifact copied
elsewhere (a release) verifies on its own, its upstream reported as not available.
Records made before links were relative also hold an absolute `path`, tried second.
"""

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from manifests.identity import MANIFEST_NAME, Manifest, check_file, is_recorded_file, portable_name, read_json, sha256_file
from pipeline.ground.errors import IdentityError

VERIFIERS = {
    "cmfdeploy.bundle/1": "pipeline.ground.bundle_format:verify_bundle",
    "cmfdeploy.coreml/1": "coreml.manifest:verify_package",
    "cmfdeploy.alignment/1": "pipeline.stages.align:verify_alignment",
    "cmfdeploy.compressed/1": "coreml.manifest:verify_package",
    "cmfdeploy.release/1": "pipeline.stages.release:verify_release",
    "cmfdeploy.scores/1": "pipeline.stages.scoring:verify_scores",
    "cmfdeploy.survey_folder/1": "pipeline.stages.survey:verify_survey",
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
    "cmfdeploy.scores/1": "scores and items as recorded",
    "cmfdeploy.survey_folder/1": "survey.json against its schema and inventory, every measured package and gate",
}


@dataclass(frozen=True)
class Link:
    """One step of a chain: what was checked and how it came out."""

    path: str
    format: str  # a manifest format, or "cmf"
    result: str  # "verified" or "not available: <why>"
    checked: str = field(default="", compare=False)  # what "verified" covered, for people

    def __str__(self) -> str:
        return f"{self.format} {self.path}: {self.result}"

    def relative_to(self, folder: str | Path) -> "Link":
        """The same link with its path as `folder` may name it in a report that travels
        (`manifests.identity.portable_name`)."""
        return Link(portable_name(self.path, folder), self.format, self.result, self.checked)


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
        links.append(Link(str(current), manifest.format, "verified", checked))
        source = manifest["source"]
        if source["kind"] == "cmf":
            links.append(_check_cmf_source(source, hashes))
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


def upstream_path(current: str | Path, source: dict) -> Path:
    """Where the upstream artifact of `current` (an `artifact` source record) is now: at
    `relative_path` from `current`, or at an older record's absolute `path` when nothing is at
    the relative one. The result may hold no manifest (the upstream was not shipped along).

    A manifest at the relative path is taken even when it is not the recorded one: the
    chain's sha256 check then reports the mismatch instead of looking past it.
    """
    if "relative_path" in source:
        # Lexical join from the resolved folder, as `artifact_source` computed it.
        candidate = Path(os.path.normpath(Path(current).resolve() / source["relative_path"]))
        if is_recorded_file(candidate / MANIFEST_NAME) or "path" not in source:
            return candidate
    return Path(source["path"])


def _check_cmf_source(source: dict, hashes: bool) -> Link:
    path = Path(source["path"])
    files = source.get("shards") or [{"file": source["file"], "bytes": source["bytes"], "sha256": source["sha256"]}]
    for entry in files:
        name = entry["file"]
        # A shard sits beside the first file: a plain name, nothing that walks elsewhere.
        if not path.name or not name or "/" in name or "\0" in name or name in (".", ".."):
            raise IdentityError(f"source CMF record: field 'file' is {name!r}, not a file name beside 'path' {path}")
        file = path.with_name(name)
        if not is_recorded_file(file):
            return Link(str(path), "cmf", f"not available: {file} is not there")
        check_file(file, entry, hashes, where=f"source CMF {file}")
    return Link(str(path), "cmf", "verified" if hashes else "verified (sizes only)")
