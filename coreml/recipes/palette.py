"""K-means palettes (`coreml.codes.kmeans_tiles`): one LUT per tile of 32 output rows x 32
input columns. palette6-gc32 and palette4-gc32; palette4-int8lut, whose fp32 LUT coremltools
then quantizes to int8 (joint compression); palette4-skm, each error weighted by the
calibration inputs' second moments."""

from dataclasses import dataclass, field
from functools import partial

import coremltools.optimize.coreml as cto
import numpy as np
from coremltools.optimize.coreml._quantization_passes import linear_quantize_weights as LinearQuantizeWeights

from coreml import codes
from coreml.cache import ResultCache
from coreml.recipes.base import (STORAGE, WEIGHT_THRESHOLD, Code, CodeRecipe, Context, Prepared, Step, Weight,
                                 describe_params, register_recipe)
from coreml.recipes.linear import Quantize

# Output rows x input columns that share one palette LUT (see coreml.codes.kmeans_tiles).
PALETTE_TILE = (32, 32)


@dataclass(frozen=True)
class Kmeans(Code):
    """One LUT of 2**nbits entries per tile; `importance` says what weights its errors, if anything."""

    nbits: int
    tile: tuple[int, int] = PALETTE_TILE
    dtype: str = "fp16"
    importance: str | None = None

    def record(self) -> dict:
        return {"kind": "kmeans", "nbits": self.nbits, "tile": list(self.tile), "dtype": self.dtype,
                **({"importance": self.importance} if self.importance else {})}

    def bits(self, shape: tuple[int, ...]) -> float:
        tiles = shape[0] // self.tile[0] * (shape[1] // self.tile[1])
        return int(np.prod(shape)) * self.nbits + tiles * (1 << self.nbits) * (16 if self.dtype == "fp16" else 32)

    def encode(self, value: np.ndarray, importance: np.ndarray | None = None,
               cache: ResultCache | None = None) -> codes.Palette:
        return codes.kmeans_tiles(value, self.nbits, self.tile, importance, STORAGE[self.dtype], cache)


@dataclass(frozen=True)
class PaletteRecipe(CodeRecipe):
    """A k-means palette, whose centres a survey's other palettes of the same bits and tiles share
    (`codes.kmeans_tiles`' cache: palette4-gc32's and palette4-int8lut's differ in the LUT's dtype only)."""

    def prepare(self, weights: list[Weight], context: Context) -> Prepared:
        cache = context.results()
        if cache is None:
            return Prepared(self.select)
        return Prepared(self.select, {w.name: partial(self.steps(w)["code"].encode, cache=cache) for w in weights})


@dataclass(frozen=True)
class QuantizedLutRecipe(PaletteRecipe):
    """A palette whose LUT coremltools' linear quantizer then stores (joint compression)."""

    quantize_lut: Quantize = field(kw_only=True)

    def params(self) -> dict:
        return {**super().params(), "quantize_lut": self.quantize_lut.record()}

    def describe(self, steps: dict[str, Step]) -> str:
        how = super().describe(steps)
        if isinstance(steps.get("code"), Kmeans):
            how += f" + LUT {describe_params(self.quantize_lut.record())}"
        return how

    def after_codes(self, program) -> None:
        """Quantize the LUT of each palette the code steps wrote, by name: a global config would
        quantize every other constant over the threshold too (the parts of a split head, a
        weight the recipe left as it was)."""
        lut = cto.OpLinearQuantizerConfig(**self.quantize_lut.record())
        luts = {op.lut.op.name: lut for function in program.functions.values()
                for op in function.find_ops(op_type="constexpr_lut_to_dense") if op.lut.op.op_type == "const"}
        quantize_luts = LinearQuantizeWeights(cto.OptimizationConfig(global_config=None, op_name_configs=luts))
        quantize_luts.joint_compression = True
        quantize_luts.apply(program)


@dataclass(frozen=True)
class WeightedPaletteRecipe(CodeRecipe):
    """SKM: each weight's palette fit weights its errors by E[x_j^2] of the inputs of the
    linear it feeds, on calibration text (coreml.calibration.Calibration.input_moments)."""

    calibration = True

    def prepare(self, weights: list[Weight], context: Context) -> Prepared:
        moments = context.calibration().input_moments()
        return Prepared(self.select, {
            w.name: partial(self.code.encode, importance=moments[w.hf_names[0]])
            for w in weights if w.hf_names and w.size > WEIGHT_THRESHOLD and w.hf_names[0] in moments})


register_recipe(PaletteRecipe("palette6-gc32", Kmeans(6)))
register_recipe(PaletteRecipe("palette4-gc32", Kmeans(4)))
register_recipe(QuantizedLutRecipe("palette4-int8lut", Kmeans(4, dtype="fp32"),
                                   quantize_lut=Quantize("int8", granularity="per_tensor", block_size=None)))
register_recipe(WeightedPaletteRecipe("palette4-skm", Kmeans(4, importance="calibration input second moments")))
