"""Compression recipes for Core ML packages: one table, one function that applies a row.

    manifest = compress_package("out/chunk_kv", "int4-b32", "out/chunk_kv-int4-b32")
    manifest = compress_package(pkg, "mixed", out, calibration_ids=ids, bpw=4.5)

A recipe's `code` steps compute their codes in numpy (`coreml.codes`: affine blocks,
k-means LUT tiles; `coreml.cmf_native`: the source CMF's own codes) and a graph pass
writes them as iOS18 constexpr ops (`emit_code`); its `quantize` steps go through
coremltools 9.0 `linear_quantize_weights` (and the LUT of `palette4-int8lut` through its
joint compression). docs/COMPRESSION.md gives what each recipe stores and the SmolLM2
measurements behind the choices. What is compressed is decided here, not by coremltools
defaults: a constant is a candidate only if it is a bundle
weight (the conversion manifest maps program constants to HF tensor names) with more
than `WEIGHT_THRESHOLD` elements. Each candidate's precondition (block/group size
divides the right axis; consumers are ops whose axes we know) is checked up front and a
failure raises `RecipePrecondition` naming the weight; afterwards the saved program is
checked to hold a decompression op for every selected weight, because coremltools itself
only logs a warning and skips a weight it cannot compress.

The manifest's `selection` records, for every constant, whether it was compressed, how,
and if not, why.
"""

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import coremltools as ct
import coremltools.optimize.coreml as cto
import numpy as np
from coremltools.converters.mil.mil import Builder as mb
from coremltools.converters.mil.mil import types
from coremltools.converters.mil.converter import mil_convert
from coremltools.converters.mil.frontend.milproto import load as milproto
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
from coremltools.models.utils import _convert_model_spec_to_pymil_prog
from coremltools.optimize.coreml._quantization_passes import linear_quantize_weights as LinearQuantizeWeights

from coreml import calibration, cmf_native, codes
from coreml.calibration import Calibration
from coreml import manifest as package_manifest
from manifests.identity import Manifest, artifact_source
from manifests.output import refuse_existing, staged_output
from pipeline.ground.errors import CmfdeployError, UnsupportedModel

WEIGHT_THRESHOLD = 2048
EMBEDDING = "model.embed_tokens.weight"
# Ops whose weight axes are (output 0, input 1), as coremltools' own axis inference has it.
WEIGHT_CONSUMERS = ("linear", "gather")


def _linear(dtype: str) -> dict:
    return {"mode": "linear_symmetric", "dtype": dtype, "granularity": "per_block", "block_size": 32,
            "weight_threshold": WEIGHT_THRESHOLD}


GPTQ = {"hessian": "E[x x^T] of each linear's inputs on calibration text", "damp": codes.GPTQ_DAMP,
        "windows": calibration.HESSIAN_WINDOWS}
# Output rows x input columns that share one palette LUT (see coreml.codes.kmeans_tiles).
PALETTE_TILE = [32, 32]


def _affine(nbits: int, block: int = 32) -> dict:
    return {"kind": "affine", "nbits": nbits, "block_size": block, "dtype": "fp16"}


def _symmetric(nbits: int, block: int = 32) -> dict:
    return {"kind": "symmetric", "nbits": nbits, "block_size": block, "dtype": "fp16"}


def _palette(nbits: int) -> dict:
    return {"kind": "kmeans", "nbits": nbits, "tile": PALETTE_TILE, "dtype": "fp16"}


# name -> params, recorded verbatim in the manifest. Keys: `quantize` (coremltools
# OpLinearQuantizerConfig), `code` (codes computed by coreml.codes and written by
# emit_code: `affine` min/max per block with fp16 scale and offset, `symmetric` absmax per
# block with an fp16 scale and signed codes, `kmeans` one fp16 LUT
# per tile of 32 output rows x 32 input columns), `embedding` (the tied embedding/head's own
# step: "fp16" behind constexpr_cast, or a `code`), `quantize_lut` (joint: the palette's LUT
# quantized after palettization), `mixed` (per-layer choice among recipes, from measured
# sensitivity under a size budget). docs/COMPRESSION.md gives the measurements behind each.
RECIPES: dict[str, dict] = {
    "int8-b32": {"quantize": _linear("int8")},
    "int4-b32": {"code": _affine(4)},
    # The grid a Q4_1/Q8_0 GGUF import carries: the layers' affine uint4 per 32 (fp16 scale
    # and offset, as Q4_1 stores them) and the tied embedding/head's int8 per 32 with an fp16
    # scale (Q8_0's own), 5.0 and 8.5 bits. docs/COMPRESSION.md: the 4-bit head is what costs
    # int4-b32 its top-1 agreement.
    "int4-b32-emb8": {"code": _affine(4), "embedding": _symmetric(8)},
    "palette6-gc32": {"code": _palette(6)},
    "palette4-gc32": {"code": _palette(4)},
    "int8-b32-embfp16": {"quantize": _linear("int8"), "embedding": "fp16"},
    "palette4-int8lut": {
        "code": {**_palette(4), "dtype": "fp32"},
        "quantize_lut": {"mode": "linear_symmetric", "dtype": "int8", "granularity": "per_tensor",
                         "weight_threshold": WEIGHT_THRESHOLD},
    },
    "palette4-skm": {"code": {**_palette(4), "importance": "calibration input second moments"},
                     "calibration": True},
    "mixed": {"mixed": {"options": ["palette4-gc32", "int4-b32", "int8-b32"], "group": "decoder layer (embedding on its own)",
                        "measure": "calibration logit KL, one group coded at a time"},
              "calibration": True},
    "cmf-native": {"cmf_native": {"exact": list(cmf_native.EXACT_DTYPES), "other dtypes": "kept FP32"}},
    # GPTQ against every linear's inputs; a tied embedding is coded for its use as the head
    # (its lookup has no inputs to weight by). b64 stores 4 + 32/64 bits, the embedding's b96
    # 4 + 32/96, so that with the fp32 norms the whole model stays within 4.5 bits per weight.
    "gptq-int4-b32": {"code": {**_affine(4), "gptq": GPTQ}, "calibration": True},
    "gptq-int4-b64": {"code": {**_affine(4, 64), "gptq": GPTQ}, "embedding": {**_affine(4, 96), "gptq": GPTQ},
                      "calibration": True},
}
# Default budget of the mixed recipe in bits per weight, counted as mlx-lm and Core ML count
# (every stored byte of codes, scales, offsets and LUTs, x 8, over the parameter count).
MIXED_BPW = 4.5


class RecipePrecondition(CmfdeployError):
    """A recipe cannot be applied as written to this package (never silently skipped)."""


class UnknownRecipe(CmfdeployError):
    """The recipe name is not in the table."""


@dataclass(frozen=True)
class Weight:
    """A constant of the program: its MIL name, the HF names it carries, shape and consumers."""

    name: str
    hf_names: tuple[str, ...]
    shape: tuple[int, ...]
    consumers: tuple[str, ...]  # op types
    uses: tuple[tuple[str, str], ...]  # (consumer op name, input parameter) pairs

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def group(self) -> str:
        """The decoder layer (`layers.3`) this weight belongs to, or its own name."""
        name = self.hf_names[0] if self.hf_names else self.name
        parts = name.split(".")
        return ".".join(parts[1:3]) if parts[:2] == ["model", "layers"] else name


def load_program(mlmodel):
    """The package's MIL program, loaded once: the weights are listed from it and every step
    of a recipe rewrites it in place."""
    return _convert_model_spec_to_pymil_prog(mlmodel, mlmodel.get_spec().specificationVersion, milproto.load)


def program_weights(program, weight_names: Mapping[str, list[str]]) -> list[Weight]:
    """Every array constant of the program (nested blocks included), with the HF names the
    conversion recorded."""
    def constants(block):
        for op in block.operations:
            for inner in op.blocks:
                yield from constants(inner)
            if op.op_type == "const" and isinstance(op.val.val, np.ndarray) and op.val.val.size:
                yield op

    weights = []
    for function in program.functions.values():
        for op in constants(function):
            consumers = {id(child): child for child in op.outputs[0].child_ops}.values()
            weights.append(Weight(
                op.name, tuple(weight_names.get(op.name, ())), tuple(op.val.val.shape),
                tuple(sorted({child.op_type for child in consumers})),
                tuple((child.name, param) for child in consumers for param, var in child.inputs.items()
                      if var is op.outputs[0])))
    return weights


def _precondition(weight: Weight, step: str, params: dict) -> str | None:
    """Why `params` cannot compress `weight`, or None when it can."""
    unknown = sorted(set(weight.consumers) - set(WEIGHT_CONSUMERS))
    if unknown or len(weight.shape) != 2:
        return f"rank {len(weight.shape)}, consumers {list(weight.consumers)}: axes unknown for ops {unknown}"
    if "block_size" in params and weight.shape[1] % params["block_size"]:
        return f"input axis {weight.shape[1]} not divisible by block_size {params['block_size']}"
    for axis, size in enumerate(params.get("tile", ())):
        if weight.shape[axis] % size:
            return f"{('output', 'input')[axis]} axis {weight.shape[axis]} not divisible by LUT tile {size}"
    return None


def weight_steps(params: dict, weight: Weight) -> dict[str, dict]:
    """The steps (`quantize`: coremltools, `code`: coreml.codes) a recipe's params give `weight`."""
    embedding = params.get("embedding")
    if embedding is not None and EMBEDDING in weight.hf_names:
        return {"code": {"kind": "fp16"} if embedding == "fp16" else embedding}
    return {k: v for k, v in params.items() if k in ("quantize", "code")}


def plan_selection(weights: list[Weight], recipe: str, choices: Mapping[str, str] | None = None,
                   native: Mapping[str, tuple] | None = None) -> dict:
    """Which weights each step of `recipe` compresses; raises `RecipePrecondition`.

    `choices` (mixed) maps a weight's group to the recipe it takes; `native` (cmf-native)
    maps a MIL name to (code or None, why not, CMF dtype). Returns
    `{"steps": {step: {mil_name: params}}, "record": {...}}` where the record lists every
    constant with what happens to it and why.
    """
    params = RECIPES[recipe]
    steps: dict[str, dict[str, dict]] = {}
    record, below = {}, []
    for weight in weights:
        if weight.size <= WEIGHT_THRESHOLD:
            below.append(weight)
            continue
        entry = {"hf_names": list(weight.hf_names), "shape": list(weight.shape), "consumers": list(weight.consumers)}
        record[weight.name] = entry
        if not weight.hf_names:
            entry.update(compressed=False, reason="not a bundle weight (structural constant of the graph)")
            continue
        if native is not None:
            code, why, dtype = native.get(weight.name, (None, "no tensor of this name in the CMF", None))
            if code is None:
                entry.update(compressed=False, reason=why, cmf_dtype=dtype)
            else:
                steps.setdefault("code", {})[weight.name] = {"kind": "cmf-native", "cmf_dtype": dtype}
                entry.update(compressed=True, how=f"CMF-native {dtype}: the CMF's own codes and scales, exact",
                             cmf_dtype=dtype)
            continue
        chosen = RECIPES[choices[weight.group]] if choices else params
        step_params = weight_steps(chosen, weight)
        for step, config in step_params.items():
            reason = _precondition(weight, step, config)
            if reason:
                raise RecipePrecondition(
                    f"recipe {recipe}: weight {weight.name} ({', '.join(weight.hf_names)}, "
                    f"shape {list(weight.shape)}) cannot be compressed by step {step}: {reason}"
                )
            steps.setdefault(step, {})[weight.name] = config
        how = " + ".join(f"{s} {_describe_params(c)}" for s, c in step_params.items())
        if "quantize_lut" in chosen and step_params.get("code", {}).get("kind") == "kmeans":
            how += f" + LUT {_describe_params(chosen['quantize_lut'])}"
        entry.update(compressed=True, how=how)
    shown = [w.name for w in below if w.size > 1]
    record_below = {
        "count": len(below), "elements": sum(w.size for w in below), "non_scalar": shown,
        "reason": f"at most weight_threshold {WEIGHT_THRESHOLD} elements (norm scales, structural constants)",
    }
    return {"steps": steps, "record": {"weights": record, "below_threshold": record_below}}


def _describe_params(params: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items() if k != "weight_threshold")


# --- bits and the mixed-precision chooser --------------------------------------------------


def estimated_bits(shape: tuple[int, ...], params: dict) -> float:
    """Storage of a weight of `shape` under a recipe's params: codes plus every scale, offset, LUT."""
    n = int(np.prod(shape))
    step = weight_steps(params, Weight("", (), shape, (), ()))
    if "quantize" in step:  # coremltools linear: one scale per block in the weight's fp32
        q = step["quantize"]
        return n * int(q["dtype"].removeprefix("int")) + n / q["block_size"] * 32
    code = step["code"]
    width = 16 if code.get("dtype") == "fp16" else 32
    if code["kind"] == "fp16":
        return 16 * n
    if code["kind"] in ("affine", "symmetric"):  # a scale per block, and an offset if affine
        return n * code["nbits"] + n / code["block_size"] * (2 if code["kind"] == "affine" else 1) * width
    tiles = shape[0] // code["tile"][0] * (shape[1] // code["tile"][1])
    return n * code["nbits"] + tiles * (1 << code["nbits"]) * width


def choose_mixed(
    weights: list[Weight],
    measure: Callable[[str, str], float],
    budget_bits: float,
    options: tuple[str, ...] = tuple(RECIPES["mixed"]["mixed"]["options"]),
) -> dict:
    """Choose one option per group (decoder layer, or the embedding) under `budget_bits`.

    `measure(group, option)` is the error (logit KL on calibration text) of the model with
    only that group compressed by that option. Start every group at the smallest option,
    then repeatedly take the upgrade with the largest error drop per extra bit that still
    fits the budget. Raises `RecipePrecondition` when even the smallest choice exceeds it.
    """
    groups: dict[str, list[Weight]] = {}
    for weight in weights:
        if weight.hf_names and weight.size > WEIGHT_THRESHOLD:
            groups.setdefault(weight.group, []).append(weight)
    cost = {(g, o): sum(estimated_bits(w.shape, RECIPES[o]) for w in ws) for g, ws in groups.items() for o in options}
    by_size = sorted(options, key=lambda o: sum(cost[g, o] for g in groups))
    error = {(g, o): float(measure(g, o)) for g in groups for o in options}
    level = {g: 0 for g in groups}
    total = sum(cost[g, by_size[0]] for g in groups)
    if total > budget_bits:
        raise RecipePrecondition(
            f"recipe mixed: the smallest choice ({by_size[0]} everywhere) needs {total:.0f} bits, "
            f"over the budget of {budget_bits:.0f}"
        )
    while True:
        upgrades = []
        for g in groups:
            if level[g] + 1 < len(by_size):
                now, nxt = by_size[level[g]], by_size[level[g] + 1]
                extra = cost[g, nxt] - cost[g, now]
                if total + extra <= budget_bits:
                    upgrades.append(((error[g, now] - error[g, nxt]) / max(extra, 1.0), g, extra))
        if not upgrades:
            break
        gain, group, extra = max(upgrades)
        if gain <= 0:
            break
        level[group] += 1
        total += extra
    return {
        "choices": {g: by_size[level[g]] for g in sorted(groups)},
        "measured_error": {g: {o: error[g, o] for o in options} for g in sorted(groups)},
        "budget_bits": budget_bits,
        "estimated_bits": total,
    }


def _reference_code(calib: Calibration, weight: Weight, params: dict) -> object:
    """The code a recipe's params give `weight`, computed from the reference model's tensor."""
    step = weight_steps(params, weight)
    value = calib.weight(weight.hf_names[0])
    if "quantize" in step:
        return _coremltools_linear(value, step["quantize"])
    return encoder(step["code"])(value)


def _coremltools_linear(value: np.ndarray, params: dict) -> np.ndarray:
    """`value` through coremltools' own blockwise quantizer and back (what its step stores)."""
    from coremltools.optimize.coreml._quantization_passes import linear_quantize_weights as quantizer

    nbits = int(params["dtype"].removeprefix("int"))
    packed = quantizer.blockwise_compress(value, nbits, params["mode"].upper(), True, [1, params["block_size"]])
    return quantizer.decompress(packed).astype(np.float32)


def _decoded(code) -> np.ndarray:
    return code.decode() if hasattr(code, "decode") else np.asarray(code, np.float32)


def mixed_plan(weights: list[Weight], calib: Calibration, bpw: float, below_elements: int,
               options: tuple[str, ...] = tuple(RECIPES["mixed"]["mixed"]["options"])) -> tuple[dict, dict]:
    """(the chooser's record, MIL name -> code for `code` steps) for `bpw` bits per weight.

    Each group's sensitivity is the calibration KL with only that group's weights coded by
    the option; the budget counts every bundle parameter, the uncompressed ones (norms and
    matrices of at most WEIGHT_THRESHOLD elements, `below_elements`) at their 32 bits.
    """
    selected = [w for w in weights if w.hf_names and w.size > WEIGHT_THRESHOLD]
    cache = {(w.name, o): _reference_code(calib, w, RECIPES[o]) for w in selected for o in options}

    def measure(group: str, option: str) -> float:
        return calib.kl_with({n: _decoded(cache[w.name, option]) for w in selected if w.group == group
                              for n in w.hf_names})

    total = sum(w.size for w in selected) + below_elements
    chosen = choose_mixed(selected, measure, bpw * total - 32 * below_elements, options)
    chosen["bpw_budget"] = bpw
    codes_by_name = {w.name: cache[w.name, chosen["choices"][w.group]] for w in selected
                     if "code" in weight_steps(RECIPES[chosen["choices"][w.group]], w)}
    return chosen, codes_by_name


# --- applying a recipe ------------------------------------------------------------------------


def _subbyte(values: np.ndarray, nbits: int, signed: bool) -> np.ndarray:
    """`values` in the numpy dtype coremltools serialises as MIL int4/int8 or uint1..4/uint6/uint8
    (a LUT's indices must be exactly log2 of its size wide: 64 entries take uint6)."""
    if nbits == 8:
        return values.astype(np.int8 if signed else np.uint8)
    return values.astype(types.np_int4_dtype if signed else getattr(types, f"np_uint{nbits}_dtype"))


def emit_code(code, before_op) -> "mb.Var":
    """The constexpr op(s) that decode `code` to float32, placed before `before_op`.

    fp16 parameters decode to fp16 (a constexpr op's output dtype is its scale's or LUT's),
    then iOS18 `constexpr_cast` (whose operands are inputs, so it may read another
    constexpr op's output) widens to the fp32 the program computes in.
    """
    if isinstance(code, codes.ShiftScale):
        offset = code.offset
        if offset is not None and offset.dtype.kind in "iu":  # an integer offset has the data's own dtype
            offset = _subbyte(offset, code.nbits, code.signed)
        out = mb.constexpr_blockwise_shift_scale(data=_subbyte(code.data, code.nbits, code.signed),
                                                 scale=code.scale, offset=offset, before_op=before_op)
        dtype = code.scale.dtype
    elif isinstance(code, codes.Palette):
        out = mb.constexpr_lut_to_dense(indices=_subbyte(code.indices, code.nbits, False),
                                        lut=code.lut[..., None], before_op=before_op)
        dtype = code.lut.dtype
    else:  # a float16 array: the weight itself, stored at half size
        out, dtype = code.astype(np.float16), np.float16
        return mb.constexpr_cast(source_val=out, output_dtype="fp32", before_op=before_op)
    if dtype == np.float16:
        out = mb.constexpr_cast(source_val=out, output_dtype="fp32", before_op=before_op)
    return out


class _WriteCodes(AbstractGraphPass):
    """Replace each named fp32 constant by the constexpr ops of the code `encode(value)` gives."""

    def __init__(self, encoders: Mapping[str, Callable[[np.ndarray], object]]):
        super().__init__()
        self.encoders = encoders
        self.codes: dict[str, object] = {}

    def apply(self, prog):
        for function in prog.functions.values():
            for op in list(function.operations):
                if op.op_type == "const" and op.name in self.encoders:
                    code = self.encoders[op.name](np.asarray(op.val.val, dtype=np.float32))
                    self.codes[op.name] = code
                    with function:
                        new = emit_code(code, before_op=op)
                        op.enclosing_block.replace_uses_of_var_after_op(
                            anchor_op=op, old_var=op.outputs[0], new_var=new, no_check_var_types=True)
                        function.remove_ops([op])
                    new.set_name(op.name)


def _code_dtype(params: dict):
    """The numpy dtype a `code` step stores its scales, offsets or LUT in (None: the step has none)."""
    return {"fp16": np.float16, "fp32": np.float32}.get(params.get("dtype"))


def encoder(params: dict) -> Callable[[np.ndarray], object]:
    """value -> code for a `code` step's params (see RECIPES)."""
    dtype = _code_dtype(params)
    if params["kind"] == "fp16":
        return lambda w: w.astype(np.float16)
    if params["kind"] == "affine":
        return lambda w: codes.affine_blocks(w, params["nbits"], params["block_size"], dtype)
    if params["kind"] == "symmetric":
        return lambda w: codes.symmetric_blocks(w, params["nbits"], params["block_size"], dtype)
    if params["kind"] == "kmeans":
        return lambda w: codes.kmeans_tiles(w, params["nbits"], tuple(params["tile"]), dtype=dtype)
    raise UnknownRecipe(f"code step kind {params['kind']!r} is not one of fp16, affine, symmetric, kmeans")


def apply_recipe(mlmodel, program, recipe: str, steps: dict[str, dict[str, dict]],
                 encoders: Mapping[str, Callable[[np.ndarray], object]] | None = None):
    """The compressed model: each step of `plan_selection`, on exactly the selected weights of
    `program` (`mlmodel`'s, from `load_program`; rewritten in place).

    `encoders` overrides the `code` step's encoder per weight (calibration-aware codes).
    """
    params = RECIPES[recipe]
    if "code" in steps:
        chosen = {name: encoder(config) for name, config in steps["code"].items() if config["kind"] != "cmf-native"}
        chosen.update(encoders or {})
        _WriteCodes(chosen).apply(program)
        if "quantize_lut" in params:
            lut = cto.OpLinearQuantizerConfig(**params["quantize_lut"])
            quantize_luts = LinearQuantizeWeights(cto.OptimizationConfig(global_config=lut))
            quantize_luts.joint_compression = True
            quantize_luts.apply(program)
    if "quantize" in steps:
        configs = {n: cto.OpLinearQuantizerConfig(**p) for n, p in steps["quantize"].items()}
        LinearQuantizeWeights(cto.OptimizationConfig(op_name_configs=configs)).apply(program)
    spec = mlmodel.get_spec()
    # No main pass pipeline: the program was optimized when it was converted, and the steps
    # above add only constexpr ops. coremltools' own compression API reruns all 92 default
    # passes here (20 s on SmolLM2) and finds nothing to change; the backend passes still run.
    return mil_convert(program, convert_to="mlprogram", convert_from="milinternal",
                        specification_version=spec.specificationVersion, compute_units=mlmodel.compute_unit,
                        model_description=spec.description, skip_model_load=True,
                        pass_pipeline=ct.PassPipeline.EMPTY)


def _bind_compressed(mlpackage: Path, weights: list[Weight], selection: dict, recipe: str) -> None:
    """Record under each selected weight the variable that now feeds its consumers, and check
    that a decompression op produces it (coremltools skips a weight with only a warning) and
    that every other constant is still a plain const (nothing compressed beyond the plan)."""
    spec = ct.utils.load_spec(str(mlpackage))
    producers, inputs, producer_op = {}, {}, {}
    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            for op in block.operations:
                name = op.attributes["name"].immediateValue.tensor.strings.values[0]
                producers.update({output.name: op.type for output in op.outputs})
                producer_op.update({output.name: name for output in op.outputs})
                inputs[name] = {param: [a.name for a in arg.arguments] for param, arg in op.inputs.items()}
    for weight in weights:
        entry = selection["weights"].get(weight.name)
        if entry is None:  # at or below the threshold: no compression step looks at it
            continue
        if not entry["compressed"]:
            if producers.get(weight.name) != "const":
                raise RecipePrecondition(
                    f"{mlpackage}: recipe {recipe} changed {weight.name}, which it was not meant to compress"
                )
            continue
        fed = sorted({inputs.get(op, {}).get(param, ["absent"])[0] for op, param in weight.uses})
        kinds = [producers.get(var, "absent") for var in fed]
        if len(fed) != 1 or not kinds[0].startswith("constexpr_"):
            raise RecipePrecondition(
                f"{mlpackage}: recipe {recipe} left {weight.name} uncompressed (its consumers now read "
                f"{fed} from {kinds}); coremltools declined it, see its warning"
            )
        entry.update(compressed_as=fed[0], op=kinds[0], chain=_constexpr_chain(fed[0], producers, producer_op, inputs))


def _constexpr_chain(var: str, producers: dict, producer_op: dict, inputs: dict) -> list[str]:
    """The constexpr ops that make `var`, innermost first (e.g. shift_scale then the fp32 cast)."""
    chain = []
    while producers.get(var, "").startswith("constexpr_"):
        chain.insert(0, producers[var])
        feeding = [args[0] for args in inputs[producer_op[var]].values() if args
                   and producers.get(args[0], "").startswith("constexpr_")]
        if not feeding:
            break
        var = feeding[0]
    return chain


def _carried(name: str, code, reference: np.ndarray) -> Callable[[np.ndarray], object]:
    """An encoder that returns `code`, made from `reference`, for a constant that must equal it."""
    def encode(value: np.ndarray):
        if value.shape != reference.shape or not np.array_equal(value, reference):
            raise RecipePrecondition(f"constant {name}: the package's value differs from the tensor its code was "
                                     f"made from (a package of other weights than its upstream's)")
        return code
    return encode


def _weighted_encoders(weights: list[Weight], params: dict, moments: Mapping[str, np.ndarray]) -> dict:
    """MIL name -> sensitivity-weighted k-means encoder (SKM: each error weighted by E[x_j^2])."""
    dtype = _code_dtype(params)
    return {w.name: (lambda value, m=moments[w.hf_names[0]]:
                     codes.kmeans_tiles(value, params["nbits"], tuple(params["tile"]), m, dtype))
            for w in weights if w.hf_names and w.size > WEIGHT_THRESHOLD and w.hf_names[0] in moments}


def _gptq_encoders(weights: list[Weight], recipe: dict, hessians: Mapping[str, np.ndarray]) -> dict:
    """MIL name -> GPTQ affine encoder for every selected weight whose step asks for GPTQ and
    that feeds a linear (the tied embedding: as the head); the others keep their step's fit."""
    encoders = {}
    for w in weights:
        params = weight_steps(recipe, w).get("code", {})
        if w.hf_names and w.size > WEIGHT_THRESHOLD and params.get("gptq") and w.hf_names[0] in hessians:
            encoders[w.name] = (lambda value, h=hessians[w.hf_names[0]], p=params, d=_code_dtype(params):
                                codes.gptq_affine(value, h, p["nbits"], p["block_size"], d))
    return encoders


def _native_plan(package_dir: Path, source: dict, weights: list[Weight]) -> dict[str, tuple]:
    """MIL name -> (code or None, why) from the CMF the package's chain starts from."""
    from pipeline.ground.cmf import open_cmf

    path = cmf_native.source_cmf(package_dir, source)
    if path is None:
        raise RecipePrecondition(f"{package_dir}: recipe cmf-native needs the source CMF, and the package's chain "
                                 f"(package -> bundle -> CMF record) does not reach a CMF file")
    with open_cmf(path) as cmf:
        return {w.name: cmf_native.native_code(cmf, w.hf_names[0]) + (cmf.info(w.hf_names[0]).dtype.name,)
                for w in weights if w.hf_names and w.size > WEIGHT_THRESHOLD and w.hf_names[0] in cmf.tensors}


def compress_package(
    package_dir: str | Path,
    recipe: str,
    out_dir: str | Path,
    force: bool = False,
    *,
    calibration_ids: np.ndarray | None = None,
    bpw: float = MIXED_BPW,
) -> Manifest:
    """Apply `recipe` to the verified package at `package_dir`, writing `out_dir` atomically.

    Calibration-aware recipes (`mixed`) measure what they need on `calibration_ids` (int64
    token ids of calibration text, never the quality text) through the package's reference
    model, and refuse without them; `bpw` is mixed's budget in bits per weight.
    `cmf-native` reads the source CMF through the package's identity chain.
    """
    package_dir, out_dir = Path(package_dir), Path(out_dir)
    if recipe not in RECIPES:
        raise UnknownRecipe(f"{out_dir}: recipe {recipe!r} is not one of {sorted(RECIPES)}")
    refuse_existing(out_dir, force)
    source = package_manifest.verify_package(package_dir)
    mlpackage = package_dir / source["package"]["name"]
    if len(source["op_histogram"]) > 1:
        raise UnsupportedModel(
            f"{mlpackage}: a multifunction package ({', '.join(source['op_histogram'])}); coremltools 9.0 "
            "post-training compression refuses multifunction models: compress the chunk_kv or stateless package"
        )
    if RECIPES[recipe].get("calibration") and (calibration_ids is None or len(calibration_ids) < 2):
        raise RecipePrecondition(f"{package_dir}: recipe {recipe} measures on calibration text and got no "
                                 f"calibration_ids (pipeline.ground.text_roles: text_roles(lines)['calibration'])")
    start = time.perf_counter()
    mlmodel = ct.models.MLModel(str(mlpackage), skip_model_load=True)
    program = load_program(mlmodel)
    weights = program_weights(program, source["package"].get("weights", {}))
    extra, encoders, choices, native = {}, {}, None, None
    if recipe == "mixed":
        calib = Calibration.from_package(package_dir, source, calibration_ids)
        below = sum(w.size for w in weights if w.hf_names and w.size <= WEIGHT_THRESHOLD)
        extra["mixed"], cached = mixed_plan(weights, calib, bpw, below)
        choices = extra["mixed"]["choices"]
        by_name = {w.name: w for w in weights}
        encoders = {n: _carried(n, c, calib.weight(by_name[n].hf_names[0])) for n, c in cached.items()}
    if recipe == "cmf-native":
        native = _native_plan(package_dir, source, weights)
    if RECIPES[recipe].get("code", {}).get("importance"):
        encoders = _weighted_encoders(weights, RECIPES[recipe]["code"],
                                      Calibration.from_package(package_dir, source, calibration_ids).input_moments())
    if RECIPES[recipe].get("code", {}).get("gptq"):
        calib = Calibration.from_package(package_dir, source, calibration_ids, calibration.HESSIAN_WINDOWS)
        encoders = _gptq_encoders(weights, RECIPES[recipe], calib.input_hessians())
    plan = plan_selection(weights, recipe, choices, native)
    if native:
        encoders = {n: _carried(n, code, code.decode() if hasattr(code, "decode") else code.astype(np.float32))
                    for n, (code, _, _) in native.items() if code is not None}
    compressed = apply_recipe(mlmodel, program, recipe, plan["steps"], encoders)
    with staged_output(out_dir, force) as staging:
        compressed.save(str(staging / package_manifest.MODEL_NAME))
        _bind_compressed(staging / package_manifest.MODEL_NAME, weights, plan["record"], recipe)
        size = package_manifest.package_bytes(staging / package_manifest.MODEL_NAME)
        manifest = package_manifest.write_package_manifest(staging, {
            "format": package_manifest.COMPRESSED_FORMAT,
            "source": artifact_source(package_dir, relative_to=out_dir),
            "architecture": source["architecture"],
            "special_tokens": source["special_tokens"],
            "tokenizer": package_manifest.carry_tokenizer(package_dir, staging),
            "recipe": {"name": recipe, "params": RECIPES[recipe]},
            "package": source["package"],
            "selection": {**plan["record"], **extra},
            "size_bytes": size,
            "base_size_bytes": source["package_bytes"],
            "compression": {
                "seconds": round(time.perf_counter() - start, 2),
                "code": package_manifest.source_digest([Path(__file__), Path(package_manifest.__file__),
                                                        Path(codes.__file__), Path(cmf_native.__file__),
                                                        Path(calibration.__file__)]),
            },
        })
    return Manifest(out_dir, manifest.data)
