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
    `bundle`; one and the same object for an FP32 package with a float32 cache."""
    from coreml.decoded import decoded_weights
    from coreml.kinds import package_kind
    from coreml.manifest import COMPRESSED_FORMAT
    from pipeline.ground.reference import load_reference
    from pipeline.ground.torch_backend import TorchBackend

    fp32_model, args, _ = load_reference(bundle)
    kind, context = manifest["package"]["kind"], manifest["package"]["context"]
    fp32 = TorchBackend(fp32_model, args, context)
    cache_dtype = package_kind(kind, package_dir).cache_dtype or np.float32
    if manifest["format"] == COMPRESSED_FORMAT:
        # The decoded weights are the model's own tensors; the rest stay the bundle's mapped pages.
        model, _, _ = load_reference(bundle, replaced=decoded_weights(package_dir))
        return TorchBackend(model.eval(), args, context, cache_dtype=cache_dtype,
                            numerics=f"recipe {manifest['recipe']['name']}, decoded weights"), fp32
    if cache_dtype == np.float16:
        return TorchBackend(fp32_model, args, context, cache_dtype=cache_dtype, numerics="fp32, fp16 K/V cache"), fp32
    return fp32, fp32
