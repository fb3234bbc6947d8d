"""The references a package is gated against: the torch decoder (`TorchBackend`) with the
numerics the package intends, and with FP32's.

The FP32 reference model is the bundle's; a compressed package's is that model loaded with
the package's own weights, decoded from its constexpr ops by coremltools (`coreml.decoded`);
K/V are kept in the cache dtype of the package's kind (`coreml.kinds`: fp16 for stateful).
"""

from pathlib import Path

import numpy as np


def intended_references(package_dir: Path, manifest: dict, bundle: Path) -> tuple:
    """(the package's intended numerics, FP32's), both TorchBackends on the reference model of
    `bundle`; one and the same object for an FP32 package with a float32 cache.

    An fp16 package intends the fp16 reference (`pipeline.ground.models.fp16`: every op's
    output rounded to fp16, K/V fp16) of the model its conversion traced: the reference with
    the mitigations its manifest records (a compressed package: those of the package it was
    made from, whose weights, already rescaled, it decoded)."""
    from coreml.decoded import decoded_weights, hot_rows_head_norm
    from coreml.kinds import package_kind
    from coreml.manifest import COMPRESSED_FORMAT
    from coreml.precisions import package_precision
    from pipeline.ground.reference import load_reference
    from pipeline.ground.scratch import ScratchFile
    from pipeline.ground.torch_backend import TorchBackend
    from pipeline.stages.gates.lineage import upstream_of

    fp32_model, args, _ = load_reference(bundle)
    kind, context = manifest["package"]["kind"], manifest["package"]["context"]
    fp32 = TorchBackend(fp32_model, args, context)
    unit = package_precision(manifest["package"], package_dir)
    cache_dtype = package_kind(kind, package_dir).cache_dtype(unit) or np.float32
    compressed = manifest["format"] == COMPRESSED_FORMAT
    if unit.compute_precision == "float16":
        from pipeline.ground.models.fp16 import Fp16Mitigations, fp16_reference, mitigated_model

        base = upstream_of(package_dir, manifest)[1] if compressed else manifest
        record = base.get("numerics", {}).get("mitigations")
        mitigations = Fp16Mitigations() if record is None else Fp16Mitigations.from_record(
            record["record"], f"{package_dir}: field 'numerics.mitigations.record'")
        # A compressed package's decoded weights are the model's own tensors; the rest stay the bundle's map.
        model, _, _ = load_reference(bundle, replaced=decoded_weights(package_dir, ScratchFile()) if compressed else None)
        what = f"recipe {manifest['recipe']['name']}, decoded weights" if compressed else "bundle weights"
        mitigated = mitigated_model(model, args, mitigations, weights_scaled=compressed)
        del model
        return TorchBackend(fp16_reference(mitigated), args, context, cache_dtype=np.float16,
                            numerics=f"fp16 at op boundaries, {what}, mitigations {_mitigations_name(mitigations)}"), fp32
    if compressed:
        model, _, _ = load_reference(bundle, replaced=decoded_weights(package_dir, ScratchFile()))
        return TorchBackend(model.eval(), args, context, cache_dtype=cache_dtype,
                            numerics=f"recipe {manifest['recipe']['name']}, decoded weights",
                            hot_rows_head_norm=hot_rows_head_norm(package_dir)), fp32
    if cache_dtype == np.float16:
        return TorchBackend(fp32_model, args, context, cache_dtype=cache_dtype, numerics="fp32, fp16 K/V cache"), fp32
    return fp32, fp32


def _mitigations_name(mitigations) -> str:
    if mitigations.is_none:
        return "none"
    parts = [f"residual x{mitigations.residual_scale:g}" if mitigations.residual_scale != 1.0 else None,
             f"{mitigations.rmsnorm} RMSNorm" if mitigations.rmsnorm != "plain" else None,
             f"mask {mitigations.mask_value:g}" if mitigations.mask_value is not None else None]
    return ", ".join(p for p in parts if p)
