"""coremltools' own linear quantizer (`linear_quantize_weights`, int8 per block of 32) and
the recipes built on it: int8-b32, and int8-b32-embfp16 with the tied embedding/head in fp16."""

from dataclasses import dataclass

import numpy as np
from coremltools.optimize.coreml._quantization_passes import linear_quantize_weights as quantizer

from coreml.recipes.base import EMBEDDING, WEIGHT_THRESHOLD, Code, Step, StepRecipe, Weight, register_recipe

MODE = "linear_symmetric"


@dataclass(frozen=True)
class Quantize(Step):
    """coremltools' OpLinearQuantizerConfig, symmetric: a scale per block (`per_block`) or per
    tensor (`per_tensor`: `block_size` None)."""

    kind = "quantize"
    dtype: str
    granularity: str = "per_block"
    block_size: int | None = 32

    def record(self) -> dict:
        return {"mode": MODE, "dtype": self.dtype, "granularity": self.granularity,
                **({"block_size": self.block_size} if self.block_size else {}), "weight_threshold": WEIGHT_THRESHOLD}

    def bits(self, shape: tuple[int, ...]) -> float:
        """One scale per block, in the weight's fp32."""
        n = int(np.prod(shape))
        return n * int(self.dtype.removeprefix("int")) + n / self.block_size * 32

    def encode(self, value: np.ndarray) -> np.ndarray:
        """`value` through coremltools' own blockwise quantizer and back (what its step stores)."""
        packed = quantizer.blockwise_compress(value, int(self.dtype.removeprefix("int")), MODE.upper(), True,
                                              [1, self.block_size])
        return quantizer.decompress(packed).astype(np.float32)


@dataclass(frozen=True)
class Fp16(Code):
    """The weight itself at half size, behind constexpr_cast."""

    def record(self) -> dict:
        return {"kind": "fp16"}

    def bits(self, shape: tuple[int, ...]) -> float:
        return 16 * int(np.prod(shape))

    def encode(self, value: np.ndarray) -> np.ndarray:
        return value.astype(np.float16)


@dataclass(frozen=True)
class LinearRecipe(StepRecipe):
    """coremltools' quantizer on every selected weight; the tied embedding/head in fp16 if asked."""

    quantize: Quantize
    fp16_embedding: bool = False

    def params(self) -> dict:
        return {"quantize": self.quantize.record(), **({"embedding": "fp16"} if self.fp16_embedding else {})}

    def steps(self, weight: Weight) -> dict[str, Step]:
        if self.fp16_embedding and EMBEDDING in weight.hf_names:
            return {"code": Fp16()}
        return {"quantize": self.quantize}


register_recipe(LinearRecipe("int8-b32", Quantize("int8")))
register_recipe(LinearRecipe("int8-b32-embfp16", Quantize("int8"), fp16_embedding=True))
