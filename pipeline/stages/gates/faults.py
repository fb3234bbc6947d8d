"""Converter faults seeded into a correct package, each registered by name: the gates are shown
to catch them (tests/test_gate_faults.py, benchmarks/fault_bench.py).

A fault edits a copy of the package as a converter that wrote wrong numbers would leave it (a
weight, or a constant of the saved program) and then makes the copy's manifest consistent
again (its files' sha256), so the identity chain holds and only the gate's numerics can tell.
The bundle is copied along to where the package's relative source link expects it.

FP32 and fp16 packages alike: a weight is edited where the program stores it (its const's blob,
in the package's dtype, as any fp16 mitigation scaled it), a constant in the program's dtype.
Constants and program edits go into every function (a stateful package's prefill and decode
alike); a constant at the first op of each function that reads it, one layer's where each layer
has its own. A compressed package's weights are not consts, and are refused by name; its codes
are where `code_scale` goes, and only there.
"""

import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.ground.errors import CmfdeployError


class FaultNotApplicable(CmfdeployError):
    """The fault cannot be seeded into this package (its weight or constant is not there once)."""


@dataclass(frozen=True)
class Fault:
    name: str
    what: str  # the converter mistake it stands for
    seed: Callable[[Path, Path, dict], str]  # (mlpackage, bundle, arch) -> where it was seeded


FAULTS: dict[str, Fault] = {}


def register_fault(name: str, what: str):
    def register(seed):
        FAULTS[name] = Fault(name, what, seed)
        return seed

    return register


def seeded_copy(package_dir: Path, bundle_dir: Path, out_dir: Path, fault: str) -> tuple[Path, str]:
    """`package_dir` copied to `out_dir` with `fault` seeded and its manifest made consistent again;
    (the copy, where the fault was seeded)."""
    from coreml.kinds.export import kept_fp32_record
    from coreml.manifest import op_histogram
    from coreml.split import chained_histogram
    from manifests.identity import MANIFEST_NAME, inventory, read_json, write_json

    if fault not in FAULTS:
        raise FaultNotApplicable(f"fault {fault!r} is not among {sorted(FAULTS)}")
    package_dir, out_dir = Path(package_dir), Path(out_dir)
    manifest = read_json(package_dir / MANIFEST_NAME)
    shutil.copytree(package_dir, out_dir)
    _copy_lineage(package_dir, out_dir, Path(bundle_dir))
    arch = read_json(Path(bundle_dir) / "config.json")["arch"]
    # A split package's fault goes into the piece that holds the middle layer, the one each fault edits.
    middle, pieces = _middle_layer(arch), manifest["package"].get("pieces")
    name = "model.mlpackage" if pieces is None else next(
        p["name"] for p in pieces if p["piece"]["layers"][0] <= middle < p["piece"]["layers"][1])
    where = FAULTS[fault].seed(out_dir / name, Path(bundle_dir), arch)
    # A program edit adds ops: the records a converter that wrote them would have made, its op
    # histogram and, in fp16, its float32 ops.
    for block, program in ([(manifest["package"], name)] if pieces is None else
                           [(piece, piece["name"]) for piece in pieces]):
        if "fp32_ops" in block:
            block["fp32_ops"] = kept_fp32_record(out_dir / program)
        (manifest if pieces is None else block)["op_histogram"] = op_histogram(out_dir / program)
    if pieces is not None:
        manifest["op_histogram"] = chained_histogram(pieces)
    manifest["files"] = inventory(out_dir)
    write_json(out_dir / MANIFEST_NAME, manifest)
    return out_dir, where


def _copy_lineage(package_dir: Path, copy: Path, bundle_dir: Path) -> None:
    """What `copy`'s relative source link expects, copied there from `package_dir`'s: the bundle,
    or a compressed package's source package and, in turn, its own. A copy beside the original
    (the same depth under the same folder) links to the original's source itself."""
    from manifests.identity import MANIFEST_NAME, read_json

    relative = read_json(package_dir / MANIFEST_NAME)["source"]["relative_path"]
    source, linked = (Path(os.path.normpath(folder / relative)) for folder in (package_dir, copy))
    if linked.exists() and linked.samefile(source):
        return
    shutil.copytree(source, linked, dirs_exist_ok=True)
    if not source.samefile(bundle_dir):
        _copy_lineage(source, linked, bundle_dir)


# ------------------------------------------------------------------ weights

def _stored_weights(mlpackage: Path, name: str) -> list[tuple[Path, int, object, tuple[int, ...]]]:
    """(weight file, blob offset, MIL dtype, shape) of every distinct blob holding bundle weight
    `name` as the program stores it: the const coremltools names after the module path
    (`model_model_layers_8_mlp_down_proj_weight`), `_to_fp16` in an fp16 program. A stateful
    package's functions share their blobs; each is edited once."""
    from coreml.mil.loader import blob_file, program_spec, tensor_spec

    spec_path, model = program_spec(mlpackage)
    pattern = re.compile(r"(?:^|_)" + re.escape(name.replace(".", "_")) + r"(?:_to_fp16)?$")
    found = {}
    for function_name, function in model.mlProgram.functions.items():
        for op in function.block_specializations[function.opset].operations:
            value = op.attributes["val"] if op.type == "const" and "val" in op.attributes else None
            if value is None or value.WhichOneof("value") != "blobFileValue" or not pattern.search(op.outputs[0].name):
                continue
            spec = tensor_spec(value.type, f"{spec_path}: function {function_name}")
            path = blob_file(spec_path.parent, value.blobFileValue.fileName, str(spec_path))
            found[(path, value.blobFileValue.offset)] = (spec.dtype, spec.shape)
    if not found:
        raise FaultNotApplicable(f"{spec_path}: no const of the program stores {name} uncompressed")
    return [(path, offset, dtype, shape) for (path, offset), (dtype, shape) in found.items()]


def _edit_weight(mlpackage: Path, name: str, edit: Callable[[np.ndarray], np.ndarray]) -> None:
    """Bundle weight `name` as the package stores it (FP32 or fp16, and scaled where an fp16
    mitigation rescales it) replaced in place by `edit` of its stored values, computed in
    float32 and rounded once to the stored dtype."""
    for path, offset, dtype, shape in _stored_weights(mlpackage, name):
        _rewrite_blob(path, offset, dtype, shape, lambda stored: edit(stored.astype(np.float32)))


def _rewrite_blob(path: Path, offset: int, dtype, shape: tuple[int, ...],
                  edit: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """The blob at `offset` of the weight file `path` (MIL `dtype`, `shape`) replaced in place by
    `edit` of its values, rounded to `dtype`; returns the values it held."""
    from coreml.mil.loader import BlobStorage

    storage = BlobStorage(path)
    entry = storage.entry(offset, dtype)
    stored = storage.read(offset, dtype, shape).copy()
    del storage  # its read-only map, before the file is written
    wrong = np.ascontiguousarray(edit(stored), dtype.numpy)
    with open(path, "r+b") as blob:
        blob.seek(entry.data_offset)
        blob.write(wrong.tobytes())
    return stored


def _bundle_tensor(bundle: Path, name: str) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(bundle / "weights.safetensors", framework="numpy") as weights:
        return weights.get_tensor(name).astype(np.float32)


def _middle_layer(arch: dict) -> int:
    return arch["num_layers"] // 2


@register_fault("matrix_scale", "one matrix written 0.1% too large (one layer's down_proj x (1 + 1e-3))")
def _matrix_scale(mlpackage: Path, bundle: Path, arch: dict) -> str:
    name = f"model.layers.{_middle_layer(arch)}.mlp.down_proj.weight"
    _edit_weight(mlpackage, name, lambda w: w * np.float32(1 + 1e-3))
    return name


# A layer's norms, in the order a fault picks the first one its program stores: an fp16 conversion
# may move a norm's gain into the matrices that read the norm (Gemma 3's input norms).
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@register_fault("norm_rows_swapped", "two entries of a norm's weight swapped (the largest and the smallest)")
def _norm_rows_swapped(mlpackage: Path, bundle: Path, arch: dict) -> str:
    layer = _middle_layer(arch)
    for norm in LAYER_NORMS:
        name = f"model.layers.{layer}.{norm}.weight"
        try:
            _stored_weights(mlpackage, name)
            break
        except FaultNotApplicable:
            continue
    else:
        raise FaultNotApplicable(f"{mlpackage}: no const of the program stores a norm weight of layer {layer} "
                                 f"uncompressed (tried {', '.join(LAYER_NORMS)})")
    right = _bundle_tensor(bundle, name)
    low, high = int(np.argmin(right)), int(np.argmax(right))

    def swap(w):
        w = w.copy()
        w[[low, high]] = w[[high, low]]
        return w

    _edit_weight(mlpackage, name, swap)
    return f"{name}[{low}] <-> [{high}]"


@register_fault("kv_heads_swapped", "two K/V heads of one layer swapped (k_proj's and v_proj's rows)")
def _kv_heads_swapped(mlpackage: Path, bundle: Path, arch: dict) -> str:
    if arch["num_kv_heads"] < 2:
        raise FaultNotApplicable(f"{bundle}: one K/V head, none to swap")
    layer, dim = _middle_layer(arch), arch["head_dim"]
    for part in ("k_proj", "v_proj"):
        _edit_weight(mlpackage, f"model.layers.{layer}.self_attn.{part}.weight",
                     lambda w: np.concatenate([w[dim:2 * dim], w[:dim], w[2 * dim:]]))
    return f"layer {layer}: K/V heads 0 and 1"


@register_fault("code_scale", "one block's scale of a compressed weight one fp16 step off (one layer's "
                              "down_proj: its code's first scale, or LUT entry where it has no scale)")
def _code_scale(mlpackage: Path, bundle: Path, arch: dict) -> str:
    """The first `scale` (else `lut`) constant the decompression ops of the middle layer's
    down_proj read, walking from the op its consumers read inwards, with its first entry the
    next value of its dtype up: every function reads the one blob."""
    from coreml.mil.loader import blob_file, program_spec, tensor_spec
    from coreml.split import program_views
    from manifests.identity import MANIFEST_NAME, read_json

    name = f"model.layers.{_middle_layer(arch)}.mlp.down_proj.weight"
    view = dict(program_views(read_json(mlpackage.parent / MANIFEST_NAME)))[mlpackage.name]
    coded = [entry for entry in view.get("selection", {}).get("weights", {}).values()
             if entry["compressed"] and name in entry["hf_names"]]
    if not coded:
        raise FaultNotApplicable(f"{mlpackage}: the package stores {name} uncompressed")
    spec_path, model = program_spec(mlpackage)
    function = next(iter(model.mlProgram.functions.values()))
    producers = {out.name: op for op in function.block_specializations[function.opset].operations for out in op.outputs}
    var, value, what = coded[0]["compressed_as"], None, None
    while value is None and var in producers and producers[var].type.startswith("constexpr_"):
        op = producers[var]
        key = next((k for k in ("scale", "lut") if k in op.inputs), None)
        if key is None:
            var = next(a.name for k in ("data", "source_val", "indices") if k in op.inputs
                       for a in op.inputs[k].arguments)
            continue
        argument, what = op.inputs[key].arguments[0], f"{op.type} {op.outputs[0].name}'s {key}"
        # Bound in place (a value), or by a const op's name.
        value = argument.value if argument.WhichOneof("binding") == "value" else producers[argument.name].attributes["val"]
    if value is None or value.WhichOneof("value") != "blobFileValue":
        raise FaultNotApplicable(f"{spec_path}: the code of {name} reads no scale or LUT from the weight file")
    spec = tensor_spec(value.type, str(spec_path))
    if spec.dtype.numpy.kind != "f":
        raise FaultNotApplicable(f"{spec_path}: {what} is {spec.dtype.name}, not a float")

    def step_first(values):
        stepped = values.copy()
        stepped.reshape(-1)[0] = np.nextafter(values.reshape(-1)[0], np.inf, dtype=values.dtype)
        return stepped

    path = blob_file(spec_path.parent, value.blobFileValue.fileName, str(spec_path))
    first = _rewrite_blob(path, value.blobFileValue.offset, spec.dtype, tuple(spec.shape), step_first).reshape(-1)[0]
    return f"{name}: {what}, entry 0 {first} -> {np.nextafter(first, np.inf, dtype=first.dtype)}"


# ------------------------------------------------------------------ program constants

def _edit_program(mlpackage: Path, edit: Callable[[str, object], list[str]], nothing: str) -> str:
    """`edit(function name, its ops)` run on every function of the saved program, which it edits
    in place, saying what it did; FaultNotApplicable with `nothing` where no function was edited."""
    from coreml.mil.loader import program_spec

    spec_path, model = program_spec(mlpackage)
    edited = []
    for function_name, function in model.mlProgram.functions.items():
        edited += edit(function_name, function.block_specializations[function.opset].operations)
    if not edited:
        raise FaultNotApplicable(f"{spec_path}: {nothing}")
    spec_path.write_bytes(model.SerializeToString())
    return "; ".join(edited)


def _const_op(name: str, declared, value: float):
    """A MIL const `name` of `declared`'s dtype (FP32 or fp16) and shape, an unknown dimension 1,
    every entry `value`: it broadcasts where a value of that type was read, and an op reading it
    keeps its declared shape (Gemma's per-head norms declare their heads' dimension)."""
    from coremltools.proto import MIL_pb2

    shape = [dim.constant.size if dim.WhichOneof("dimension") == "constant" else 1 for dim in declared.dimensions]
    tensor_type = MIL_pb2.TensorType(dataType=declared.dataType, rank=declared.rank)
    for size in shape:
        tensor_type.dimensions.add().constant.size = size
    op = MIL_pb2.Operation(type="const")
    op.outputs.add(name=name).type.tensorType.CopyFrom(tensor_type)
    op.attributes["val"].type.tensorType.CopyFrom(tensor_type)
    count = int(np.prod(shape))
    if declared.dataType == MIL_pb2.FLOAT16:
        op.attributes["val"].immediateValue.tensor.bytes.values = np.full(count, value, np.float16).tobytes()
    else:
        op.attributes["val"].immediateValue.tensor.floats.values.extend([float(np.float32(value))] * count)
    return op


def _scalar_value(value) -> np.ndarray | None:
    """A const's immediate float scalar as a writable one-element array of its dtype (fp32
    `floats`, fp16 little-endian `bytes`), or None for any other const."""
    from coremltools.proto import MIL_pb2

    if value.WhichOneof("value") != "immediateValue" or value.type.tensorType.rank != 0:
        return None
    dtype = value.type.tensorType.dataType
    tensor = value.immediateValue.tensor
    if dtype == MIL_pb2.FLOAT32 and len(tensor.floats.values) == 1:
        return np.array(tensor.floats.values, np.float32)
    if dtype == MIL_pb2.FLOAT16 and len(tensor.bytes.values) == 2:
        return np.frombuffer(tensor.bytes.values, np.float16).copy()
    return None


def _scale_constant(mlpackage: Path, value: float, factor: float, what: str, readers: tuple[str, ...] = ()) -> str:
    """The scalar float constant `value` (as the program's dtype rounds it: an fp16 program holds
    it in fp16) read by the first op of each function that reads it (of the op types `readers`,
    where given), times `factor`."""

    def scale(function_name, ops):
        scalars = {}
        for op in ops:
            val = op.attributes["val"] if op.type == "const" and "val" in op.attributes else None
            scalar = None if val is None else _scalar_value(val)
            if scalar is not None and scalar[0] == scalar.dtype.type(value):
                scalars[op.outputs[0].name] = (val, scalar)
        reader = next((op for op in ops if op.type != "const" and (not readers or op.type in readers) and any(
            a.name in scalars for arg in op.inputs.values() for a in arg.arguments)), None)
        if reader is None:
            return []
        const = next(a.name for arg in reader.inputs.values() for a in arg.arguments if a.name in scalars)
        val, scalar = scalars[const]
        scaled = (scalar.astype(np.float32) * np.float32(factor)).astype(scalar.dtype)
        if scaled.dtype == np.float16:
            val.immediateValue.tensor.bytes.values = scaled.tobytes()
        else:
            val.immediateValue.tensor.floats.values[0] = float(scaled[0])
        return [f"{function_name}: {const} (read by {reader.type} -> {reader.outputs[0].name})"]

    return _edit_program(mlpackage, scale, f"no op reads {what} {value:g}")


@register_fault("attention_scale", "one layer's attention scale x 1.01")
def _attention_scale(mlpackage: Path, bundle: Path, arch: dict) -> str:
    scalar = arch.get("query_pre_attn_scalar") or arch["head_dim"]
    return _scale_constant(mlpackage, float(np.float32(scalar ** -0.5)), 1.01, "the attention scale")


@register_fault("rmsnorm_eps", "one RMSNorm's epsilon x 100")
def _rmsnorm_eps(mlpackage: Path, bundle: Path, arch: dict) -> str:
    """The eps an fp16 package's mitigations left (`pipeline.ground.models.fp16`): eps alpha^2 under
    a residual scale alpha, added to the mean square (the `add`); in the max-scaled form its root
    alpha sqrt(eps), squared after the division by the row's max (the `mul`), so x 10 there."""
    from manifests.identity import MANIFEST_NAME, read_json

    numerics = read_json(mlpackage.parent / MANIFEST_NAME).get("numerics") or {}
    mitigations = (numerics.get("mitigations") or {}).get("record") or {}
    eps = np.float32(arch["rms_norm_eps"] * mitigations.get("residual_scale", 1.0) ** 2)
    if mitigations.get("rmsnorm") == "max_scaled":
        return _scale_constant(mlpackage, float(np.float32(np.sqrt(eps))), 10.0, "RMSNorm's root epsilon", ("mul",))
    return _scale_constant(mlpackage, float(eps), 100.0, "RMSNorm's epsilon", ("add",))


# ------------------------------------------------------------------ program edits: positions
# The decoder's positions enter three computations (`pipeline.ground.models.base.CacheStep`,
# `_cos_sin`), each an op of its own in the saved program, reading the chunk's positions P
# ([T, 1], float32): the cache write `equal(slots, P)`, the causal mask `less_equal(slots, P)`,
# and RoPE's `mul(P, inv_freq)`. A converter that got one of them a position off is seeded by
# reading P + 1 there instead: an `add` inserted before that op alone.


def _positions_readers(ops) -> tuple[str, str, list]:
    """(slots, P, the mask's ops) of a function: the causal mask is the `less_equal` of the
    cache's slot indices and the positions, each function's one (rows apart, a reference-only
    form, is never converted)."""
    masks = [op for op in ops if op.type == "less_equal"]
    if not masks:
        raise FaultNotApplicable("no less_equal op (the causal mask of slots and positions)")
    slots, positions = (masks[0].inputs[key].arguments[0].name for key in ("x", "y"))
    return slots, positions, masks


def _shift_readers(mlpackage: Path, pick: Callable[[list, str, str, list], list], what: str) -> str:
    """Each op `pick(ops, slots, positions, masks)` names, in every function, made to read
    positions + 1 where it read the positions: an `add` of a float32 1 inserted before it."""
    from coremltools.proto import MIL_pb2

    def shift(function_name, ops):
        try:
            slots, positions, masks = _positions_readers(ops)
        except FaultNotApplicable as error:
            raise FaultNotApplicable(f"{mlpackage}: function {function_name}: {error}") from None
        producer = next(op for op in ops if any(out.name == positions for out in op.outputs))
        edited = []
        for index, reader in enumerate(pick(list(ops), slots, positions, masks)):
            shifted = f"fault_{positions}_plus_one_{index}"
            one = _const_op(f"{shifted}_y", MIL_pb2.TensorType(dataType=MIL_pb2.FLOAT32), 1.0)
            add = MIL_pb2.Operation(type="add")
            add.inputs["x"].arguments.add(name=positions)
            add.inputs["y"].arguments.add(name=one.outputs[0].name)
            add.outputs.add(name=shifted).type.CopyFrom(producer.outputs[0].type)
            for argument in (a for arg in reader.inputs.values() for a in arg.arguments if a.name == positions):
                argument.name = shifted
            at = list(ops).index(reader)
            ops.insert(at, add)
            ops.insert(at, one)
            edited.append(f"{function_name}: {reader.type} -> {reader.outputs[0].name} reads {positions} + 1")
        return edited

    return _edit_program(mlpackage, shift, f"no op computes {what} from the positions")


@register_fault("rope_shifted", "RoPE's positions one ahead (every layer's cos and sin at position + 1)")
def _rope_shifted(mlpackage: Path, bundle: Path, arch: dict) -> str:
    def rope(ops, slots, positions, masks):  # mul(P, inv_freq): one per RoPE base
        return [op for op in ops if op.type == "mul" and positions in
                (op.inputs[key].arguments[0].name for key in ("x", "y"))]

    return _shift_readers(mlpackage, rope, "RoPE's angles")


@register_fault("mask_leak", "the causal mask one position late: each query sees the next token")
def _mask_leak(mlpackage: Path, bundle: Path, arch: dict) -> str:
    return _shift_readers(mlpackage, lambda ops, slots, positions, masks: masks, "the causal mask")


@register_fault("cache_slot_off", "the K/V cache written one slot late")
def _cache_slot_off(mlpackage: Path, bundle: Path, arch: dict) -> str:
    def write(ops, slots, positions, masks):  # equal(slots, P): the one-hot write of the chunk's K/V
        return [op for op in ops if op.type == "equal" and [op.inputs[key].arguments[0].name for key in ("x", "y")]
                == [slots, positions]]

    return _shift_readers(mlpackage, write, "the cache write")


# ------------------------------------------------------------------ program edits: fp16 mitigations

@register_fault("norm_unscaled", "the max-scaled RMSNorm's scaling dropped: every norm squares its input "
                                 "itself, as the plain form does, and overflows where |x| > 255.9 in fp16")
def _norm_unscaled(mlpackage: Path, bundle: Path, arch: dict) -> str:
    """Every max-scaled norm's divisor m (`pipeline.ground.models.fp16.MaxScaledRMSNorm`: the
    `maximum` of max|x| and a floor, read by the `real_div` of x and by the `inverse` of its eps
    term) replaced by a constant 1: x * rsqrt(mean(x**2) + eps), the function unchanged and its
    overflow guard gone."""

    def unscale(function_name, ops):
        maxima = {op.outputs[0].name: op for op in ops if op.type == "maximum"}
        divisors = sorted({op.inputs["y"].arguments[0].name for op in ops if op.type == "real_div"} & set(maxima))
        for index, divisor in enumerate(divisors):
            one = _const_op(f"fault_unscaled_{index}", maxima[divisor].outputs[0].type.tensorType, 1.0)
            for argument in (a for op in ops for arg in op.inputs.values() for a in arg.arguments if a.name == divisor):
                argument.name = one.outputs[0].name
            ops.insert(0, one)
        return [f"{function_name}: {len(divisors)} norms"] if divisors else []

    return _edit_program(mlpackage, unscale, "no max-scaled RMSNorm (a real_div by a maximum) to unscale")
