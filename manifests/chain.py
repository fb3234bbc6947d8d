"""The links of an artifact chain: where an artifact's upstream is, and the source CMF's check.

Every manifest's `source` is either an earlier artifact (`kind: artifact`, its folder by
`relative_path` from the manifest's own folder, and the sha256 of its manifest.json) or the
CMF the chain starts from (`kind: cmf`, its size, sha256, envelope hashes). Links are
relative, so a build tree moved or copied as a whole verifies within itself, and an
artifact copied elsewhere (a release) verifies on its own, its upstream reported as not
available. Records made before links were relative also hold an absolute `path`, tried second.

The walk itself, which verifies each artifact by its format's verifier, is
`pipeline.stages.artifacts.verify_chain`: the verifiers live on the floors above.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

from manifests.identity import MANIFEST_NAME, Manifest, check_file, is_recorded_file, portable_name
from pipeline.ground.errors import IdentityError

@dataclass(frozen=True)
class Link:
    """One step of a chain: what was checked and how it came out."""

    path: str
    format: str  # a manifest format, or "cmf"
    result: str  # "verified" or "not available: <why>"
    checked: str = field(default="", compare=False)  # what "verified" covered, for people
    # The verified artifact's manifest, for callers that go on to read the chain (a gate's lineage).
    manifest: Manifest | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.format} {self.path}: {self.result}"

    def relative_to(self, folder: str | Path) -> "Link":
        """The same link with its path as `folder` may name it in a report that travels
        (`manifests.identity.portable_name`)."""
        return Link(portable_name(self.path, folder), self.format, self.result, self.checked)


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


def check_cmf_source(source: dict, hashes: bool) -> Link:
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
