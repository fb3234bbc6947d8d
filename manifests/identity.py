"""Artifact identity: streamed sha256, file inventories, canonical JSON, safe paths.

Every stage output is a directory whose `manifest.json` lists each file with its byte
count and sha256. These helpers are the only place that hashes files, writes manifests
or turns a recorded name back into a path, so every stage checks identity the same way.
"""

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path, PurePosixPath

from manifests.output import staged_file, unfinished_output
from pipeline.ground.errors import IdentityError

MANIFEST_NAME = "manifest.json"
# A detached signature over the manifest (pipeline.stages.signing); it cannot be in the inventory it signs.
SIGNATURE_NAME = MANIFEST_NAME + ".sig"

@dataclass(frozen=True)
class Manifest:
    """A stage output: its folder and its manifest as a dict (read-only by convention)."""

    path: Path
    data: dict

    @property
    def format(self) -> str:
        return self.data["format"]

    def __getitem__(self, key: str):
        return self.data[key]


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, streamed through one reused buffer (never the whole file in memory)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_identity(path: str | Path) -> dict:
    """`{"bytes", "sha256"}` of one file, as every manifest records it."""
    path = Path(path)
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def inventory(root: str | Path, exclude: tuple[str, ...] = (MANIFEST_NAME,)) -> dict[str, dict]:
    """Every regular file under `root` by relative POSIX name -> `{"bytes", "sha256"}`.

    Symlinks and other non-regular entries are refused: an artifact is plain files, and a
    link would let the recorded hash describe bytes that live outside the artifact.
    """
    root = Path(root)
    files = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise IdentityError(f"{root}: entry {name!r} is not a regular file or folder")
        if path.is_file() and name not in exclude:
            files[name] = file_identity(path)
    return files


def canonical_json(obj) -> bytes:
    """The one byte form of a manifest: sorted keys, 2-space indent, UTF-8, newline-terminated.

    NaN and infinities are refused (they are not JSON, and a manifest must round-trip).
    """
    return (json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_json(path: str | Path, obj) -> None:
    """Write `obj` as canonical JSON atomically: temp file in the same folder, fsync, rename."""
    with staged_file(path) as f:
        f.write(canonical_json(obj))


def read_json(path: str | Path) -> dict:
    """A JSON object from `path`; anything else is an IdentityError naming the file."""
    path = Path(path)
    try:
        obj = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise IdentityError(f"{path}: file not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise IdentityError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(obj, dict):
        raise IdentityError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def resolve_inside(root: str | Path, name: str) -> Path:
    """The path of a recorded relative `name` under `root`, refusing any escape.

    Absolute names, `..` components and symlinks that resolve outside `root` all raise
    IdentityError: manifests are input, and a crafted one must not make a verifier read
    (or a stage overwrite) a file elsewhere.
    """
    pure = PurePosixPath(name)
    if not name or pure.is_absolute() or "\\" in name or (pure.parts and ":" in pure.parts[0]):
        raise IdentityError(f"{root}: recorded name {name!r} is not a relative path")
    if ".." in pure.parts:
        raise IdentityError(f"{root}: recorded name {name!r} contains '..'")
    base = Path(root).resolve()
    resolved = (base / pure).resolve()
    if not resolved.is_relative_to(base):
        raise IdentityError(f"{root}: recorded name {name!r} resolves outside the artifact, to {resolved}")
    return resolved


def is_recorded_file(path: str | Path) -> bool:
    """Whether a path a manifest records names a file here; a name the OS cannot even look
    up (too long, a NUL byte) names none."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def environment(packages: tuple[str, ...] = ("cmfdeploy", "numpy", "safetensors", "torch", "tokenizers", "gguf")) -> dict:
    """Interpreter, platform and the versions of the packages that shaped an artifact."""
    python, system, versions = _environment(packages)
    return {"python": python, "platform": system, "packages": dict(versions)}


# Installed versions cannot change under a running process, and reading package metadata
# parses every METADATA file (tens of ms): once per process is enough.
@cache
def _environment(packages: tuple[str, ...]) -> tuple[str, str, tuple[tuple[str, str | None], ...]]:
    import platform
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return platform.python_version(), platform.platform(), tuple((name, version(name)) for name in packages)


def relative_path(target: str | Path, folder: str | Path) -> str:
    """`target` as a POSIX path relative to `folder`: how artifacts name each other, so that no
    manifest or report names a path of the machine it was built on. Both are resolved, so the
    relative path is the one the filesystem walks, symlinks included."""
    return Path(os.path.relpath(Path(target).resolve(), Path(folder).resolve())).as_posix()


def portable_name(target: str | Path, folder: str | Path) -> str:
    """How a report names an input it does not walk to (the source CMF, the reference fixtures):
    its path relative to `folder` when the two share a folder below the filesystem root (a build
    tree beside its fixtures), else only its file name, which the recorded sha256 identifies:
    a relative path that climbs to the root would spell out the build machine's layout."""
    target, folder = Path(target).resolve(), Path(folder).resolve()
    if Path(os.path.commonpath([target, folder])) == Path(target.anchor):
        return target.name
    return relative_path(target, folder)


def artifact_source(artifact_dir: str | Path, relative_to: str | Path | None = None) -> dict:
    """The `source` record that binds a manifest to the finished artifact it was built from.

    `relative_to` is the folder the binding manifest will finally live in (not a staging
    folder it is written in first). From it the record holds `relative_path`, by which
    `manifests.chain` finds the upstream wherever the whole tree has moved, and no absolute
    path (an artifact copied to another machine must not carry the build machine's paths).
    Without it (a record not yet placed) the record holds the absolute `path`.
    """
    artifact_dir = Path(artifact_dir)
    source = {
        "kind": "artifact",
        "format": load_manifest(artifact_dir)["format"],
        "manifest_sha256": sha256_file(artifact_dir / MANIFEST_NAME),
    }
    if relative_to is None:
        source["path"] = str(artifact_dir.resolve())
    else:
        source["relative_path"] = relative_path(artifact_dir, relative_to)
    return source


def cmf_source(cmf) -> dict:
    """The `source` record of a manifest built straight from an open CMF (`pipeline.ground.cmf.CmfFile`):
    every file's size and sha256 and the envelope hashes, as `manifests.chain` re-checks them."""
    paths = [Path(p) for p in cmf.paths]
    identities = [file_identity(p) for p in paths]
    source = {
        "kind": "cmf",
        "path": str(paths[0].resolve()),
        "file": paths[0].name,
        **identities[0],
        "header_hash": f"{cmf.envelope.header_hash:016x}",
        "dir_hash": f"{cmf.envelope.dir_hash:016x}",
        "required_features": cmf.required_features,
        "verified_tensors": len(cmf.tensors),
    }
    if len(paths) > 1:
        source["shards"] = [{"file": p.name, **ident} for p, ident in zip(paths, identities)]
    return source


def load_manifest(root: str | Path, format_name: str | None = None) -> dict:
    """The manifest of the artifact at `root`: valid against its schema, of `format_name`
    when given, `"status": "complete"` (anything else is a half-written artifact), and at
    its final name (`manifests.output.unfinished_output`)."""
    from manifests.schema import validate

    path = Path(root) / MANIFEST_NAME
    manifest = read_json(path)
    if format_name is not None and manifest.get("format") != format_name:
        raise IdentityError(f"{path}: field 'format' is {manifest.get('format')!r}, expected {format_name!r}")
    # Before the schema: a half-written manifest lacks fields, and "not finished" is the real story.
    if manifest.get("status") != "complete":
        raise IdentityError(f"{path}: field 'status' is {manifest.get('status')!r}: the artifact was not finished")
    final = unfinished_output(root)
    if final is not None:
        raise IdentityError(f"{Path(root)}: the staging (or set-aside) folder of {final}, left by a run that did not "
                            "finish: an output is complete only at its final name")
    validate(manifest, where=str(path))
    return manifest


def check_files(root: str | Path, recorded: dict[str, dict], hashes: bool = True) -> None:
    """The files under `root` are exactly `recorded`, with the recorded sizes (and sha256
    when `hashes`); the first difference raises IdentityError naming the file."""
    root = Path(root)
    for name in recorded:
        resolve_inside(root, name)
    present = {path.relative_to(root).as_posix() for path in root.rglob("*") if not path.is_dir()}
    present -= {MANIFEST_NAME, SIGNATURE_NAME}
    unexpected = sorted(present - recorded.keys())
    if unexpected:
        raise IdentityError(f"{root}: unexpected file {unexpected[0]!r} (not in the manifest's 'files')")
    missing = sorted(recorded.keys() - present)
    if missing:
        raise IdentityError(f"{root}: file {missing[0]!r} listed in the manifest is missing")
    for name, entry in recorded.items():
        path = root / name
        if path.is_symlink():
            raise IdentityError(f"{root}: file {name!r} is a symlink; artifacts hold plain files only")
        check_file(path, entry, hashes, where=f"{root}: file {name!r}")


def check_file(path: Path, entry: dict, hashes: bool, where: str) -> None:
    """`path` has the recorded `bytes` (and `sha256` when `hashes`); `where` opens the error."""
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise IdentityError(f"{where} has {size} bytes, the manifest records {entry['bytes']}")
    if hashes:
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise IdentityError(f"{where} has sha256 {digest}, the manifest records {entry['sha256']}")
