"""Manifests of Core ML package directories.

A package directory `out/<kind>/` holds `model.mlpackage` and `manifest.json`. The
manifest binds the package to what produced it: its source artifact (the bundle, or for
a compressed package the source package) by manifest sha256, the code (sha256 of its
files), the environment, and the saved program itself (interface, op histogram, bytes,
file inventory). The package carries its tokenizer (`tokenizer.json`, `tokenizer_config.json`),
copied from its source and recorded under `tokenizer` with the bundle's tokenizer identity, so
a package folder alone turns text into ids. Formats and required fields are fixed by
`manifests/schemas/{coreml,compressed}.schema.json`. `"status": "complete"` is written
last, so a manifest without it names a package that was never finished.
"""

import contextlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from coreml import crosscheck
from coreml.split import program_views
from manifests.chain import upstream_path
from manifests.identity import (
    MANIFEST_NAME,
    Manifest,
    canonical_json,
    check_file,
    check_files,
    environment,
    inventory,
    load_manifest,
    sha256_bytes,
    sha256_file,
    write_json,
)
from pipeline.ground.errors import IdentityError

COREML_FORMAT = "cmfdeploy.coreml/1"
COMPRESSED_FORMAT = "cmfdeploy.compressed/1"
MODEL_NAME = "model.mlpackage"
ROOT = Path(__file__).resolve().parent.parent
# Distributions whose versions decide what a conversion or compression produces.
ENVIRONMENT_PACKAGES = ("cmfdeploy", "coremltools", "torch", "numpy", "safetensors", "protobuf")
TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"


def source_digest(paths: Iterable[Path]) -> dict:
    """sha256 per source file (relative to the repository) and one sha256 over them all."""
    files = {Path(p).resolve().relative_to(ROOT).as_posix(): sha256_file(p) for p in paths}
    return {"files": dict(sorted(files.items())), "sha256": sha256_bytes(canonical_json(files))}


def op_histogram(mlpackage: Path) -> dict[str, dict[str, int]]:
    """Per function of the saved program: op type -> count, nested blocks included."""
    return crosscheck.op_histogram(crosscheck.read_program(mlpackage))


def package_bytes(mlpackage: Path) -> int:
    return sum(p.stat().st_size for p in Path(mlpackage).rglob("*") if p.is_file())


def programs_bytes(package_dir: Path, manifest: dict) -> int:
    """The bytes of a package folder's programs: its .mlpackage, or a split package's pieces."""
    return sum(package_bytes(Path(package_dir) / name) for name, _ in program_views(manifest))


def pieces_sha256(manifest: dict) -> list[str]:
    """Each piece's sha256 of a split package, in chain order: over the names and sha256s of its
    files (the package's inventory, names relative to the piece) as canonical JSON, so an app can
    check the piece it loads without reading the others."""
    digests = []
    for name, _ in program_views(manifest):
        prefix = f"{name}/"
        files = {path[len(prefix):]: record["sha256"] for path, record in manifest["files"].items()
                 if path.startswith(prefix)}
        digests.append(sha256_bytes(canonical_json(dict(sorted(files.items())))))
    return digests


def fp32_weight_bytes(manifest: dict) -> int:
    """The model's weight bytes as its FP32 package holds them (a compressed package's base):
    what a process running any package of the model is bounded by (`workers.job_memory`)."""
    return manifest["base_size_bytes"] if "base_size_bytes" in manifest else manifest["package_bytes"]


def set_model_metadata(mlmodel, *, description: str, license_: str, version: str, user: dict[str, str]) -> None:
    mlmodel.short_description = description
    mlmodel.author = "cmfdeploy"
    mlmodel.license = license_
    mlmodel.version = version
    mlmodel.user_defined_metadata.update(user)


@contextlib.contextmanager
def working_files_in(folder: Path) -> Iterator[None]:
    """coremltools' working files, for the span of the block, in `folder`: a stage's staging
    folder. coremltools writes a program's weights, and the package a conversion, merge or
    compression makes, in the temp folder, and removes a temporary package only at interpreter
    exit: a process killed between making a package and saving it left hundreds of MB there for
    good. A staging folder goes with its stage, or with the next run of the same output
    (`manifests.output`). Stages run their conversions one at a time in a process, so pointing
    `tempfile` at the folder reaches every file coremltools makes."""
    folder.mkdir(parents=True, exist_ok=True)
    before = tempfile.tempdir
    tempfile.tempdir = str(folder)
    try:
        yield
    finally:
        tempfile.tempdir = before


def save_model(mlmodel, mlpackage: Path) -> None:
    """Save `mlmodel` at `mlpackage`, and remove the temporary package coremltools made it in
    (in `working_files_in`'s folder, or the temp folder), at once rather than at exit."""
    mlmodel.save(str(mlpackage))
    discard_model(mlmodel)


def discard_model(mlmodel) -> None:
    """Remove the temporary package coremltools made `mlmodel` in, if it made one. coremltools
    removes one when its MLModel is collected on macOS only; elsewhere it stays until exit, and a
    multifunction package's functions, each made over a copy of the weights inside a staging
    folder, were listed and shipped as part of every compressed stateful package (two fp16
    copies of its weights in each piece's folder)."""
    if getattr(mlmodel, "is_temp_package", False):
        shutil.rmtree(mlmodel.package_path, ignore_errors=True)


def carry_tokenizer(source_dir: str | Path, package_dir: str | Path) -> dict | None:
    """Copy the tokenizer files of a package's source artifact (the bundle, or the package a
    compressed one was made from) into `package_dir`; the manifest's `tokenizer` record.

    The record is the source's own (`{sha256, bytes, has_config}`, as the bundle recorded it
    from the CMF), checked against the bytes copied, so every package down the chain names the
    bundle's tokenizer identity. None when the bundle has no tokenizer. Call it before the
    manifest is written: the inventory then lists the copies with their sha256.
    """
    source_dir, package_dir = Path(source_dir), Path(package_dir)
    identity = load_manifest(source_dir).get("tokenizer")
    if identity is None:
        return None
    check_file(source_dir / TOKENIZER_JSON, identity, hashes=True,
               where=f"{source_dir}: tokenizer {TOKENIZER_JSON!r} (manifest field 'tokenizer')")
    names = (TOKENIZER_JSON, TOKENIZER_CONFIG) if identity["has_config"] else (TOKENIZER_JSON,)
    package_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(source_dir / name, package_dir / name)
    return {key: identity[key] for key in ("sha256", "bytes", "has_config")}


def check_tokenizer(path: Path, manifest: dict) -> None:
    """The package's tokenizer files are the ones its `tokenizer` record names (the inventory
    has already checked their bytes), and that record is its source's when the source is at hand."""
    record, files = manifest.get("tokenizer"), manifest["files"]
    where = path / MANIFEST_NAME
    if record is None:
        if TOKENIZER_JSON in files:
            raise IdentityError(f"{where}: files list {TOKENIZER_JSON!r} but field 'tokenizer' is missing")
        return
    if files.get(TOKENIZER_JSON, {}).get("sha256") != record["sha256"]:
        raise IdentityError(f"{where}: field 'tokenizer.sha256' {record['sha256']} does not match "
                            f"files[{TOKENIZER_JSON!r}]")
    if record["has_config"] != (TOKENIZER_CONFIG in files):
        raise IdentityError(f"{where}: field 'tokenizer.has_config' is {record['has_config']}, but "
                            f"{TOKENIZER_CONFIG!r} is {'not ' if record['has_config'] else ''}in files")
    upstream = upstream_path(path, manifest["source"])
    if (upstream / MANIFEST_NAME).is_file():
        recorded = (load_manifest(upstream).get("tokenizer") or {}).get("sha256")
        if recorded != record["sha256"]:
            raise IdentityError(f"{where}: field 'tokenizer.sha256' is {record['sha256']}, but its source "
                                f"{upstream} records tokenizer sha256 {recorded}")


def check_preflight(path: Path, manifest: dict) -> None:
    """The preflight report an fp16 package's manifest binds (`numerics.preflight`) is, where it
    is at hand, the report by sha256; a package copied without it (a release) still verifies."""
    record = manifest.get("numerics", {}).get("preflight")
    if record is None:
        return
    report = path / record["path"]
    if report.is_file() and sha256_file(report) != record["sha256"]:
        raise IdentityError(f"{path / MANIFEST_NAME}: field 'numerics.preflight.sha256' is {record['sha256']}, but "
                            f"{report} has sha256 {sha256_file(report)}")


def write_package_manifest(package_dir: Path, fields: dict, histogram: dict | None = None) -> Manifest:
    """Complete `fields` with what the saved program says about itself (the op `histogram` of a
    split package's pieces together where given); status goes last.

    The manifest is first written as "incomplete" so a crash leaves an unfinished mark,
    then rewritten (atomically) as "complete" once every file is in place.
    """
    package_dir = Path(package_dir)
    mlpackage = package_dir / MODEL_NAME
    manifest = {
        **fields,
        "op_histogram": op_histogram(mlpackage) if histogram is None else histogram,
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
    path = Path(path)
    manifest = load_manifest(path)
    if manifest["format"] not in (COREML_FORMAT, COMPRESSED_FORMAT):
        raise IdentityError(
            f"{path / MANIFEST_NAME}: field 'format' is {manifest['format']!r}, "
            f"expected {COREML_FORMAT!r} or {COMPRESSED_FORMAT!r}"
        )
    check_files(path, manifest["files"], hashes=hashes)
    check_tokenizer(path, manifest)
    check_preflight(path, manifest)
    crosscheck.check_package(path, manifest, from_bundle=manifest["format"] == COREML_FORMAT)
    return Manifest(path, manifest)
