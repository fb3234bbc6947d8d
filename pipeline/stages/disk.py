"""A stage's disk check from its input artifact: W and L read from it, then
`manifests.disk.require_disk` (docs/DISK.md).

    check_disk("survey", out_dir, package_dir, units=len(recipes), jobs=jobs, quality_text=text)
"""

import json
import math
from pathlib import Path

from manifests.chain import upstream_path
from manifests.disk import DISK_NEEDS, require_disk
from manifests.identity import MANIFEST_NAME
from pipeline.ground.bundle_format import WEIGHTS_NAME
from pipeline.ground.errors import IdentityError


def _bundle_of(artifact: Path) -> Path:
    """The bundle a package (compressed ones through their FP32 package) was converted from."""
    path, seen = artifact, set()
    while not (path / WEIGHTS_NAME).exists():
        manifest = path / MANIFEST_NAME
        if path in seen or not manifest.exists():
            raise IdentityError(f"{artifact}: no bundle upstream ({manifest} is missing or leads back); "
                                "its FP32 weight bytes are what a stage's disk is counted in")
        seen.add(path)
        path = upstream_path(path, json.loads(manifest.read_text())["source"])
    return path


def weight_bytes(artifact: str | Path) -> int:
    """W: the model's FP32 weight bytes, whatever precision `artifact` holds them in: a CMF's
    tensors at 4 bytes each, a bundle's weights.safetensors, or that of a package's bundle."""
    from pipeline.ground.cmf import open_cmf

    artifact = Path(artifact)
    if artifact.is_file():
        with open_cmf(artifact) as cmf:
            return 4 * sum(math.prod(info.shape) for info in cmf.tensors.values())
    return (_bundle_of(artifact) / WEIGHTS_NAME).stat().st_size


def gate_logits_bytes(package_dir: str | Path, quality_text: str | Path) -> int:
    """L of a gate of the package at `package_dir`: float32 logits over the vocabulary for the
    quality windows' tokens (FP32's, held for the whole gate) and for one case on each side
    (the package's and the reference's, at most the context each)."""
    from pipeline.ground.text_roles import text_roles
    from pipeline.ground.tokenizer import tokenizer_from_artifact

    package_dir = Path(package_dir)
    manifest = json.loads((package_dir / MANIFEST_NAME).read_text())
    lines = Path(quality_text).read_text(encoding="utf-8").splitlines()
    quality = text_roles(lines, str(quality_text))["quality"]
    tokens = len(tokenizer_from_artifact(package_dir).encode(" ".join(quality)))
    return (tokens + 2 * manifest["package"]["context"]) * manifest["architecture"]["vocab_size"] * 4


def check_disk(stage: str, out_dir: str | Path, artifact: str | Path, *, units: int = 1, jobs: int = 1,
               quality_text: str | Path | None = None, logits_bytes: int = 0) -> None:
    """Refuse `stage` by name (NotEnoughDisk) unless its peak disk, counted from the model in
    `artifact` (and, for a gate, the logits of its package and `quality_text`), is free."""
    if quality_text is not None:
        logits_bytes = gate_logits_bytes(artifact, quality_text)
    require_disk(out_dir, DISK_NEEDS[stage], weight_bytes(artifact), logits_bytes=logits_bytes, units=units,
                 jobs=jobs)
