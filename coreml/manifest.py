"""Manifests of Core ML package directories.

A package directory `out/<kind>/` holds `model.mlpackage` and `manifest.json`. The
manifest binds the package to what produced it: its source artifact (the bundle, or for
a compressed package the source package) by manifest sha256, the code (sha256 of its
files), the environment, and the saved program itself (interface, op histogram, bytes,
file inventory). Formats and required fields are fixed by
`manifests/schemas/{coreml,compressed}.schema.json`. `"status": "complete"` is written
last, so a manifest without it names a package that was never finished.
"""

from collections.abc import Iterable
from pathlib import Path


from manifests.identity import (
    MANIFEST_NAME,
    Manifest,
    canonical_json,
    check_files,
    environment,
    inventory,
    load_manifest,
    sha256_bytes,
    sha256_file,
    write_json,
)
from pipeline.errors import IdentityError

COREML_FORMAT = "cmfdeploy.coreml/1"
COMPRESSED_FORMAT = "cmfdeploy.compressed/1"
MODEL_NAME = "model.mlpackage"
ROOT = Path(__file__).resolve().parent.parent
# Distributions whose versions decide what a conversion or compression produces.
ENVIRONMENT_PACKAGES = ("cmfdeploy", "coremltools", "torch", "numpy", "safetensors", "protobuf")
BUNDLE_SHA_KEY = "cmfdeploy.bundle_manifest_sha256"


def source_digest(paths: Iterable[Path]) -> dict:
    """sha256 per source file (relative to the repository) and one sha256 over them all."""
    files = {Path(p).resolve().relative_to(ROOT).as_posix(): sha256_file(p) for p in paths}
    return {"files": dict(sorted(files.items())), "sha256": sha256_bytes(canonical_json(files))}


def op_histogram(mlpackage: Path) -> dict[str, dict[str, int]]:
    """Per function of the saved program: op type -> count, nested blocks included."""
    from coreml import crosscheck

    return crosscheck.op_histogram(crosscheck.read_program(mlpackage))


def package_bytes(mlpackage: Path) -> int:
    return sum(p.stat().st_size for p in Path(mlpackage).rglob("*") if p.is_file())


def set_model_metadata(mlmodel, *, description: str, license_: str, version: str, user: dict[str, str]) -> None:
    mlmodel.short_description = description
    mlmodel.author = "cmfdeploy"
    mlmodel.license = license_
    mlmodel.version = version
    mlmodel.user_defined_metadata.update(user)


def write_package_manifest(package_dir: Path, fields: dict) -> Manifest:
    """Complete `fields` with what the saved program says about itself; status goes last.

    The manifest is first written as "incomplete" so a crash leaves an unfinished mark,
    then rewritten (atomically) as "complete" once every file is in place.
    """
    package_dir = Path(package_dir)
    mlpackage = package_dir / MODEL_NAME
    manifest = {
        **fields,
        "op_histogram": op_histogram(mlpackage),
        "environment": environment(ENVIRONMENT_PACKAGES),
        "status": "incomplete",
    }
    write_json(package_dir / MANIFEST_NAME, manifest)
    manifest.update(files=inventory(package_dir), status="complete")
    write_json(package_dir / MANIFEST_NAME, manifest)
    return Manifest(package_dir, manifest)


def verify_package(path: str | Path, hashes: bool = True) -> Manifest:
    """A Core ML or compressed package directory whose manifest is complete, valid against
    its schema, whose files are exactly the recorded ones, and whose every claim the saved
    program states too agrees with it (`coreml.crosscheck`); else IdentityError."""
    from coreml.crosscheck import check_package

    path = Path(path)
    manifest = load_manifest(path)
    if manifest["format"] not in (COREML_FORMAT, COMPRESSED_FORMAT):
        raise IdentityError(
            f"{path / MANIFEST_NAME}: field 'format' is {manifest['format']!r}, "
            f"expected {COREML_FORMAT!r} or {COMPRESSED_FORMAT!r}"
        )
    check_files(path, manifest["files"], hashes=hashes)
    check_package(path, manifest)
    return Manifest(path, manifest)
