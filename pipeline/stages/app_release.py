"""The app folder: what an app bundles from a release, and nothing else.

    app = make_app_release("dist/<model>-<recipe>")      # -> dist/<model>-<recipe>-app/

A release is the evidence: the package an app loads beside the FP32 packages it was made
from, every gate, and the survey. An app needs only the package, the tokenizer and the
descriptor. For the 1.5B Qwen that is 1.8 GB of an 11 GB release. The app folder is cut from a
verified release and bound to it by the release manifest's sha256. What the app ships can then
be traced to the release's gates without shipping them:

    dist/<model>-<recipe>-app/
      manifest.json    cmfdeploy.app_release/1: the files, the shipped package's entry as the
                       release records it (its gate's verdict and figures), the release's chain;
                       its source is the release
      metadata.json    the release's descriptor, its assets the shipped package's alone
      RELEASE.md       how to load it (the release's snippets, from this folder), its interface,
                       its gate's figures, and where the evidence is
      tokenizer/       the release's tokenizer files
      packages/<name>/ the package an app loads, at the path the release holds it

`verify_app_release` (registered for `cmfdeploy verify-artifact`) checks every file, the
package against its own manifest and against the entry, the tokenizer, and the descriptor. Where
the release is still at its recorded relative path, it also checks that the release ships this
entry; `verify_chain` goes on from there to the CMF.
"""

import shutil
from pathlib import Path

from coreml import manifest as package_manifest
from manifests.chain import upstream_path
from manifests.disk import require_copy_disk
from manifests.identity import (MANIFEST_NAME, Manifest, artifact_source, check_files, environment, inventory,
                                load_manifest, read_json, sha256_file, write_json)
from manifests.output import staged_output
from manifests.schema import validate
from pipeline.ground.errors import IdentityError
from pipeline.stages.backends import shipped_entry
from pipeline.stages.release_copies import check_package_entry
from pipeline.stages.release import (METADATA_NAME, TOKENIZER_DIR, interface_markdown, usage_markdown,
                                     verify_release)
from pipeline.stages.signing import sign_manifest

FORMAT = "cmfdeploy.app_release/1"
# The app folder's name: its release's, so the two sort side by side in dist/.
APP_SUFFIX = "-app"


def make_app_release(release_dir: str | Path, out_root: str | Path | None = None, *, force: bool = False,
                     sign_key: str | Path | None = None) -> Manifest:
    """Cut `out_root/<release name>-app/` (default: beside the release) from the release at
    `release_dir`, verified down to every byte first. `sign_key` signs its manifest as
    `cmfdeploy release --sign` signs a release's. Returns the app folder's manifest."""
    release = verify_release(release_dir)
    release_dir = release.path
    shipped = shipped_entry(release.data)
    out_dir = Path(out_root if out_root is not None else release_dir.parent) / f"{release_dir.name}{APP_SUFFIX}"
    require_copy_disk(out_dir, "app_release", shipped["size_bytes"], f"the package {shipped['name']}")
    with staged_output(out_dir, force) as staging:
        shutil.copytree(release_dir / shipped["path"], staging / shipped["path"])
        shutil.copytree(release_dir / TOKENIZER_DIR, staging / TOKENIZER_DIR)
        write_json(staging / METADATA_NAME, app_metadata(read_json(release_dir / METADATA_NAME), shipped))
        folder = f"dist/{out_dir.name}"
        (staging / "RELEASE.md").write_text(app_markdown(release.data, shipped, folder))
        manifest = {
            "format": FORMAT,
            "status": "incomplete",
            "source": artifact_source(release_dir, relative_to=out_dir),
            "model": release["model"],
            "recipe": release["recipe"],
            "interface": release["interface"],
            "special_tokens": release["special_tokens"],
            "architecture": release["architecture"],
            "tokenizer": release["tokenizer"],
            "shipped": shipped,
            "chain": release["chain"],
        }
        files = inventory(staging)
        manifest.update(files=files, environment=environment(package_manifest.ENVIRONMENT_PACKAGES),
                        inventory={"count": len(files), "total_bytes": sum(f["bytes"] for f in files.values())},
                        status="complete")
        validate(manifest, where=str(out_dir / MANIFEST_NAME))
        write_json(staging / MANIFEST_NAME, manifest)
        verify_app_release(staging)
        if sign_key is not None:
            sign_manifest(staging, sign_key)
    return Manifest(out_dir, manifest)


def app_metadata(release_metadata: dict, shipped: dict) -> dict:
    """The release's descriptor with its packages narrowed to the one the app loads."""
    packages = release_metadata["assets"]["packages"]
    return {**release_metadata, "assets": {**release_metadata["assets"],
                                           "packages": {shipped["name"]: packages[shipped["name"]]}}}


def app_markdown(release: dict, shipped: dict, folder: str) -> str:
    from pipeline.stages.report import md_table

    gate, summary = shipped["gate"], shipped["gate"]["summary"]
    return "\n".join([
        f"# {release['model']}: {release['recipe']}, the app's files",
        "",
        f"This folder is the package an app loads (`{shipped['path']}`, {shipped['size_bytes']} bytes), its "
        f"tokenizer and `metadata.json`, cut from the release `{Path(folder).name.removesuffix(APP_SUFFIX)}`. "
        "The evidence stays in the release: the FP32 packages this one was made from, every gate's report and "
        "the compression survey. This folder's manifest binds the release by its manifest's sha256, and "
        "`cmfdeploy verify-artifact` checks the binding wherever the release is beside it.",
        "",
        *usage_markdown(release, folder),
        *interface_markdown(release),
        "## Its gate",
        "",
        md_table(["package", "recipe", "gate backend", "max |Δ logit|", "allowed", "top-1 agreement", "KL mean max",
                  "passed"],
                 [[shipped["name"], gate["recipe"], gate["backend"], summary["max_abs"], f"{gate['tolerance']['atol']:.3g}",
                   summary["top1_agreement_min"], summary["kl_mean_max"], gate["passed"]]]),
        "## Identity chain",
        "",
        md_table(["link", "sha256", "bound by"], [[c["link"], f"`{c['sha256']}`", c["bound_by"]] for c in release["chain"]]),
        "",
    ])


def verify_app_release(path: str | Path, hashes: bool = True) -> Manifest:
    """Offline check of an app folder; IdentityError names the first file or field that differs."""
    path = Path(path)
    manifest = load_manifest(path, FORMAT)
    check_files(path, manifest["files"], hashes=hashes)
    where, shipped = path / MANIFEST_NAME, manifest["shipped"]
    package_dir = path / shipped["path"]
    package = package_manifest.verify_package(package_dir, hashes=hashes)
    if sha256_file(package_dir / MANIFEST_NAME) != shipped["manifest_sha256"]:
        raise IdentityError(f"{where}: field 'shipped.manifest_sha256' is {shipped['manifest_sha256']}, but "
                            f"{package_dir / MANIFEST_NAME} hashes to {sha256_file(package_dir / MANIFEST_NAME)}")
    check_package_entry(where, "shipped", shipped, package_dir, package.data)
    tokenizer = manifest.get("tokenizer")
    if tokenizer is not None:
        if sha256_file(path / TOKENIZER_DIR / package_manifest.TOKENIZER_JSON) != tokenizer["sha256"]:
            raise IdentityError(f"{where}: field 'tokenizer.sha256' differs from "
                                f"{path / TOKENIZER_DIR / package_manifest.TOKENIZER_JSON}")
        if (package.data.get("tokenizer") or {}).get("sha256") != tokenizer["sha256"]:
            raise IdentityError(f"{where}: field 'tokenizer.sha256' is not the tokenizer {package_dir} records")
    metadata = read_json(path / METADATA_NAME)
    if metadata["assets"]["packages"].keys() != {shipped["name"]} or metadata["compression"]["recipe"] != manifest["recipe"]:
        raise IdentityError(f"{path / METADATA_NAME}: names packages {sorted(metadata['assets']['packages'])} and recipe "
                            f"{metadata['compression']['recipe']!r}; this folder holds {shipped['name']!r} of recipe "
                            f"{manifest['recipe']!r}")
    release_dir = upstream_path(path, manifest["source"])
    if (release_dir / MANIFEST_NAME).is_file():
        if sha256_file(release_dir / MANIFEST_NAME) != manifest["source"]["manifest_sha256"]:
            raise IdentityError(f"{where}: field 'source.manifest_sha256' is not the manifest of the release at "
                                f"{release_dir}")
        if shipped_entry(read_json(release_dir / MANIFEST_NAME)) != shipped:
            raise IdentityError(f"{where}: field 'shipped' is not the entry the release at {release_dir} ships")
    return Manifest(path, manifest)
