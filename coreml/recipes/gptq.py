"""GPTQ (`coreml.codes.gptq_affine`): affine block codes chosen column by column against
each linear's calibration inputs, E[x x^T] (coreml.calibration.Calibration.input_hessians).
A tied embedding is coded for its use as the head (its lookup has no inputs to weight by)."""

from dataclasses import dataclass

import numpy as np

from coreml import calibration, codes
from coreml.calibration import Calibration
from coreml.recipes.affine import Affine
from coreml.recipes.base import (STORAGE, WEIGHT_THRESHOLD, CodeRecipe, Context, Encoder, Prepared, Weight,
                                 register_recipe)

GPTQ = {"hessian": "E[x x^T] of each linear's inputs on calibration text", "damp": codes.GPTQ_DAMP,
        "windows": calibration.HESSIAN_WINDOWS}


@dataclass(frozen=True)
class GptqAffine(Affine):
    """The affine grid, its codes chosen by GPTQ where the weight's Hessian is known (a
    weight without one keeps the plain min/max fit)."""

    def record(self) -> dict:
        return {**super().record(), "gptq": GPTQ}

    def encode_for(self, value: np.ndarray, hessian: np.ndarray) -> codes.ShiftScale:
        return codes.gptq_affine(value, hessian, self.nbits, self.block_size, STORAGE[self.dtype])


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
                encoders[w.name] = lambda value, h=hessians[w.hf_names[0]], s=step: s.encode_for(value, h)
        return encoders


register_recipe(GptqRecipe("gptq-int4-b32", GptqAffine(4)))
# b64 stores 4 + 32/64 bits, the embedding's block of at least 96 at most 4 + 32/96, so that
# with the fp32 norms the whole model stays within 4.5 bits per weight (SmolLM2's 576-wide
# embedding per 96, Gemma 3's 640-wide per 128).
register_recipe(GptqRecipe("gptq-int4-b64", GptqAffine(4, 64), embedding=GptqAffine(4, 96, at_least=True)))
# The layers as gptq-int4-b64, the tied embedding/head at Q8_0's 8.5 bits (symmetric int8 per
# 32, fp16 scale): a higher width for the head alone, which is where a 4-bit model's top-1
# agreement goes (docs/COMPRESSION.md).
register_recipe(GptqRecipe("gptq-int4-b64-emb8", GptqAffine(4, 64), embedding=Affine(8, symmetric=True)))
