"""Applying a recipe to a package: the orchestration every recipe goes through.

    manifest = compress_package("out/chunk_kv", "int4-b32", "out/chunk_kv-int4-b32")

The program is loaded once; its constants are listed (`program_weights`); the recipe,
readied for them (`Recipe.prepare`), selects each weight's steps (`plan_selection`); the
`code` steps are written as constexpr ops (`coreml.recipes.emit`), then the recipe's own
pass (`Recipe.after_codes`), then coremltools' `quantize` steps; the saved program is
checked to hold a decompression op for every selected weight (`_bind_compressed`), because
coremltools itself only logs a warning and skips a weight it cannot compress.
"""

import hashlib
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import coremltools as ct
import coremltools.optimize.coreml as cto
import numpy as np
from coremltools.converters.mil.converter import mil_convert
from coremltools.converters.mil.frontend.milproto import load as milproto
from coremltools.models.utils import _convert_model_spec_to_pymil_prog
from coremltools.optimize.coreml._quantization_passes import linear_quantize_weights as LinearQuantizeWeights

from coreml import cache as cache_module
from coreml import calibration, codes
from coreml import manifest as package_manifest
from coreml.recipes.base import RECIPES, WEIGHT_THRESHOLD, Context, Encoder, Recipe, RecipePrecondition, Selected, Weight
from coreml.mil.loader import BlobStorage, blob_file, mil_dtype, program_spec, tensor_spec
from coreml.multifunction import PackageFunctions, merge_functions, package_functions
from coreml.split import chained_histogram, program_views
from coreml.recipes.emit import WriteCodes
from coreml.recipes.mixed import MIXED_BPW
from pipeline.ground.bundle_format import WEIGHTS_NAME
from manifests.chain import upstream_path
from manifests.disk import DISK_NEEDS, require_disk
from manifests.identity import Manifest, artifact_source
from manifests.output import refuse_existing, staged_output


def load_program(mlmodel):
    """The package's MIL program, loaded once: the weights are listed from it and every step
    of a recipe rewrites it in place. Its float constants are views of the package's weight
    file (`_float_blobs_mapped`), not copies."""
    with _float_blobs_mapped():
        return _convert_model_spec_to_pymil_prog(mlmodel, mlmodel.get_spec().specificationVersion, milproto.load)


@contextmanager
def _float_blobs_mapped():
    """coremltools' MIL loader reads every constant in the weight file into numpy, twice over
    (`np.array(value).astype(dtype)`), and keeps the copy: 1 W of a compression's private
    memory before a recipe has made anything (a 1.7B model's survey workers held 8.7 GB each
    while compressing). Here a float32 or fp16 tensor constant stored in the weight file is
    loaded as a read-only view of it (`coreml.mil.loader.BlobStorage`, which checks the blob's
    metadata against the type the program declares); every other value is loaded by
    coremltools as before. The same values, so the same compressed package, byte for byte
    (`tests/test_coreml_recipes.py`); a step that wrote into a constant would fail on the
    read-only view rather than change the file. The swap of the loader's module function
    lasts for this load alone."""
    original = milproto._load_value
    storages: dict[Path, BlobStorage] = {}

    def load_value(context, value_spec):
        spec = None
        if value_spec.WhichOneof("value") == "blobFileValue" and not value_spec.docString:
            blob = value_spec.blobFileValue
            where = f"{blob.fileName} @ {blob.offset}"
            spec = tensor_spec(value_spec.type, where)
        if spec is None or spec.dtype.numpy not in (np.float32, np.float16) or None in spec.shape or not spec.shape:
            return original(context, value_spec)
        path = Path(context.weights_dir) / blob.fileName.split("/")[-1]
        if path not in storages:
            storages[path] = BlobStorage(path)
        return storages[path].read(blob.offset, spec.dtype, spec.shape)

    milproto._load_value = load_value
    try:
        yield
    finally:
        milproto._load_value = original


def head_parts(program, package: dict) -> dict[str, tuple[str, tuple[int, int]]]:
    """Constant name -> (the head's HF name, the rows it holds) of each part of a split head
    (`package.head_split`): the weight of the linear that makes the part's logits output."""
    split = package.get("head_split")
    if split is None:
        return {}
    parts = {}
    for function in program.functions.values():
        outputs = {var.name: var for var in function.outputs}
        for part in split["parts"]:
            parts[outputs[part["output"]].op.weight.op.name] = (split["weight"], tuple(part["rows"]))
    return parts


def program_weights(program, weight_names: Mapping[str, list[str]],
                    parts: Mapping[str, tuple[str, tuple[int, int]]] = {}) -> list[Weight]:
    """Every array constant of the program (nested blocks included), with the HF names the
    conversion recorded, or those of the head a part of a split head (`head_parts`) holds rows of."""
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
            head, rows = parts.get(op.name, (None, None))
            weights.append(Weight(
                op.name, tuple(weight_names.get(op.name, [head] if head else ())), tuple(op.val.val.shape),
                tuple(sorted({child.op_type for child in consumers})),
                tuple((child.name, param) for child in consumers for param, var in child.inputs.items()
                      if var is op.outputs[0]), rows))
    return weights


def plan_selection(weights: list[Weight], select: Callable[[Weight], Selected]) -> dict:
    """Which weights each step compresses, as `select` (a recipe's, readied by `prepare`)
    chooses for every bundle weight over the threshold; raises `RecipePrecondition`.

    Returns `{"steps": {kind: {mil_name: step}}, "record": {...}}` where the record lists
    every constant with what happens to it and why.
    """
    steps: dict[str, dict] = {}
    record, below = {}, []
    for weight in weights:
        if weight.size <= WEIGHT_THRESHOLD:
            below.append(weight)
            continue
        entry = {"hf_names": list(weight.hf_names), "shape": list(weight.shape), "consumers": list(weight.consumers),
                 **({"rows": list(weight.rows)} if weight.rows else {})}
        record[weight.name] = entry
        if not weight.hf_names:
            entry.update(compressed=False, reason="not a bundle weight (structural constant of the graph)")
            continue
        selected = select(weight)
        for kind, step in selected.steps.items():
            steps.setdefault(kind, {})[weight.name] = step
        entry.update(selected.entry)
    shown = [w.name for w in below if w.size > 1]
    record_below = {
        "count": len(below), "elements": sum(w.size for w in below), "non_scalar": shown,
        "reason": f"at most weight_threshold {WEIGHT_THRESHOLD} elements (norm scales, structural constants)",
    }
    return {"steps": steps, "record": {"weights": record, "below_threshold": record_below}}


def apply_recipe(mlmodel, program, recipe: Recipe, steps: dict[str, dict], encoders: Mapping[str, Encoder]):
    """(the compressed model, the records of the codes written, by constant name: `WriteCodes`): each step of
    `plan_selection`, on exactly the selected weights of `program` (`mlmodel`'s, from
    `load_program`; rewritten in place).

    `encoders` replaces a `code` step's own fit per weight (calibration-aware or carried codes).
    """
    written = {}
    if "code" in steps:
        writer = WriteCodes({name: encoders[name] if name in encoders else step.encode
                             for name, step in steps["code"].items()})
        writer.apply(program)
        written = writer.records
        if recipe.after_codes(program):
            written = {name: {k: v for k, v in record.items() if k != "decoded_sha256"} for name, record in written.items()}
    if "quantize" in steps:
        configs = {n: cto.OpLinearQuantizerConfig(**step.record()) for n, step in steps["quantize"].items()}
        LinearQuantizeWeights(cto.OptimizationConfig(op_name_configs=configs)).apply(program)
    spec = mlmodel.get_spec()
    # No main pass pipeline: the program was optimized when it was converted, and the steps
    # above add only constexpr ops. coremltools' own compression API reruns all 92 default
    # passes here (20 s on SmolLM2) and finds nothing to change; the backend passes still run.
    return mil_convert(program, convert_to="mlprogram", convert_from="milinternal",
                       specification_version=spec.specificationVersion, compute_units=mlmodel.compute_unit,
                       model_description=spec.description, skip_model_load=True,
                       pass_pipeline=ct.PassPipeline.EMPTY), written


def _apply_per_function(functions: PackageFunctions, program, recipe: Recipe, steps: dict[str, dict],
                        encoders: Mapping[str, Encoder], scratch: Path):
    """`apply_recipe` on each function of a multifunction package (`program`: its default
    function's, loaded already), each saved apart and merged (`merge_functions`), which
    stores each distinct blob once: the functions read one set of codes, made once."""
    code_steps = steps.get("code", {})
    once = _EncodedOnce({name: encoders.get(name, step.encode) for name, step in code_steps.items()})
    written = {}
    with tempfile.TemporaryDirectory(dir=scratch) as folder:
        paths = {}
        for name in [functions.default_function, *(n for n in functions.names if n != functions.default_function)]:
            model = functions.model(name)
            compressed, records = apply_recipe(model, program if program is not None else load_program(model),
                                           recipe, steps, once)
            package_manifest.discard_model(model)
            paths[name] = Path(folder) / f"{name}.mlpackage"
            package_manifest.save_model(compressed, paths[name])
            written.update(records)
            program = None  # the next function's is loaded from its own model
            del model, compressed
        ordered = {name: paths[name] for name in functions.names}
        return merge_functions(ordered, functions.default_function, functions.metadata), written


class _EncodedOnce(dict):
    """Encoders that code each weight once and hand the same code to every function reading
    it; a function whose constant of that name holds other values is refused by name, as a
    package whose functions disagree on a weight."""

    def __init__(self, encoders: Mapping[str, Encoder]):
        super().__init__({name: self._once(name, encode) for name, encode in encoders.items()})
        self.codes: dict[str, tuple[str, object]] = {}

    def _once(self, name: str, encode: Encoder) -> Encoder:
        def encoded(value: np.ndarray):
            digest = hashlib.sha256(np.ascontiguousarray(value).view(np.uint8)).hexdigest()
            if name not in self.codes:
                self.codes[name] = (digest, encode(value))
            elif self.codes[name][0] != digest:
                raise RecipePrecondition(f"weight {name}: the package's functions hold different values under "
                                         "this name, so no one code can stand for it")
            return self.codes[name][1]
        return encoded


def _bind_compressed(mlpackage: Path, weights: list[Weight], selection: dict, recipe: str) -> None:
    """Record under each selected weight the variable that now feeds its consumers, and check
    that a decompression op produces it (coremltools skips a weight with only a warning) and
    that every other constant is still a plain const (nothing compressed beyond the plan).
    Errors name the package file alone: the staging folder they are raised in is gone by the
    time a survey's record of them ships."""
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
                    f"{mlpackage.name}: recipe {recipe} changed {weight.name}, which it was not meant to compress"
                )
            continue
        fed = sorted({inputs.get(op, {}).get(param, ["absent"])[0] for op, param in weight.uses})
        kinds = [producers.get(var, "absent") for var in fed]
        if len(fed) != 1 or not kinds[0].startswith("constexpr_"):
            raise RecipePrecondition(
                f"{mlpackage.name}: recipe {recipe} left {weight.name} uncompressed (its consumers now read "
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


def compress_package(
    package_dir: str | Path,
    recipe: str,
    out_dir: str | Path,
    force: bool = False,
    *,
    calibration_ids: np.ndarray | None = None,
    bpw: float = MIXED_BPW,
    shared_cache: str | Path | None = None,
) -> Manifest:
    """Apply `recipe` to the verified package at `package_dir`, writing `out_dir` atomically.

    Calibration-aware recipes (`mixed`) measure what they need on `calibration_ids` (int64
    token ids of calibration text, never the quality text) through the package's reference
    model, and refuse without them; `bpw` is mixed's budget in bits per weight.
    `cmf-native` reads the source CMF through the package's identity chain.
    `shared_cache`: a folder where calibration Hessians, GPTQ codes and k-means centres are
    shared with other compressions of the same package (`coreml.cache`; one survey's recipes).
    """
    package_dir, out_dir = Path(package_dir), Path(out_dir)
    unit = RECIPES.lookup(recipe, out_dir)
    refuse_existing(out_dir, force)
    source = package_manifest.verify_package(package_dir)
    # W is the bundle's FP32 bytes, not the package's own (an fp16 package is half of it).
    require_disk(out_dir, DISK_NEEDS["compress"],
                 (upstream_path(package_dir, source["source"]) / WEIGHTS_NAME).stat().st_size)
    if unit.calibration and (calibration_ids is None or len(calibration_ids) < 2):
        raise RecipePrecondition(f"{package_dir}: recipe {recipe} measures on calibration text and got no "
                                 f"calibration_ids (pipeline.ground.text_roles: text_roles(lines)['calibration'])")
    start = time.perf_counter()
    context = Context(package_dir, source.data, calibration_ids, bpw, None if shared_cache is None else Path(shared_cache))
    with staged_output(out_dir, force) as staging:
        # A split package's pieces are compressed one by one, each as the package it is.
        compressed = [_compress_program(package_dir / name, view, unit, context, staging / name)
                      for name, view in program_views(source.data)]
        fields = {
            "format": package_manifest.COMPRESSED_FORMAT,
            "source": artifact_source(package_dir, relative_to=out_dir),
            "architecture": source["architecture"],
            "special_tokens": source["special_tokens"],
            "tokenizer": package_manifest.carry_tokenizer(package_dir, staging),
            "recipe": {"name": recipe, "params": unit.params_record()},
            "package": source["package"],
            "size_bytes": sum(program.size for program in compressed),
            "base_size_bytes": source["package_bytes"],
            "compression": {
                "seconds": round(time.perf_counter() - start, 2),
                "code": package_manifest.source_digest([*sorted(Path(__file__).parent.glob("*.py")),
                                                        Path(package_manifest.__file__), Path(codes.__file__),
                                                        Path(calibration.__file__), Path(cache_module.__file__)]),
            },
        }
        histogram = None
        if "pieces" in source["package"]:
            pieces = [{**piece, "selection": program.selection, "op_histogram": program.histogram,
                       "package_bytes": program.size} for piece, program in zip(source["package"]["pieces"], compressed)]
            fields["package"] = {**source["package"], "pieces": pieces}
            fields["selection"] = {"weights": _merged_selections([program.selection for program in compressed],
                                                                 out_dir)}
            histogram = chained_histogram(pieces)
        else:
            fields["selection"] = compressed[0].selection
        manifest = package_manifest.write_package_manifest(staging, fields, histogram)
    return Manifest(out_dir, manifest.data)


@dataclass(frozen=True)
class _CompressedProgram:
    selection: dict  # the manifest's `selection` of this program (the package's, or one piece's)
    size: int
    histogram: dict


def _compress_program(mlpackage: Path, view: dict, unit: Recipe, context: Context, out: Path) -> _CompressedProgram:
    """One program of the package (`view`: the manifest as that program's own, `program_views`)
    compressed by `unit` and saved at `out` (in the stage's staging folder)."""
    # coremltools 9.0's post-training compression refuses a multifunction model, so a stateful
    # package's functions are compressed one by one, with the same codes, and merged again.
    functions = package_functions(mlpackage) if len(view["op_histogram"]) > 1 else None
    mlmodel = (functions.model(functions.default_function) if functions
               else ct.models.MLModel(str(mlpackage), skip_model_load=True))
    program = load_program(mlmodel)
    weights = program_weights(program, view["package"].get("weights", {}), head_parts(program, view["package"]))
    prepared = unit.prepare(weights, replace(context, manifest=view))
    plan = plan_selection(weights, prepared.select)
    with package_manifest.working_files_in(out.parent):
        if functions is None:
            compressed, written = apply_recipe(mlmodel, program, unit, plan["steps"], prepared.encoders)
        else:
            package_manifest.discard_model(mlmodel)
            del mlmodel
            compressed, written = _apply_per_function(functions, program, unit, plan["steps"],
                                                       prepared.encoders, out.parent)
        package_manifest.save_model(compressed, out)
    for name, record in written.items():
        plan["record"]["weights"][name].update(record)
    _bind_compressed(out, weights, plan["record"], unit.name)
    return _CompressedProgram({**plan["record"], **prepared.record}, package_manifest.package_bytes(out),
                              package_manifest.op_histogram(out))


def _merged_selections(selections: list[dict], where: Path) -> dict:
    """The weights of the pieces' selections as one record: a weight two pieces hold (a tied
    embedding, the first's lookup and the last's head) must be coded alike in both; its
    consumers are both pieces' ops."""
    merged: dict[str, dict] = {}
    for selection in selections:
        for name, entry in selection["weights"].items():
            held = merged.setdefault(name, entry)
            if {k: v for k, v in held.items() if k != "consumers"} != {k: v for k, v in entry.items() if k != "consumers"}:
                raise RecipePrecondition(f"{where}: weight {name} is coded differently in two pieces of the package")
            if "consumers" in entry:
                merged[name] = {**held, "consumers": sorted(set(held["consumers"]) | set(entry["consumers"]))}
    return dict(sorted(merged.items()))


def code_digests(package_dir: str | Path) -> dict[str, str]:
    """A compressed package's codes, by the bundle weight each stands for (its HF names, and the
    rows of a split head's part): the sha256 of every constant its decompression ops read, in
    the order they read them. Two packages with equal digests for a weight decode it alike,
    whatever their kind or their constants' names (`pipeline.stages.deploy`)."""
    package_dir = Path(package_dir)
    manifest = package_manifest.verify_package(package_dir, hashes=False)
    digests: dict[str, str] = {}
    # A split package's pieces each code their own weights; a tied table two hold is one weight,
    # coded alike in both or refused (`_merged_selections` at compression).
    for name, view in program_views(manifest.data):
        for key, digest in _program_code_digests(package_dir / name, view).items():
            if digests.setdefault(key, digest) != digest:
                raise RecipePrecondition(f"{package_dir / name}: weight {key} is coded otherwise than in another "
                                         "piece of the package")
    return digests


def _program_code_digests(mlpackage: Path, manifest: dict) -> dict[str, str]:
    path, spec = program_spec(mlpackage)
    function = spec.mlProgram.functions[spec.description.defaultFunctionName or "main"]
    producers = {output.name: op for block in function.block_specializations.values()
                 for op in block.operations for output in op.outputs}
    storages: dict[Path, BlobStorage] = {}

    def value_digest(value, where: str, digest) -> None:
        if value.WhichOneof("value") != "blobFileValue":
            digest.update(value.SerializeToString(deterministic=True))
            return
        file = blob_file(path.parent, value.blobFileValue.fileName, where)
        storage = storages.setdefault(file, BlobStorage(file))
        entry = storage.entry(value.blobFileValue.offset, mil_dtype(value.type.tensorType.dataType, where))
        for chunk in storage.stream(entry):
            digest.update(chunk)

    def op_digest(var: str, digest) -> None:
        op = producers[var]
        digest.update(op.type.encode())
        if op.type == "const":
            value_digest(op.attributes["val"], f"{path}: const {var}", digest)
            return
        for param in sorted(op.inputs):
            for binding in op.inputs[param].arguments:
                digest.update(param.encode())
                if binding.WhichOneof("binding") == "value":
                    value_digest(binding.value, f"{path}: {op.type} -> {var}", digest)
                else:
                    op_digest(binding.name, digest)

    digests = {}
    for entry in manifest["selection"]["weights"].values():
        if entry.get("compressed"):
            key = "+".join(entry["hf_names"]) + (f"[{entry['rows'][0]}:{entry['rows'][1]}]" if "rows" in entry else "")
            digest = hashlib.sha256()
            op_digest(entry["compressed_as"], digest)
            digests[key] = digest.hexdigest()
    return digests
