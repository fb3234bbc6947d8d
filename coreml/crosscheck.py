"""A package manifest's claims against what the saved program says about itself.

A manifest is a claim; `Model.mlmodel` (and the `weight.bin` blob headers it points at) is
the artifact's own statement. `check_package` compares every claim the program states too:
the functions and default function, each function's inputs, outputs and states (names,
dtypes, shapes, the flexible token range), the context and cache shape, the vocabulary, the
compute precision and precision (the dtype of every arithmetic op, the ops kept in float32 and
why they may be, the float I/O dtype, compute units the precision allows), each recorded
weight's producer and dtype, every blob header against the
type the program declares for it, the op histogram, and the kind and bundle the program's
metadata name. A difference is an IdentityError naming the manifest field and both values.

The program is read from its protobuf with `coreml.mil.loader` (weights are not decoded;
each blob's 64-byte header is).
"""

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coreml.interfaces import DEFAULT_INTERFACE, MASK_DTYPE, package_interface
from coreml.mil.errors import MilError
from coreml.mil.ops import OPS
from coreml.layout import logit_outputs
from coreml.precisions import POSITION_INPUT, package_precision, positional_values
from coreml.split import HIDDEN_INPUT, HIDDEN_OUTPUT, Piece, chained_histogram, program_views
from coreml.mil.loader import (
    BlobConst,
    BlobStorage,
    FeatureSpec,
    TensorSpec,
    blob_consts,
    blob_file,
    feature_spec,
    program_spec,
    tensor_spec,
)
from manifests.identity import MANIFEST_NAME
from pipeline.ground.errors import IdentityError

# Ops whose fp16 output is storage (a constant, the fp16 state, the casts around it), not
# arithmetic: they do not make a program compute in fp16.
STORAGE_OPS = ("const", "cast", "read_state", "coreml_update_state")
KIND_KEY = "cmfdeploy.kind"
# The loader interface (coreml.interfaces) the program was converted in.
INTERFACE_KEY = "cmfdeploy.interface"
# A converted program names the bundle it came from by the sha256 of the bundle's manifest.
BUNDLE_SHA_KEY = "cmfdeploy.bundle_manifest_sha256"
# A piece of a split package names its place in the chain (`piece_metadata`).
PIECE_KEY = "cmfdeploy.piece"
# The `package` fields of a split package's pieces alone: what each piece's program states.
PIECE_FIELDS = ("name", "piece", "op_histogram", "package_bytes", "weights", "fp32_ops", "selection")


@dataclass
class ProgramFunction:
    """One function as the program states it: described features and its ops' output types."""

    inputs: dict[str, FeatureSpec]
    outputs: dict[str, FeatureSpec]
    states: dict[str, FeatureSpec]
    results: dict[str, TensorSpec | None]  # output name -> type of the variable the block returns
    returned: dict[str, str] = field(default_factory=dict)  # output name -> the variable the block returns
    producers: dict[str, tuple[str, TensorSpec | None]] = field(default_factory=dict)  # var -> (op type, type)
    ops: Counter = field(default_factory=Counter)
    # (op type, reads, writes, reads by input key, the type of each input key's first argument), in program order
    graph: list[tuple[str, list[str], list[str], dict[str, list[str]], dict[str, TensorSpec | None]]] = field(
        default_factory=list)


@dataclass
class Program:
    spec_path: Path
    functions: dict[str, ProgramFunction]
    default_function: str
    metadata: dict[str, str]
    blobs: list[tuple[str, int, TensorSpec, str]]  # (file name, offset, declared type, where)


def _walk(block, where: str, function: ProgramFunction, blobs: list) -> None:
    for op in block.operations:
        function.ops[op.type] += 1
        at = f"{where}, op {op.type}"
        keyed = {key: [b.name for b in arg.arguments if b.WhichOneof("binding") == "name"]
                 for key, arg in op.inputs.items()}
        types = {key: (function.producers.get(arg.arguments[0].name, (None, None))[1]
                       if arg.arguments[0].WhichOneof("binding") == "name" else tensor_spec(arg.arguments[0].value.type, at))
                 for key, arg in op.inputs.items() if arg.arguments}
        function.graph.append((op.type, [n for names in keyed.values() for n in names], [o.name for o in op.outputs],
                               keyed, types))
        for output in op.outputs:
            function.producers[output.name] = (op.type, tensor_spec(output.type, at))
        for value in op.attributes.values():
            if value.WhichOneof("value") == "blobFileValue":
                spec = tensor_spec(value.type, at)
                if spec is None or None in spec.shape:
                    raise MilError(f"{at}: blob value needs a tensor type of fixed shape")
                blobs.append((value.blobFileValue.fileName, value.blobFileValue.offset, spec, at))
        for inner in op.blocks:
            _walk(inner, where, function, blobs)


def read_program(mlpackage: Path) -> Program:
    """What the saved program at `mlpackage` says about itself (MilError when it cannot be read)."""
    spec_path, model = program_spec(mlpackage)
    desc = model.description
    described = {f.name: f for f in desc.functions}
    functions, blobs = {}, []
    for name, fn in model.mlProgram.functions.items():
        where = f"{spec_path}: function {name}"
        if fn.opset not in fn.block_specializations:
            raise MilError(f"{where}: no block for opset {fn.opset!r}")
        fd = described.get(name, desc)
        block = fn.block_specializations[fn.opset]
        outputs = {f.name: feature_spec(f, where) for f in fd.output}
        function = ProgramFunction(
            inputs={f.name: feature_spec(f, where) for f in fd.input},
            outputs=outputs,
            states={f.name: feature_spec(f, where) for f in fd.state},
            results={},
        )
        _walk(block, where, function, blobs)
        if len(block.outputs) != len(outputs):
            raise MilError(f"{where}: the block returns {len(block.outputs)} values for {len(outputs)} outputs")
        # Outputs are described in the order the block returns them.
        function.results = {o: function.producers.get(var, (None, None))[1] for o, var in zip(outputs, block.outputs)}
        function.returned = dict(zip(outputs, block.outputs))
        functions[name] = function
    default = desc.defaultFunctionName or "main"
    return Program(spec_path, functions, default, dict(desc.metadata.userDefined), blobs)


def op_histogram(program: Program) -> dict[str, dict[str, int]]:
    """Per function: op type -> count, nested blocks included."""
    return {name: dict(sorted(f.ops.items())) for name, f in program.functions.items()}


# --- comparing -------------------------------------------------------------------------------


class _Claims:
    """Compares one manifest's fields with the program; the first difference raises."""

    def __init__(self, where: Path, program: Program):
        self.where, self.program = where, program

    def same(self, field_name: str, claimed, actual, what: str = "the program") -> None:
        if claimed != actual:
            raise IdentityError(
                f"{self.where}: field {field_name!r} is {claimed!r}, but {what} ({self.program.spec_path}) "
                f"says {actual!r}"
            )


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else np.dtype(dtype.numpy).name


def _claimed_dims(claims: _Claims, field_name: str, shape: list, dims: dict, flexible_as_range: bool,
                  enumerated: dict | None = None) -> list:
    """A manifest shape with each symbol replaced by its range (`[lo, hi]`, or `lo` when fixed), or
    by its enumerated sizes (`{"one of": [...]}`) where `enumerated` lists them."""
    out = []
    for d in shape:
        if isinstance(d, str):
            if d not in dims:
                raise IdentityError(f"{claims.where}: field {field_name!r} uses dimension {d!r}, "
                                    f"which 'package.dims' does not define")
            lo, hi = dims[d]
            if lo != hi and flexible_as_range and d in (enumerated or {}):
                out.append({"one of": sorted(enumerated[d])})
            else:
                out.append(lo if lo == hi else (list(dims[d]) if flexible_as_range else "flexible"))
        else:
            out.append(d)
    return out


def _input_dims(spec: FeatureSpec) -> list:
    if spec.enumerated is not None:
        sizes = [sorted({shape[axis] for shape in spec.enumerated}) for axis in range(len(spec.shape))]
        return [axis[0] if len(axis) == 1 else {"one of": axis} for axis in sizes]
    if spec.ranges is None:
        return list(spec.shape)
    return [lo if lo == hi else [lo, hi] for lo, hi in spec.ranges]


def _features(claims: _Claims, kind: str, claimed: list, stated: dict, dims: dict, function: str,
              results: dict | None = None, enumerated: dict | None = None) -> None:
    prefix = f"package.{kind}"
    claims.same(f"{prefix} (names, function {function})", [f["name"] for f in claimed], list(stated))
    for feature in claimed:
        name, spec = feature["name"], stated[feature["name"]]
        at = f"{prefix}[{name}]"
        # An output's description may leave its dtype open; the returned variable states it.
        result = None if results is None else results[name]
        dtype = spec.dtype if spec.dtype is not None or result is None else result.dtype
        claims.same(f"{at}.dtype", feature["dtype"], _dtype_name(dtype))
        if results is None:  # inputs and states: the description carries shape and range
            shape = _claimed_dims(claims, f"{at}.shape", feature["shape"], dims, flexible_as_range=True,
                                  enumerated=enumerated)
            claims.same(f"{at}.shape (function {function})", shape, _input_dims(spec))
        else:  # outputs: the returned variable's type; an unknown dimension is the flexible one
            stated_shape = None if result is None else ["flexible" if d is None else d for d in result.shape]
            shape = _claimed_dims(claims, f"{at}.shape", feature["shape"], dims, flexible_as_range=False)
            claims.same(f"{at}.shape (function {function})", shape, stated_shape)


def _loader_interface(claims: _Claims, block: dict) -> None:
    """The program has the names its recorded interface's loader asserts (`coreml.interfaces`):
    every function's token input first, and a stateful program's functions, mask or position,
    states and logits as its loader reads them."""
    unit, kind = package_interface(block, claims.where), block["kind"]
    if not unit.shapes(kind):
        raise IdentityError(f"{claims.where}: field 'package.interface' is {unit.name!r}, which shapes "
                            f"{list(unit.kinds or ())} packages, not a {kind} one")
    program = claims.program
    if kind != "stateful":
        for name, function in program.functions.items():
            claims.same(f"package.interface ({unit.name!r}: first input of function {name})", unit.token_input,
                        next(iter(function.inputs), None))
        return
    functions = ["main"] if unit.single_function else ["decode", "prefill"]
    claims.same(f"package.interface ({unit.name!r}: functions, default function)",
                (functions, functions[0]), (sorted(program.functions), program.default_function))
    logits = ["logits"] if unit.single_function else logit_outputs(block)
    # A piece of a split package (coreml.split) takes and gives the hidden state where it does not
    # start or end the model, and holds no caches where it has no layers.
    piece = Piece.from_record(block["piece"]) if "piece" in block else None
    first = unit.token_input if piece is None or piece.embeds else HIDDEN_INPUT
    caches = [unit.key_cache, unit.value_cache] if piece is None or piece.layer_count else []
    expected = ([first, unit.mask_input or POSITION_INPUT], caches,
                logits if piece is None or piece.head else [HIDDEN_OUTPUT])
    for name, function in program.functions.items():
        claims.same(f"package.interface ({unit.name!r}: inputs, states, outputs of function {name})", expected,
                    (list(function.inputs), list(function.states), list(function.outputs)))
        if unit.mask_input is not None:
            claims.same(f"package.interface ({unit.name!r}: dtype of {unit.mask_input}, function {name})", MASK_DTYPE,
                        _dtype_name(function.inputs[unit.mask_input].dtype))
        if unit.logits_dtype is not None:
            result = function.results["logits"]
            claims.same(f"package.interface ({unit.name!r}: dtype of logits, function {name})", unit.logits_dtype,
                        _dtype_name(result.dtype if result is not None else None))


def _interface(claims: _Claims, block: dict) -> None:
    program = claims.program
    claimed_functions = sorted(block.get("functions", {"main": {}}))
    claims.same("package.functions", claimed_functions, sorted(program.functions))
    claims.same("package.default_function", block.get("default_function", "main"), program.default_function)
    for name, function in program.functions.items():
        own = block.get("functions", {}).get(name)
        dims = (own or {}).get("dims", block.get("dims", {}))
        enumerated = own.get("enumerated", {}) if own is not None else block.get("enumerated", {})
        _features(claims, "inputs", block["inputs"], function.inputs, dims, name, enumerated=enumerated)
        _features(claims, "outputs", block["outputs"], function.outputs, dims, name, function.results)
        _features(claims, "states", block.get("states", []), function.states, dims, name)


def _context(claims: _Claims, block: dict, architecture: dict) -> None:
    """The context is the largest token count any function takes, and the caches' slot count.
    (A loader's mask may have more key columns than the cache has slots: `mask_extra_columns`.)"""
    program, unit = claims.program, package_interface(block, claims.where)
    tokens = [f.inputs[unit.token_input] for f in program.functions.values() if unit.token_input in f.inputs]
    tops = [hi for spec in tokens for lo, hi in spec.ranges or () if lo != hi]
    tops += [max(sizes) for spec in tokens if spec.enumerated for sizes in zip(*spec.enumerated) if len(set(sizes)) > 1]
    if tops:
        claims.same("package.context", block["context"], max(tops),
                    "the largest flexible input range or enumerated size of the program")
    layers = Piece.from_record(block["piece"]).layer_count if "piece" in block else architecture.get("num_layers")
    expected = [layers, 1, architecture.get("num_kv_heads"), block["context"], architecture.get("head_dim")]
    for function in program.functions.values():
        for name, spec in {**function.inputs, **function.states}.items():
            if name in (unit.key_cache, unit.value_cache):
                claims.same("cache shape [architecture.num_layers, 1, architecture.num_kv_heads, package.context, "
                            f"architecture.head_dim] of {name}", expected, list(spec.shape))
        parts = [function.results.get(name) for name in logit_outputs(block)]
        if all(part is not None and part.shape for part in parts):
            claims.same("architecture.vocab_size", architecture.get("vocab_size"), sum(p.shape[-1] for p in parts),
                        f"the program's logits ({' + '.join(logit_outputs(block))})")


def _head_split(claims: _Claims, block: dict, architecture: dict) -> None:
    """A split head (`package.head_split`): its parts are the logit outputs, in order, tiling the
    vocabulary in rows of at most the part width, each the result of a linear whose weight is
    a [rows, hidden] constant of its own (never a slice of a wider one), read by the token
    lookup's gathers exactly where the record says the lookup reads the parts, and their bytes
    are what those rows hold at the float dtype."""
    split = block.get("head_split")
    if split is None:
        return
    outputs = [f["name"] for f in block["outputs"] if f["name"] == "logits" or f["name"].startswith("logits_")]
    claims.same("package.head_split.parts[].output", [p["output"] for p in split["parts"]], outputs,
                "package.outputs")
    rows = [tuple(p["rows"]) for p in split["parts"]]
    vocab, width = architecture.get("vocab_size"), split["part_width"]
    tiled = [(start, min(start + width, vocab)) for start in range(0, vocab, width)]
    claims.same("package.head_split.parts[].rows", rows, tiled,
                f"the vocabulary {vocab} tiled in rows of package.head_split.part_width {width}")
    hidden, itemsize = architecture.get("hidden_size"), np.dtype(package_precision(block, claims.where).float_dtype).itemsize
    claims.same("package.head_split.bytes", split["bytes"], vocab * hidden * itemsize,
                f"{vocab} rows of {hidden} at {itemsize} bytes")
    for name, function in claims.program.functions.items():
        gathered = {var for op, reads, *_ in function.graph if op == "gather" for var in reads}
        for part, (start, stop) in zip(split["parts"], rows):
            op, weight = _part_weight(function, part["output"])
            producer, spec = function.producers.get(weight, (None, None))
            stated = (op, producer == "const" or str(producer).startswith("constexpr_"),
                      list(spec.shape) if spec is not None else None)
            claims.same(f"package.head_split.parts[{part['output']}] (function {name})",
                        ("linear", True, [stop - start, hidden]), stated,
                        f"the program's producer of {function.returned[part['output']]} (op, weight constant, "
                        "weight shape)")
            claims.same(f"package.head_split.token_lookup (function {name}, {part['output']})",
                        split.get("token_lookup", False), weight in gathered, f"whether a gather reads {weight}")


def _part_weight(function: ProgramFunction, output: str) -> tuple[str | None, str | None]:
    """(the type of the op that makes a head part's `output`, the variable it reads as its weight)."""
    var = function.returned[output]
    op, reads = next(((o, keyed) for o, _, writes, keyed, _ in function.graph if var in writes), (None, {}))
    return op, (reads.get("weight") or [None])[0]


@dataclass(frozen=True)
class StoredTensor:
    """A bundle tensor (or the rows of the head a part holds: `rows`) as a program of the package
    stores it, a plain constant, named by the manifest's `package.weights` or `head_split`."""
    program: str  # the .mlpackage: the package's, or its piece's in a split package
    tensor: str  # the HF name
    rows: tuple[int, int] | None
    const: BlobConst


@dataclass(frozen=True)
class CodedTensor:
    """A bundle tensor (or a head part's rows) a recipe stores as a code, and the sha256 of what
    the recipe computed its decoding to be (None where the recipe records none: hot rows,
    coremltools' own quantizer)."""
    program: str
    tensor: str
    rows: tuple[int, int] | None
    decoded_sha256: str | None
    dtype: np.dtype  # what the code decodes to: the program's float dtype


@dataclass(frozen=True)
class StoredWeights:
    """What a package holds of the bundle's tensors: as plain constants, and as codes."""
    plain: list[StoredTensor]
    coded: list[CodedTensor]


def stored_weights(package_dir: Path, manifest: dict) -> StoredWeights:
    """Every bundle tensor the package's programs hold, in every function: the constants its
    manifest records (`package.weights`, each piece's in a split package) and the head's parts
    (`package.head_split`), each found in the program by the name the manifest gives it, and
    the codes its recipe wrote (`selection.weights`)."""
    plain, coded = [], []
    for name, view in program_views(manifest):
        block, mlpackage = view["package"], Path(package_dir) / view["package"]["name"]
        selection = {const: entry for const, entry in view.get("selection", {}).get("weights", {}).items()
                     if entry["compressed"]}
        dtype = np.dtype(package_precision(block, mlpackage).float_dtype)
        coded += [CodedTensor(name, tensor, tuple(entry["rows"]) if "rows" in entry else None,
                              entry.get("decoded_sha256"), dtype)
                  for entry in selection.values() for tensor in entry["hf_names"]]
        recorded = {const: [(tensor, None) for tensor in tensors] for const, tensors in block.get("weights", {}).items()
                    if const not in selection}
        split = block.get("head_split")
        if split is not None:
            for function in read_program(mlpackage).functions.values():
                for part in split["parts"]:
                    weight = _part_weight(function, part["output"])[1]
                    if not str(function.producers.get(weight, (None,))[0]).startswith("constexpr_"):
                        recorded[weight] = [(split["weight"], tuple(part["rows"]))]
        for const in blob_consts(mlpackage):
            plain += [StoredTensor(name, tensor, rows, const) for tensor, rows in recorded.get(const.name, ())]
    return StoredWeights(plain, coded)


def _arithmetic(function: ProgramFunction, dtype: str) -> dict[str, str]:
    """Result name -> op type of the function's arithmetic ops whose result is `dtype`."""
    return {var: op for var, (op, spec) in function.producers.items()
            if spec is not None and spec.dtype.name == dtype and op not in STORAGE_OPS
            and not op.startswith("constexpr_")}


def _fp16_arithmetic(function: ProgramFunction) -> set[str]:
    """The op types that compute an fp16 result: not those that only move values (`OpDef.moves`),
    which an FP32 program may apply to its fp16 state's layers (each cast to fp16 as its layer is
    done and stacked there, `Decoder.layers_with_cache_tensors`) without rounding anything."""
    return {op for op in _arithmetic(function, "fp16").values() if op not in OPS or not OPS[op].moves}


def _positional(function: ProgramFunction) -> set[str]:
    constants = {var for var, (op, _) in function.producers.items() if op == "const"}
    return positional_values(function.graph, constants)


def kept_fp32_ops(program: Program) -> dict[str, dict[str, int]]:
    """Per function, op type -> count of the float32 arithmetic ops of a program that computes in
    fp16 (none for a program without fp16 arithmetic, where float32 is simply its precision)."""
    if not any(_fp16_arithmetic(f) for f in program.functions.values()):
        return {}
    return {name: dict(sorted(Counter(_arithmetic(f, "fp32").values()).items()))
            for name, f in program.functions.items()}


def _precision(claims: _Claims, block: dict) -> None:
    functions = claims.program.functions
    arithmetic = sorted({op for f in functions.values() for op in _fp16_arithmetic(f)})
    stated = "float16" if arithmetic else "float32"
    claims.same("package.compute_precision", block["compute_precision"], stated,
                f"the program (fp16 results of {arithmetic})" if arithmetic else "the program (no fp16 arithmetic)")
    unit = package_precision(block, claims.where)
    claims.same("package.precision", unit.compute_precision, block["compute_precision"],
                "package.compute_precision, which the program states")
    units = block.get("compute_units", unit.compute_units)
    if units not in unit.allowed_compute_units:
        raise IdentityError(f"{claims.where}: field 'package.compute_units' is {units!r}, which a {unit.name} "
                            f"package cannot run on; it may claim {list(unit.allowed_compute_units)}")
    mask = package_interface(block, claims.where).mask_input
    for kind in ("inputs", "outputs"):
        for feature in block[kind]:
            if feature["name"] == mask:
                claims.same(f"package.{kind}[{mask}].dtype", feature["dtype"], MASK_DTYPE,
                            f"the mask dtype of interface {block['interface']!r}")
            elif feature["dtype"].startswith("float"):
                claims.same(f"package.{kind}[{feature['name']}].dtype", feature["dtype"], unit.float_dtype,
                            f"the float dtype of precision {unit.name!r}")
    if stated == "float16":
        for name, function in functions.items():
            positional = _positional(function)
            stray = {var: op for var, op in _arithmetic(function, "fp32").items() if var not in positional}
            if stray:
                raise IdentityError(
                    f"{claims.where}: the program ({claims.program.spec_path}) computes in fp16 but function {name} "
                    f"keeps {len(stray)} ops in float32 that read activations, e.g. {sorted(stray.items())[:3]}; "
                    "only the positional subgraph may stay float32 (coreml.precisions.positional_values)")
    kept = kept_fp32_ops(claims.program)
    claims.same("package.fp32_ops.ops", block.get("fp32_ops", {}).get("ops", {}),
                kept if any(kept.values()) else {}, "the program's float32 arithmetic ops")


def _producer(claims: _Claims, var: str) -> tuple[str | None, TensorSpec | None]:
    for function in claims.program.functions.values():
        if var in function.producers:
            return function.producers[var]
    return None, None


def _weights(claims: _Claims, manifest: dict) -> None:
    """Each recorded weight is produced as recorded: a plain const, or the compression op the
    selection names, with the recorded shape, feeding the precision's float dtype to its consumers."""
    selection = manifest.get("selection", {}).get("weights", {})
    unit = package_precision(manifest["package"], claims.where)
    for name in manifest["package"].get("weights", {}):
        entry = selection.get(name)
        if entry is not None and entry["compressed"]:
            var, op = entry.get("compressed_as"), entry.get("op")
            at = f"selection.weights[{name}]"
        else:
            var, op, at = name, "const", f"package.weights[{name}]"
        if not isinstance(var, str):
            raise IdentityError(f"{claims.where}: field '{at}.compressed_as' is {var!r}, not a variable name")
        stated_op, spec = _producer(claims, var)
        claims.same(f"{at} (producer of {var})", op, stated_op)
        claims.same(f"{at} (dtype of {var})", unit.float_dtype, _dtype_name(spec.dtype) if spec else None)
        if entry is not None:
            claims.same(f"{at}.shape", entry.get("shape"), list(spec.shape) if spec else None)


def _blob_headers(claims: _Claims) -> None:
    """Every blob's header states the dtype the program declares and holds exactly its bytes."""
    files: dict[str, BlobStorage] = {}
    for file_name, offset, spec, at in claims.program.blobs:
        if file_name not in files:
            files[file_name] = BlobStorage(blob_file(claims.program.spec_path.parent, file_name, at))
        entry = files[file_name].entry(offset, spec.dtype)
        need = (math.prod(spec.shape) * spec.dtype.nbits + 7) // 8
        if entry.size != need:
            raise MilError(f"{at}: blob at {file_name} @ {offset} holds {entry.size} bytes; "
                           f"a {spec.dtype.name} tensor of shape {list(spec.shape)} needs {need}")


def _metadata(claims: _Claims, manifest: dict, from_bundle: bool) -> None:
    metadata, block = claims.program.metadata, manifest["package"]
    claims.same("package.kind", block["kind"], metadata.get(KIND_KEY), f"the program's {KIND_KEY}")
    # Programs converted before interfaces were recorded are cmfdeploy's, as their manifests are.
    claims.same("package.interface", block.get("interface", DEFAULT_INTERFACE),
                metadata.get(INTERFACE_KEY, DEFAULT_INTERFACE), f"the program's {INTERFACE_KEY}")
    for key in package_interface(block, claims.where).name_metadata:
        if not metadata.get(key):
            raise IdentityError(f"{claims.where}: field 'package.interface' is {block['interface']!r}, whose loader "
                                f"reads the metadata key {key!r}, but the program ({claims.program.spec_path}) "
                                "has no value for it")
    if from_bundle:
        claims.same("source.manifest_sha256", manifest["source"].get("manifest_sha256"),
                    metadata.get(BUNDLE_SHA_KEY), f"the program's {BUNDLE_SHA_KEY}")
    if "piece" in block:
        claims.same("package.piece", piece_metadata(Piece.from_record(block["piece"])), metadata.get(PIECE_KEY),
                    f"the program's {PIECE_KEY}")


def piece_metadata(piece: Piece) -> str:
    """What a piece's program says of its place in the chain (PIECE_KEY), for the app that loads it."""
    start, stop = piece.layers
    return f"{piece.index + 1} of {piece.count}; layers {start}..{stop - 1}" if piece.layer_count else \
        f"{piece.index + 1} of {piece.count}; the head alone"


def check_package(package_dir: Path, manifest: dict, from_bundle: bool) -> None:
    """Raise IdentityError at the first claim of `manifest` that the package's program contradicts.
    `from_bundle`: the package was converted from a bundle (not compressed from a package),
    so its program names that bundle (BUNDLE_SHA_KEY) as its manifest's source does. A split
    package's pieces are each checked so, against their own blocks, and together as the model."""
    package_dir = Path(package_dir)
    block = manifest["package"]
    if "pieces" in block:
        _check_chain(package_dir, manifest)
    for _, view in program_views(manifest):
        _check_program(package_dir, view, from_bundle)


def _check_chain(package_dir: Path, manifest: dict) -> None:
    """A split package's pieces are in chain order, their layers tile the model's, and the
    package's op histogram and bytes are theirs together."""
    where, block = package_dir / MANIFEST_NAME, manifest["package"]
    # What a piece's program states is claimed by the piece; on the chain nothing would check it.
    own = sorted(set(block) & set(PIECE_FIELDS))
    if own:
        raise IdentityError(f"{where}: fields {['package.' + name for name in own]} belong to package.pieces[], "
                            "each checked against its piece's program, not to the split package")
    pieces = [Piece.from_record(p["piece"]) for p in block["pieces"]]
    layers = manifest["architecture"].get("num_layers")
    bounds = [0] + [p.layers[1] for p in pieces]
    expected = [Piece(i, len(pieces), (bounds[i], bounds[i + 1]), i == 0, i == len(pieces) - 1).record()
                for i in range(len(pieces))]
    if [p.record() for p in pieces] != expected or bounds[-1] != layers or \
            [p["name"] for p in block["pieces"]] != [p.name for p in pieces]:
        raise IdentityError(f"{where}: field 'package.pieces' {[p['piece'] for p in block['pieces']]} are not "
                            f"pieces 1..{len(pieces)} in order whose layers tile 0..{layers}, named as their place")
    if chained_histogram(block["pieces"]) != manifest["op_histogram"]:
        raise IdentityError(f"{where}: field 'op_histogram' is not the sum of package.pieces[].op_histogram")
    # A compressed package's bytes are its `size_bytes` (its `package_bytes` are its source's).
    field = "size_bytes" if "size_bytes" in manifest else "package_bytes"
    total = sum(p["package_bytes"] for p in block["pieces"])
    if manifest.get(field) != total:
        raise IdentityError(f"{where}: field {field!r} is {manifest.get(field)}, but its pieces hold {total}")


def _check_program(package_dir: Path, manifest: dict, from_bundle: bool) -> None:
    where = package_dir / MANIFEST_NAME
    block = manifest["package"]
    try:
        program = read_program(package_dir / block["name"])
        claims = _Claims(where, program)
        _blob_headers(claims)
    except MilError as error:
        raise IdentityError(f"{where}: the package's program cannot be read: {error}") from None
    _metadata(claims, manifest, from_bundle)
    _loader_interface(claims, block)
    _interface(claims, block)
    _context(claims, block, manifest["architecture"])
    _head_split(claims, block, manifest["architecture"])
    _precision(claims, block)
    _weights(claims, manifest)
    _histogram(claims, manifest["op_histogram"])


def _histogram(claims: _Claims, claimed: dict) -> None:
    stated = op_histogram(claims.program)
    claims.same("op_histogram (functions)", sorted(claimed), sorted(stated))
    for name, counts in stated.items():
        for op in sorted(set(counts) | set(claimed[name])):
            claims.same(f"op_histogram.{name}.{op}", claimed[name].get(op, 0), counts.get(op, 0))
