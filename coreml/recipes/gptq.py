"""GPTQ (`coreml.codes.gptq_affine`): affine block codes chosen column by column against
each linear's calibration inputs, E[x x^T] (coreml.calibration.Calibration.input_hessians).
A tied embedding is coded for its use as the head (its lookup has no inputs to weight by)."""

from dataclasses import dataclass

import numpy as np

from coreml import calibration, codes
from coreml.calibration import Calibration
from pipeline.ground.pages import release_pages
from coreml.recipes.affine import Affine
from coreml.recipes.base import (STORAGE, WEIGHT_THRESHOLD, CodeRecipe, Context, Encoder, Prepared, Weight,
                                 register_recipe)

GPTQ = {"hessian": "E[x x^T] of each linear's inputs on calibration text", "damp": codes.GPTQ_DAMP,
        "windows": calibration.HESSIAN_WINDOWS}


@dataclass(frozen=True)
class GptqAffine(Affine):
    """The affine grid, its codes chosen by GPTQ where the weight's Hessian is known (a
    weight without one keeps the plain min/max fit)."""

    # Each block's range searched (`codes._searched_parameters`), not its min/max.
    search_range: bool = False
    # Columns coded by descending H_jj, each block's grid fitted before any feedback.
    act_order: bool = False

    def record(self) -> dict:
        searched = {"range": {"searched": "shrinks of [min, max]", "shrinks": [float(p) for p in codes.RANGE_SHRINKS[[0, -1]]],
                              "steps": len(codes.RANGE_SHRINKS), "error_norm": codes.RANGE_NORM}}
        return {**super().record(), "gptq": GPTQ, **(searched if self.search_range else {}),
                **({"order": "descending H_jj, static groups"} if self.act_order else {})}

    def encode_for(self, value: np.ndarray, hessian: np.ndarray) -> codes.ShiftScale:
        return codes.gptq_affine(value, hessian, self.nbits, self.block_size, STORAGE[self.dtype],
                                 integer_offset=self.integer_offset, search_range=self.search_range,
                                 act_order=self.act_order)


@dataclass(frozen=True)
class GptqRecipe(CodeRecipe):
    """GPTQ codes for every selected weight whose step is a `GptqAffine` and that feeds a linear."""

    calibration = True

    def prepare(self, weights: list[Weight], context: Context) -> Prepared:
        return Prepared(self.select, self.encoders(weights, context.calibration(calibration.HESSIAN_WINDOWS)))

    def encoders(self, weights: list[Weight], calib: Calibration) -> dict[str, Encoder]:
        """MIL name -> the GPTQ encoder of each weight this recipe codes with a Hessian."""
        hessians = calib.input_hessians()
        encoders = {}
        for w in weights:
            step = self.steps(w)["code"]
            if w.hf_names and w.size > WEIGHT_THRESHOLD and isinstance(step, GptqAffine) and w.hf_names[0] in hessians:
                encoders[w.name] = lambda value, h=hessians[w.hf_names[0]], s=step: _coded(calib, s, value, h)
        return encoders


def _coded(calib: Calibration, step: GptqAffine, value: np.ndarray, hessian: np.ndarray) -> codes.ShiftScale:
    """`step`'s GPTQ code of `value` (from the shared cache where it is there), then the Hessian's
    pages dropped from the process (`pipeline.ground.pages`): a survey's Hessians are a map of
    1.04 GB on SmolLM2-135M (1.05 GB on Gemma 3), each read whole by one weight's coding, and
    otherwise they stayed resident in every GPTQ worker."""
    code = calib.cached_code(lambda: step.encode_for(value, hessian), step.record(), value, hessian)
    release_pages(hessian)
    return code


register_recipe(GptqRecipe("gptq-int4-b32", GptqAffine(4)))
# b64 stores 4 + 32/64 bits, the embedding's block of at least 96 at most 4 + 32/96, so that
# with the fp32 norms the whole model stays within 4.5 bits per weight (SmolLM2's 576-wide
# embedding per 96, Gemma 3's 640-wide per 128).
register_recipe(GptqRecipe("gptq-int4-b64", GptqAffine(4, 64), embedding=GptqAffine(4, 96, at_least=True)))
# The layers as gptq-int4-b64, the tied embedding/head at Q8_0's 8.5 bits (symmetric int8 per
# 32, fp16 scale): a higher width for the head alone, which is where a 4-bit model's top-1
# agreement goes (docs/COMPRESSION.md).
register_recipe(GptqRecipe("gptq-int4-b64-emb8", GptqAffine(4, 64), embedding=Affine(8, symmetric=True)))
# GPTQ as its reference implementation stores and runs it: a 4-bit zero point per block
# where the recipes above keep an fp16 offset (4.625 bits per 32, not 5), columns in act
# order with static groups, each block's range searched. The 12 bits saved a block buy the
# layers blocks of 32 and the tied embedding/head blocks of 64 within 4.5 bits per weight
# wherever the embedding is 40% of the model or more (Gemma 3: 4.43; SmolLM2, whose
# embedding is a fifth: 4.57). docs/COMPRESSION.md has what each choice is worth on Gemma 3.
ZERO_POINT = {"integer_offset": True, "search_range": True, "act_order": True}
register_recipe(GptqRecipe("gptq-int4-b32-zp", GptqAffine(4, 32, **ZERO_POINT),
                           embedding=GptqAffine(4, 64, at_least=True, **ZERO_POINT)))
