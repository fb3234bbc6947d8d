"""Compression recipes for Core ML packages: one table, one function that applies a row.

    manifest = compress_package("out/chunk_kv", "int4-b32", "out/chunk_kv-int4-b32")

Every recipe goes through coremltools 9.0 `coremltools.optimize.coreml` post-training
compression (`linear_quantize_weights`, `palettize_weights`, joint compression via
`linear_quantize_weights(..., joint_compression=True)`). What is compressed is decided
here, not by coremltools defaults: a constant is a candidate only if it is a bundle
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
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
from coremltools.models.utils import _apply_graph_pass

from coreml import manifest as package_manifest
from manifests.identity import Manifest, artifact_source
from manifests.output import refuse_existing, staged_output
from pipeline.errors import CmfdeployError, UnsupportedModel

WEIGHT_THRESHOLD = 2048
EMBEDDING = "model.embed_tokens.weight"
# Ops whose weight axes are (output 0, input 1), as coremltools' own axis inference has it.
WEIGHT_CONSUMERS = ("linear", "gather")


def _linear(dtype: str) -> dict:
    return {"mode": "linear_symmetric", "dtype": dtype, "granularity": "per_block", "block_size": 32,
            "weight_threshold": WEIGHT_THRESHOLD}


def _palette(nbits: int) -> dict:
    return {"mode": "kmeans", "nbits": nbits, "granularity": "per_grouped_channel", "group_size": 32,
            "weight_threshold": WEIGHT_THRESHOLD}


# name -> params, recorded verbatim in the manifest. Keys: `quantize` (OpLinearQuantizerConfig),
# `palettize` (OpPalettizerConfig), `quantize_lut` (joint: the palette's LUT quantized after
# palettization), `embedding: "fp16"` (the embedding kept as fp16 behind constexpr_cast),
# `mixed` (per-layer choice among recipes, from measured sensitivity under a size budget).
RECIPES: dict[str, dict] = {
    "int8-b32": {"quantize": _linear("int8")},
    "int4-b32": {"quantize": _linear("int4")},
    "palette6-gc32": {"palettize": _palette(6)},
    "palette4-gc32": {"palettize": _palette(4)},
    "int8-b32-embfp16": {"quantize": _linear("int8"), "embedding": "fp16"},
    "palette4-int8lut": {
        "palettize": _palette(4),
        "quantize_lut": {"mode": "linear_symmetric", "dtype": "int8", "granularity": "per_tensor",
                         "weight_threshold": WEIGHT_THRESHOLD},
    },
    "mixed": {"mixed": {"options": ["int4-b32", "int8-b32"], "group": "decoder layer (embedding on its own)"}},
}


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


def program_weights(mlmodel, weight_names: Mapping[str, list[str]]) -> list[Weight]:
    """Every non-scalar constant of the program, with the HF names the conversion recorded."""
    metadata = cto.get_weights_metadata(mlmodel, weight_threshold=1)
    return [
        Weight(name, tuple(weight_names.get(name, ())), tuple(meta.val.shape),
               tuple(sorted({op.op_type for op in meta.child_ops})),
               tuple((op.name, param) for op in meta.child_ops
                     for param, const in op.params_name_mapping.items() if const == name))
        for name, meta in metadata.items()
    ]


def _precondition(weight: Weight, step: str, params: dict) -> str | None:
    """Why `params` cannot compress `weight`, or None when it can."""
    unknown = sorted(set(weight.consumers) - set(WEIGHT_CONSUMERS))
    if unknown or len(weight.shape) != 2:
        return f"rank {len(weight.shape)}, consumers {list(weight.consumers)}: axes unknown for ops {unknown}"
    if step == "quantize" and weight.shape[1] % params["block_size"]:
        return f"input axis {weight.shape[1]} not divisible by block_size {params['block_size']}"
    if step == "palettize" and weight.shape[0] % params["group_size"]:
        return f"output axis {weight.shape[0]} not divisible by group_size {params['group_size']}"
    return None


def plan_selection(weights: list[Weight], recipe: str, choices: Mapping[str, str] | None = None) -> dict:
    """Which weights each step of `recipe` compresses; raises `RecipePrecondition`.

    Returns `{"steps": {step: {mil_name: params}}, "record": {...}}` where the record lists
    every constant with what happens to it and why.
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
        if params.get("embedding") == "fp16" and EMBEDDING in weight.hf_names:
            steps.setdefault("fp16_cast", {})[weight.name] = {}
            entry.update(compressed=True, how="fp16 behind constexpr_cast (recipe keeps the embedding in fp16)")
            continue
        if choices:  # mixed: the group's chosen linear recipe
            step_params = {"quantize": RECIPES[choices[weight.group]]["quantize"]}
        else:
            step_params = {k: v for k, v in params.items() if k in ("quantize", "palettize")}
        for step, config in step_params.items():
            reason = _precondition(weight, step, config)
            if reason:
                raise RecipePrecondition(
                    f"recipe {recipe}: weight {weight.name} ({', '.join(weight.hf_names)}, "
                    f"shape {list(weight.shape)}) cannot be compressed by step {step}: {reason}"
                )
            steps.setdefault(step, {})[weight.name] = config
        how = " + ".join(f"{s} {_describe_params(c)}" for s, c in step_params.items())
        if "quantize_lut" in params:
            how += f" + LUT {_describe_params(params['quantize_lut'])}"
        entry.update(compressed=True, how=how)
    shown = [w.name for w in below if w.size > 1]
    record_below = {
        "count": len(below), "elements": sum(w.size for w in below), "non_scalar": shown,
        "reason": f"at most weight_threshold {WEIGHT_THRESHOLD} elements (norm scales, structural constants)",
    }
    return {"steps": steps, "record": {"weights": record, "below_threshold": record_below}}


def _describe_params(params: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items() if k != "weight_threshold")


# --- mixed precision -----------------------------------------------------------------------


def estimated_bytes(weight: Weight, recipe: str) -> float:
    """Storage of `weight` under a linear recipe: packed values plus one fp32 scale per block."""
    q = RECIPES[recipe]["quantize"]
    bits = int(q["dtype"].removeprefix("int"))
    return weight.size * bits / 8 + weight.size / q["block_size"] * 4


def choose_mixed(
    weights: list[Weight],
    measure: Callable[[str, str], float],
    budget_bytes: float,
    options: tuple[str, ...] = tuple(RECIPES["mixed"]["mixed"]["options"]),
) -> dict:
    """Choose one option per group (decoder layer) under `budget_bytes`, least error first.

    `measure(group, option)` is the error (e.g. logit KL or perplexity increase) of the
    model with only that group compressed by that option. Start every group at the smallest
    option, then repeatedly take the upgrade with the largest error drop per extra byte
    that still fits the budget. Raises `RecipePrecondition` when even the smallest choice
    exceeds the budget.
    """
    groups: dict[str, list[Weight]] = {}
    for weight in weights:
        if weight.hf_names and weight.size > WEIGHT_THRESHOLD:
            groups.setdefault(weight.group, []).append(weight)
    cost = {(g, o): sum(estimated_bytes(w, o) for w in ws) for g, ws in groups.items() for o in options}
    by_size = sorted(options, key=lambda o: sum(cost[g, o] for g in groups))
    error = {(g, o): float(measure(g, o)) for g in groups for o in options}
    level = {g: 0 for g in groups}
    total = sum(cost[g, by_size[0]] for g in groups)
    if total > budget_bytes:
        raise RecipePrecondition(
            f"recipe mixed: the smallest choice ({by_size[0]} everywhere) needs {total:.0f} bytes, "
            f"over the budget of {budget_bytes:.0f}"
        )
    while True:
        upgrades = []
        for g in groups:
            if level[g] + 1 < len(by_size):
                now, nxt = by_size[level[g]], by_size[level[g] + 1]
                extra = cost[g, nxt] - cost[g, now]
                if total + extra <= budget_bytes:
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
        "budget_bytes": budget_bytes,
        "estimated_bytes": total,
    }


# --- applying a recipe ------------------------------------------------------------------------


class _EmbeddingToFp16(AbstractGraphPass):
    """Replace the named fp32 constants by fp16 constants behind `constexpr_cast`."""

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names

    def apply(self, prog):
        for function in prog.functions.values():
            for op in list(function.operations):
                if op.op_type == "const" and op.name in self.names:
                    with function:
                        cast = mb.constexpr_cast(source_val=op.val.val.astype(np.float16), output_dtype="fp32",
                                                 before_op=op)
                        op.enclosing_block.replace_uses_of_var_after_op(
                            anchor_op=op, old_var=op.outputs[0], new_var=cast, no_check_var_types=True)
                        function.remove_ops([op])
                    cast.set_name(op.name)


def apply_recipe(mlmodel, recipe: str, steps: dict[str, dict[str, dict]]):
    """The compressed model: each step of `plan_selection`, on exactly the selected weights."""
    params = RECIPES[recipe]
    if "palettize" in steps:
        configs = {n: cto.OpPalettizerConfig(**p) for n, p in steps["palettize"].items()}
        mlmodel = cto.palettize_weights(mlmodel, cto.OptimizationConfig(op_name_configs=configs))
        if "quantize_lut" in params:
            lut = cto.OpLinearQuantizerConfig(**params["quantize_lut"])
            mlmodel = cto.linear_quantize_weights(
                mlmodel, cto.OptimizationConfig(global_config=lut), joint_compression=True)
    if "quantize" in steps:
        configs = {n: cto.OpLinearQuantizerConfig(**p) for n, p in steps["quantize"].items()}
        mlmodel = cto.linear_quantize_weights(mlmodel, cto.OptimizationConfig(op_name_configs=configs))
    if "fp16_cast" in steps:
        mlmodel = _apply_graph_pass(mlmodel, _EmbeddingToFp16(set(steps["fp16_cast"])),
                                    spec_version=mlmodel.get_spec().specificationVersion, skip_model_load=True)
    return mlmodel


def _bind_compressed(mlpackage: Path, weights: list[Weight], selection: dict, recipe: str) -> None:
    """Record under each selected weight the variable that now feeds its consumers, and check
    that a decompression op produces it (coremltools skips a weight with only a warning) and
    that every other constant is still a plain const (nothing compressed beyond the plan)."""
    spec = ct.utils.load_spec(str(mlpackage))
    producers, inputs = {}, {}
    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            for op in block.operations:
                producers.update({output.name: op.type for output in op.outputs})
                name = op.attributes["name"].immediateValue.tensor.strings.values[0]
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
        entry.update(compressed_as=fed[0], op=kinds[0])


def compress_package(
    package_dir: str | Path,
    recipe: str,
    out_dir: str | Path,
    force: bool = False,
    measure: Callable[[str, str], float] | None = None,
    budget_bytes: float | None = None,
) -> Manifest:
    """Apply `recipe` to the verified package at `package_dir`, writing `out_dir` atomically.

    `mixed` needs `measure(group, option)` and `budget_bytes` (see `choose_mixed`).
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
    start = time.perf_counter()
    mlmodel = ct.models.MLModel(str(mlpackage), skip_model_load=True)
    weights = program_weights(mlmodel, source["package"].get("weights", {}))
    mixed = None
    if recipe == "mixed":
        if measure is None or budget_bytes is None:
            raise RecipePrecondition(f"{package_dir}: recipe mixed needs a measure callback and a byte budget")
        mixed = choose_mixed(weights, measure, budget_bytes)
    plan = plan_selection(weights, recipe, mixed and mixed["choices"])
    compressed = apply_recipe(mlmodel, recipe, plan["steps"])
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
            "selection": {**plan["record"], **({"mixed": mixed} if mixed else {})},
            "size_bytes": size,
            "base_size_bytes": source["package_bytes"],
            "compression": {
                "seconds": round(time.perf_counter() - start, 2),
                "code": package_manifest.source_digest([Path(__file__), Path(package_manifest.__file__)]),
            },
        })
    return Manifest(out_dir, manifest.data)
