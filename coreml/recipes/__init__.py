"""Compression recipes for Core ML packages: registered units, one module per family.

    manifest = compress_package("out/chunk_kv", "int4-b32", "out/chunk_kv-int4-b32")
    manifest = compress_package(pkg, "mixed", out, calibration_ids=ids, bpw=4.5)

A recipe (`base.Recipe`) is a typed, registered unit that records its params verbatim in
the manifest and gives each weight its steps: codes computed in numpy (`coreml.codes`;
written as iOS18 constexpr ops by `emit`) or coremltools 9.0 `linear_quantize_weights`.
The families: `linear` (coremltools int8 per block), `affine` (affine and symmetric block
codes), `palette` (k-means LUTs, their int8-quantized LUTs, sensitivity-weighted and GPTQ-chosen ones),
`gptq`, `hot_rows` (GPTQ, the tied table's most read rows corrected at int8), `mixed` (a
per-layer choice among the others under a size budget), `cmf_native`
(the source CMF's own codes). `compress` applies any of them. docs/COMPRESSION.md gives what
each recipe stores and the SmolLM2 measurements behind the choices.

What is compressed is decided here, not by coremltools defaults: a constant is a candidate
only if it is a bundle weight (the conversion manifest maps program constants to HF tensor
names) with more than `WEIGHT_THRESHOLD` elements. Each candidate's precondition
(block/group size divides the right axis; consumers are ops whose axes we know) is checked
up front and a failure raises `RecipePrecondition` naming the weight. The manifest's
`selection` records, for every constant, whether it was compressed, how, and if not, why.
"""

from coreml.recipes import affine, cmf_native, gptq, hot_rows, linear, mixed, palette  # noqa: F401 (each registers its recipes)
from coreml.recipes.base import (EMBEDDING, RECIPES, WEIGHT_THRESHOLD, Context, Prepared, Recipe, RecipePrecondition,
                                 Selected, StepRecipe, UnknownRecipe, Weight, order_recipes,
                                 register_recipe)
from coreml.recipes.compress import apply_recipe, compress_package, load_program, plan_selection, program_weights
from coreml.recipes.emit import emit_code
from coreml.recipes.mixed import MIXED_BPW, choose_mixed

# The order surveys and reports list the recipes in: the order they were added in.
order_recipes(("int8-b32", "int4-b32", "int4-b32-emb8", "palette6-gc32", "palette4-gc32", "int8-b32-embfp16",
               "palette4-int8lut", "palette4-skm", "mixed", "cmf-native", "gptq-int4-b32", "gptq-int4-b64",
               "int8-b32-fp16scale", "gptq-int4-b64-emb8", "int8-pc", "gptq-int4-b32-zp",
               "gptq-int4-b32-zp-hot", "palette4-gptq-gc32", "palette4-gptq-gc32-emb8x32",
               "palette4-gptq-g8-head6", "palette6-gptq-g16", "mixed-palette", "mixed-palette-6",
               "palette4-gptq-g32-pcs", "palette6-gptq-g16-pcs"))

__all__ = ["EMBEDDING", "MIXED_BPW", "RECIPES", "WEIGHT_THRESHOLD", "Context", "Prepared", "Recipe",
           "RecipePrecondition", "Selected", "StepRecipe", "UnknownRecipe", "Weight", "apply_recipe", "choose_mixed",
           "compress_package", "emit_code", "load_program", "plan_selection", "program_weights", "register_recipe"]
