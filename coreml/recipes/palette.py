"""K-means palettes (`coreml.codes.kmeans_tiles`): one LUT per tile of 32 output rows x 32
input columns. palette6-gc32 and palette4-gc32; palette4-int8lut, whose fp32 LUT coremltools
then quantizes to int8 (joint compression); palette4-skm, each error weighted by the
calibration inputs' second moments; and the GPTQ palettes (`coreml.codes.gptq_palette`), whose
codes GPTQ chooses against each linear's calibration Hessian with the LUT as the grid, per
32 x 32 tile or per group of output rows across all columns, the tied embedding/head at 4 or
6 bits, each row's entries scaled by its own max |w| in the `-pcs` ones. Every one is a
`constexpr_lut_to_dense` of scalar LUTs, then a per-channel `constexpr_blockwise_shift_scale`
where rows are scaled: both the Neural Engine reads (`coreml.ane.weight_compression`)."""

from dataclasses import dataclass, field, replace
from functools import partial

import coremltools.optimize.coreml as cto
import numpy as np
from coremltools.optimize.coreml._quantization_passes import linear_quantize_weights as LinearQuantizeWeights

from coreml import codes
from coreml.cache import ResultCache
from coreml.calibration import Calibration
from coreml.recipes.base import (STORAGE, WEIGHT_THRESHOLD, Code, CodeRecipe, Context, Encoder, Prepared, Step, Weight,
                                 describe_params, register_recipe)
from coreml.recipes.gptq import GPTQ, GptqRecipe, _coded
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
    row_scale: bool = False  # each row's entries times its max |w| (`codes.row_scales`)

    def record(self) -> dict:
        return {"kind": "kmeans", "nbits": self.nbits, "tile": list(self.tile), "dtype": self.dtype,
                **({"importance": self.importance} if self.importance else {}),
                **({"row_scale": "max |w| per row"} if self.row_scale else {})}

    def bits(self, shape: tuple[int, ...]) -> float:
        tiles = shape[0] // self.tile[0] * (shape[1] // self.tile[1])
        width = 16 if self.dtype == "fp16" else 32
        return (int(np.prod(shape)) * self.nbits + tiles * (1 << self.nbits) * width
                + (shape[0] * width if self.row_scale else 0))

    def encode(self, value: np.ndarray, importance: np.ndarray | None = None,
               cache: ResultCache | None = None) -> codes.Palette:
        return codes.kmeans_tiles(value, self.nbits, self.tile, importance, STORAGE[self.dtype], cache, self.row_scale)


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

    def after_codes(self, program) -> bool:
        """Quantize the LUT of each palette the code steps wrote, by name: a global config would
        quantize every other constant over the threshold too (the parts of a split head, a
        weight the recipe left as it was). The palettes then decode through coremltools' int8
        LUTs, not the ones the recipe wrote."""
        lut = cto.OpLinearQuantizerConfig(**self.quantize_lut.record())
        luts = {op.lut.op.name: lut for function in program.functions.values()
                for op in function.find_ops(op_type="constexpr_lut_to_dense") if op.lut.op.op_type == "const"}
        quantize_luts = LinearQuantizeWeights(cto.OptimizationConfig(global_config=None, op_name_configs=luts))
        quantize_luts.joint_compression = True
        quantize_luts.apply(program)
        return bool(luts)


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


@dataclass(frozen=True)
class GptqKmeans(Kmeans):
    """One LUT per `tile`, its codes chosen by GPTQ where the weight's Hessian is known
    (`codes.gptq_palette`: H_jj-weighted k-means LUTs, GPTQ's assignment in act order, the LUTs
    refitted by least squares on the full H, `rounds` times); a weight without one keeps the
    data-free k-means. A tile of (rows, None) is `rows` output rows across all the columns
    (coremltools' grouped-channel palette)."""

    importance: str | None = "H_jj of the calibration Hessian (the LUTs' k-means start)"
    rounds: int = 2  # of GPTQ's assignment and the LUTs' refit

    def record(self) -> dict:
        return {**super().record(), "gptq": {**GPTQ, "order": "descending H_jj"}, "rounds": self.rounds,
                "refit": "LUT entries by least squares on the full Hessian"}

    def for_shape(self, shape: tuple[int, ...]) -> "GptqKmeans":
        return replace(self, tile=(self.tile[0], shape[1])) if self.tile[1] is None and len(shape) == 2 else self

    def encode_for(self, value: np.ndarray, hessian: np.ndarray) -> codes.Palette:
        return codes.gptq_palette(value, hessian, self.nbits, self.tile, STORAGE[self.dtype], rounds=self.rounds,
                                  row_scale=self.row_scale)


@dataclass(frozen=True)
class GptqPaletteRecipe(GptqRecipe):
    """GPTQ palettes for every selected weight that feeds a linear (the tied embedding as the
    head), on the GPTQ recipes' Hessians and through their shared cache of codes."""

    def encoders(self, weights: list[Weight], calib: Calibration) -> dict[str, Encoder]:
        hessians = calib.input_hessians()
        return {w.name: partial(_coded, calib, self.steps(w)["code"], hessian=hessians[w.hf_names[0]])
                for w in weights if w.hf_names and w.size > WEIGHT_THRESHOLD and w.hf_names[0] in hessians
                and isinstance(self.steps(w)["code"], GptqKmeans)}


register_recipe(PaletteRecipe("palette6-gc32", Kmeans(6)))
register_recipe(PaletteRecipe("palette4-gc32", Kmeans(4)))
register_recipe(QuantizedLutRecipe("palette4-int8lut", Kmeans(4, dtype="fp32"),
                                   quantize_lut=Quantize("int8", granularity="per_tensor", block_size=None)))
register_recipe(WeightedPaletteRecipe("palette4-skm", Kmeans(4, importance="calibration input second moments")))
# The GPTQ palettes (docs/COMPRESSION.md, 2026-12-06, says what each ingredient bought). Per
# 32 x 32 tile, as palette4-gc32 stores it: 4.25 bits per weight; the tied embedding/head, whose
# 4-bit code costs the most per weight, per tile of 8 rows x 32 columns: 4 + 256/256 = 5.0
# bits, 4.42 bits per weight on SmolLM2, where it is a fifth of the model.
register_recipe(GptqPaletteRecipe("palette4-gptq-gc32", GptqKmeans(4)))
register_recipe(GptqPaletteRecipe("palette4-gptq-gc32-emb8x32", GptqKmeans(4), embedding=GptqKmeans(4, (8, 32))))
# Per 8 output rows across all columns (coremltools' grouped-channel palette): a 16-entry fp16
# LUT is 32 bits a row, 4 + 32/cols bits (4.05 on SmolLM2's 576- and 1536-wide inputs), which
# leaves the tied embedding/head 6 bits per 16 rows (6 + 64/576) within 4.5 bits per weight.
register_recipe(GptqPaletteRecipe("palette4-gptq-g8-head6", GptqKmeans(4, (8, None)),
                                  embedding=GptqKmeans(6, (16, None))))
# 6 bits per 16 output rows across all columns, the tied embedding/head alike: a 64-entry fp16
# LUT is 1024 bits a band, 6 + 64/cols bits (6.11 on SmolLM2's 576-wide inputs, 6.04 on its
# 1536-wide ones). The mixed palettes' wide option (coreml.recipes.mixed).
register_recipe(GptqPaletteRecipe("palette6-gptq-g16", GptqKmeans(6, (16, None))))
# With each row's max |w| as its scale (coremltools' palette with per-channel scale: a
# `constexpr_blockwise_shift_scale` of the LUT's output, 16 bits a row), rows of different
# ranges share one LUT of their normalised values. On SmolLM2-135M's calibration Hessians it
# cut the output error of 6-bit palettes per 16 rows to 0.33-0.73x, of the tied table to 0.50x,
# and a 4-bit LUT per 32 rows across all columns (4 + 24/cols bits: 4.04 on SmolLM2's
# 576-wide inputs) erred 0.74-0.96x what palette4-gptq-gc32's 32 x 32 tiles do at 4.25 bits
# (docs/COMPRESSION.md). The tied table keeps 32 x 32 tiles under its row scales (4.25 + 16/cols):
# its source grids are per block of columns (Q4_1, Q6_K), and on SmolLM2 its calibration KL was
# 0.039 against 0.071 per 8 rows across all columns, row-scaled, and 0.051 unscaled.
register_recipe(GptqPaletteRecipe("palette4-gptq-g32-pcs", GptqKmeans(4, (32, None), row_scale=True),
                                  embedding=GptqKmeans(4, row_scale=True)))
register_recipe(GptqPaletteRecipe("palette6-gptq-g16-pcs", GptqKmeans(6, (16, None), row_scale=True)))
