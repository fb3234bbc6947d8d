"""The cmf-native recipe: a quantized CMF's own codes and scales, as Core ML constexpr ops
that decode to exactly the CMF's values, read through the package's identity chain.

    cmf_path = source_cmf(package_dir, manifest)       # package -> bundle -> CMF record
    code, why = native_code(cmf, "model.layers.0.mlp.up_proj.weight")

What each CMF dtype becomes (spec: /work/shared/CMF-V2.md; decoders: pipeline.ground.cmf.dtypes):

- `q4_block`, `q4_tiled`: `(q - 8) * f16 scale` per 32. Written as int4 data `q - 8` (no
  offset needed: the codes already are int4) with the scale widened to an fp32 scale per
  block. The op computes `data * scale` in its scale's dtype; an int4 times an fp16 scale
  has at most 4 + 11 significant bits, so the fp32 product is exact, as is the CMF
  decoder's fp32 product: equal bit for bit on every machine. An fp16 scale would make the
  op multiply in fp16, where 15 significant bits do not fit 11: so the scale is stored in
  fp32, and the package spends 5.0 bits per weight where the CMF spends 4.5.
- `q8_row`: int8 codes with the row's fp16 scale widened to fp32, one per output row
  (8 + 11 bits: exact in fp32). 8 + 32/cols bits per weight.
- `f16`: the half values behind `constexpr_cast` to fp32 (exact: every half is a float).
- `f32`: nothing to carry but the float32 itself: left as it is.
- every other dtype (vbit, vbit_ro, q8_2f, q1*, q4tp, q2tp, u8, bf16): no encoder here;
  the weight stays the FP32 constant the package already holds (lossless, uncompressed),
  and the selection record says so.

Only a tensor whose CMF decode equals the package's constant bit for bit is carried: a
bundle baked with a task mask or a skill holds other values, and those are refused.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coreml.codes import ShiftScale
from coreml.recipes.base import (WEIGHT_THRESHOLD, Code, Context, Prepared, Recipe, RecipePrecondition, Selected,
                                 Weight, carried, register_recipe, whole_tensors)
from manifests.chain import upstream_path
from manifests.identity import read_json, MANIFEST_NAME
from pipeline.ground.cmf import dtype_by_name, open_cmf
from pipeline.ground.cmf.dtypes import GROUP

EXACT_DTYPES = ("q4_block", "q4_tiled", "q8_row", "f16")


def source_cmf(package_dir: Path, manifest: dict) -> Path | None:
    """The CMF file the package's chain starts from (package -> bundle -> CMF), or None."""
    here, source = Path(package_dir), manifest["source"]
    while source.get("kind") == "artifact":
        try:
            here = upstream_path(here, source)
        except Exception:  # an upstream that moved away: the caller refuses with the path
            return None
        source = read_json(here / MANIFEST_NAME)["source"]
    path = Path(source.get("path", ""))
    return path if source.get("kind") == "cmf" and path.is_file() else None


def native_code(cmf, name: str):
    """(code, None) for a tensor with an exact encoding, else (None, why it stays FP32).

    A code is a `coreml.codes.ShiftScale` or a float16 array (for constexpr_cast).
    """
    info = cmf.info(name)
    dtype = info.dtype.name
    if dtype not in EXACT_DTYPES:
        return None, (f"CMF dtype {dtype}: nothing to carry beyond float32" if dtype == "f32" else
                      f"CMF dtype {dtype}: no exact Core ML encoding here; kept as the package's FP32 constant")
    if len(info.shape) != 2:
        return None, f"CMF dtype {dtype}: rank {len(info.shape)}, not a matrix"
    rows, cols = info.shape
    parts = cmf.parts(name)
    if dtype == "f16":
        return np.asarray(parts["values"]).reshape(rows, cols), None
    if dtype == "q8_row":
        return ShiftScale(parts["q"], parts["scale"].astype(np.float32)[:, None], None, 8, True), None
    if cols % GROUP:  # blocks of 32 run over the flattened tensor: they straddle rows
        return None, f"CMF dtype {dtype}: {cols} columns, blocks of {GROUP} straddle rows"
    nibbles = parts["nibbles"]
    q = np.stack([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, cols).astype(np.int8) - 8
    return ShiftScale(q, parts["scales"].astype(np.float32).reshape(rows, cols // GROUP), None, 4, True), None


@dataclass(frozen=True)
class Native(Code):
    """The CMF's own code of one tensor; the recipe carries it (`carried`), nothing is fitted."""

    cmf_dtype: str

    def record(self) -> dict:
        return {"kind": "cmf-native", "cmf_dtype": self.cmf_dtype}

    def bits(self, shape: tuple[int, ...]) -> float:
        """What the CMF stores for a tensor of `shape` in this dtype (its size rule)."""
        return 8.0 * dtype_by_name(self.cmf_dtype).fixed_nbytes(tuple(shape))

    def encode(self, value: np.ndarray) -> object:
        # The codes are the CMF's own: the recipe hands each weight's code over (`carried`),
        # and no code can be fitted to a value without the file it came from.
        raise RecipePrecondition(f"step cmf-native ({self.cmf_dtype}): codes come from the source CMF, "
                                 "not from a value")


@dataclass(frozen=True)
class NativeRecipe(Recipe):
    """Every tensor the CMF stores in an `EXACT_DTYPES` dtype, at its own codes; the rest stays FP32."""

    def params(self) -> dict:
        return {"cmf_native": {"exact": list(EXACT_DTYPES), "other dtypes": "kept FP32"}}

    def prepare(self, weights: list[Weight], context: Context) -> Prepared:
        whole_tensors(self.name, weights)
        native = _native_plan(context.package_dir, context.manifest, weights)

        def select(weight: Weight) -> Selected:
            code, why, dtype = native.get(weight.name, (None, "no tensor of this name in the CMF", None))
            if code is None:
                return Selected({}, {"compressed": False, "reason": why, "cmf_dtype": dtype})
            return Selected({"code": Native(dtype)}, {
                "compressed": True, "how": f"CMF-native {dtype}: the CMF's own codes and scales, exact",
                "cmf_dtype": dtype})

        return Prepared(select, {n: carried(n, code, code.decode() if hasattr(code, "decode") else
                                            code.astype(np.float32))
                                 for n, (code, _, _) in native.items() if code is not None})


def _native_plan(package_dir: Path, source: dict, weights: list[Weight]) -> dict[str, tuple]:
    """MIL name -> (code or None, why, CMF dtype) from the CMF the package's chain starts from."""
    path = source_cmf(package_dir, source)
    if path is None:
        raise RecipePrecondition(f"{package_dir}: recipe cmf-native needs the source CMF, and the package's chain "
                                 f"(package -> bundle -> CMF record) does not reach a CMF file")
    with open_cmf(path) as cmf:
        return {w.name: native_code(cmf, w.hf_names[0]) + (cmf.info(w.hf_names[0]).dtype.name,)
                for w in weights if w.hf_names and w.size > WEIGHT_THRESHOLD and w.hf_names[0] in cmf.tensors}


register_recipe(NativeRecipe("cmf-native"))
