"""The references a package is gated against: the torch decoder (`TorchBackend`) with the
numerics the package intends, and with FP32's.

The FP32 reference model is the bundle's; a compressed package's is that model loaded with
the package's own weights, decoded from its constexpr ops by coremltools (`coreml.decoded`);
K/V are kept in the cache dtype of the package's kind (`coreml.kinds`: fp16 for stateful).
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from manifests.identity import MANIFEST_NAME, read_json, sha256_file


@dataclass(frozen=True)
class IntendedNumerics:
    """Everything the numerics a package intends are a function of; `intended_references`
    builds its reference from this and nothing else. The kind enters only through the cache
    dtype: the reference runs every kind's inputs the same way, so the fp16 stateless,
    chunk-KV and stateful packages of one conversion intend the same numerics, and their gates'
    quality records are one record (`pipeline.stages.gates.quality.quality_identity`).

    `mitigations`: the fp16 mitigations record (None for FP32 compute); `decoded_from`: the
    compressed package whose decoded weights replace the bundle's (None: the bundle's own)."""
    bundle: Path
    context: int
    precision: str
    compute_precision: str
    cache_dtype: np.dtype
    mitigations: dict | None
    decoded_from: Path | None
    recipe: str | None

    def identity(self) -> dict:
        """The fields as sha256 and values, the same on every machine the artifacts move to."""
        weights = "bundle" if self.decoded_from is None else _decoded_weights_identity(self.decoded_from)
        return {"bundle_manifest_sha256": sha256_file(self.bundle / MANIFEST_NAME), "context": self.context,
                "precision": self.precision, "cache_dtype": str(self.cache_dtype), "mitigations": self.mitigations,
                "weights": weights}


def _decoded_weights_identity(package_dir: Path) -> dict:
    """What a compressed package's decoded weights are a function of: its recipe (name and
    parameters) and the sha256 of its weight files, as its verified manifest records them. Not
    the program's file, whose metadata holds the conversion's date, nor the manifest's own
    sha256, which covers measured times."""
    manifest = read_json(package_dir / MANIFEST_NAME)
    return {"recipe": manifest["recipe"], "weight_files": {
        name: entry["sha256"] for name, entry in sorted(manifest["files"].items()) if name.endswith("weight.bin")}}


def intended_numerics(package_dir: Path, manifest: dict, bundle: Path) -> IntendedNumerics:
    """What the package at `package_dir` (its verified `manifest`, converted from `bundle`) intends.

    An fp16 package intends the fp16 reference (`pipeline.ground.models.fp16`: every op's
    output rounded to fp16, K/V fp16) of the model its conversion traced: the reference with
    the mitigations its manifest records (a compressed package: those of the package it was
    made from, whose weights, already rescaled, it decoded)."""
    from coreml.kinds import package_kind
    from coreml.manifest import COMPRESSED_FORMAT
    from coreml.precisions import package_precision
    from pipeline.stages.gates.lineage import upstream_of

    unit = package_precision(manifest["package"], package_dir)
    compressed = manifest["format"] == COMPRESSED_FORMAT
    fp16 = unit.compute_precision == "float16"
    mitigations = None
    if fp16:
        from pipeline.ground.models.fp16 import Fp16Mitigations

        base = upstream_of(package_dir, manifest)[1] if compressed else manifest
        mitigations = Fp16Mitigations.of_package(base, package_dir).to_record()
    cache_dtype = np.float16 if fp16 else package_kind(manifest["package"]["kind"], package_dir).cache_dtype(unit)
    return IntendedNumerics(Path(bundle), manifest["package"]["context"], unit.name, unit.compute_precision,
                            np.dtype(cache_dtype or np.float32), mitigations,
                            Path(package_dir) if compressed else None,
                            manifest["recipe"]["name"] if compressed else None)


def intended_references(package_dir: Path, manifest: dict, bundle: Path,
                        numerics: IntendedNumerics | None = None) -> tuple:
    """(the package's intended numerics, FP32's), both TorchBackends on the reference model of
    `bundle`; one and the same object for an FP32 package with a float32 cache. `numerics`: the
    package's `intended_numerics`, where the caller has them already."""
    from coreml.decoded import decoded_weights, hot_rows_head_norm
    from pipeline.ground.reference import load_reference
    from pipeline.ground.scratch import ScratchFile
    from pipeline.ground.torch_backend import TorchBackend

    numerics = numerics or intended_numerics(package_dir, manifest, bundle)
    fp32_model, args, _ = load_reference(bundle)
    context, compressed = numerics.context, numerics.decoded_from is not None
    fp32 = TorchBackend(fp32_model, args, context)
    if numerics.compute_precision == "float16":
        from pipeline.ground.models.fp16 import (Fp16MitigationError, Fp16Mitigations, fp16_reference,
                                                 mitigated_model, moved_gains)

        mitigations = Fp16Mitigations.from_record(numerics.mitigations)
        # A compressed package's decoded weights are the model's own tensors; the rest stay the bundle's map.
        decoded = decoded_weights(package_dir, ScratchFile()) if compressed else None
        model, _, _ = load_reference(bundle, replaced=decoded)
        if compressed and mitigations.residual_scale != 1.0:
            # Each gain the residual scale moved must be the package's own (a plain gain): the
            # bundle's (a Gemma w of 1 + w) read as one would run a different model.
            missing = [name for name in moved_gains(model) if name not in decoded]
            if missing:
                raise Fp16MitigationError(f"{package_dir}: the package holds no constant for {missing[0]} (and "
                                          f"{len(missing) - 1} more), a norm gain its residual scale moved")
        what = f"recipe {numerics.recipe}, decoded weights" if compressed else "bundle weights"
        mitigated = mitigated_model(model, args, mitigations, weights_scaled=compressed)
        del model
        return TorchBackend(fp16_reference(mitigated), args, context, cache_dtype=numerics.cache_dtype,
                            numerics=f"fp16 at op boundaries, {what}, mitigations {_mitigations_name(mitigations)}"), fp32
    if compressed:
        model, _, _ = load_reference(bundle, replaced=decoded_weights(package_dir, ScratchFile()))
        return TorchBackend(model.eval(), args, context, cache_dtype=numerics.cache_dtype,
                            numerics=f"recipe {numerics.recipe}, decoded weights",
                            hot_rows_head_norm=hot_rows_head_norm(package_dir)), fp32
    if numerics.cache_dtype == np.float16:
        return TorchBackend(fp32_model, args, context, cache_dtype=numerics.cache_dtype,
                            numerics="fp32, fp16 K/V cache"), fp32
    return fp32, fp32


def _mitigations_name(mitigations) -> str:
    if mitigations.is_none:
        return "none"
    parts = [f"residual x{mitigations.residual_scale:g}" if mitigations.residual_scale != 1.0 else None,
             f"{mitigations.rmsnorm} RMSNorm" if mitigations.rmsnorm != "plain" else None,
             f"mask {mitigations.mask_value:g}" if mitigations.mask_value is not None else None,
             "k bias past RoPE" if mitigations.key_bias != "plain" else None]
    return ", ".join(p for p in parts if p)
