"""A gated package's lineage, resolved once per gate from the one walk of its chain.

    lineage = resolve_lineage("out/packages/int8-b32")
    lineage.fp32_dir, lineage.bundle, lineage.source_cmf_sha256

A compressed package comes from an FP32 package, an FP32 package from a bundle, a bundle
from a CMF. The gate needs every step: the package's manifest (kind, context, recipe), the
bundle (the reference model and the tokenizer), the source CMF's sha256 (the fixtures must
be of it). `pipeline.stages.artifacts.verify_chain` verifies every link and hands back the
manifests it read, so nothing here reads one again.
"""

from dataclasses import dataclass
from pathlib import Path

from manifests.chain import Link, upstream_path
from manifests.identity import load_manifest
from pipeline.stages.artifacts import verify_chain


def upstream_of(package_dir: Path, manifest: dict, load=load_manifest) -> tuple[Path, dict, Path]:
    """(the FP32 package a package was made from, that package's manifest, the bundle it was
    converted from): the package itself for an FP32 one. `load` reads an upstream manifest."""
    from coreml.manifest import COMPRESSED_FORMAT

    fp32_dir, fp32_manifest = Path(package_dir), manifest
    if manifest["format"] == COMPRESSED_FORMAT:
        fp32_dir = upstream_path(package_dir, manifest["source"])
        fp32_manifest = load(fp32_dir)
    return fp32_dir, fp32_manifest, upstream_path(fp32_dir, fp32_manifest["source"])


@dataclass(frozen=True)
class Lineage:
    """The package at `package_dir` and everything upstream of it, verified by `chain`."""
    package_dir: Path
    manifest: dict
    fp32_dir: Path
    fp32_manifest: dict
    bundle: Path
    source_cmf_sha256: str
    chain: tuple[Link, ...]

    @property
    def kind(self) -> str:
        return self.manifest["package"]["kind"]

    @property
    def recipe(self) -> str:
        return self.manifest.get("recipe", {}).get("name", "fp32")


def resolve_lineage(package_dir) -> Lineage:
    """Verify the chain of the package at `package_dir` to its CMF and resolve its lineage
    from the manifests the walk read."""
    package_dir = Path(package_dir)
    chain = tuple(verify_chain(package_dir))
    walked = {Path(link.path): link.manifest.data for link in chain if link.manifest is not None}

    def load(path: Path) -> dict:
        # An upstream the walk found no manifest of: loading it raises what is missing.
        return walked[path] if path in walked else load_manifest(path)

    manifest = walked[package_dir]
    fp32_dir, fp32_manifest, bundle = upstream_of(package_dir, manifest, load)
    return Lineage(package_dir, manifest, fp32_dir, fp32_manifest, bundle, load(bundle)["source"]["sha256"], chain)
