"""The weights a saved package stores, read from its program.

The conversion manifest maps each program constant that carries a bundle weight to its HF
names (`package.weights`). A compression recipe replaces such a constant by constexpr ops
over stored parts (quantized values, scales, offsets, LUTs, masks) whose output feeds the
same consumers (`selection.weights[<const>].compressed_as` in the compressed manifest).

    weights = decoded_weights("out/chunk_kv-int4-b32")   # HF name -> float32, as the program defines it

Decoding goes through coremltools' own reference `decompress` of each constexpr op, not
through the MIL executor's ops (`coreml/mil/ops.py`): the alignment gate runs the package on
one and builds its PyTorch reference from the other, so a runtime that decodes a weight
otherwise than the program defines it fails the gate's exactness part.
"""

from pathlib import Path

import numpy as np

from coreml.codes import in_row_blocks, with_hot_rows
from coreml.mil.errors import MilError
from coreml.mil.loader import Operation, load_program
from coreml.split import program_views
from manifests.identity import load_manifest
from pipeline.ground.scratch import ScratchFile
from pipeline.ground.reference import UNTIED_HEAD


def weight_vars(manifest: dict) -> dict[str, tuple[str, ...]]:
    """The program variable each bundle weight's consumers read -> its HF names."""
    chosen = manifest.get("selection", {}).get("weights", {})
    return {chosen.get(const, {}).get("compressed_as", const): tuple(hf_names)
            for const, hf_names in manifest["package"].get("weights", {}).items()}


def hot_rows_of(manifest: dict) -> dict[str, dict]:
    """The variable of each table a recipe wrote with hot rows -> their record (the residual's,
    the slot map's and the hot ids' variables: `coreml.recipes.emit.emit_hot_rows`)."""
    chosen = manifest.get("selection", {}).get("weights", {})
    return {entry["compressed_as"]: entry["hot_rows"] for entry in chosen.values() if "hot_rows" in entry}


def _decompress(op: Operation, args: dict) -> np.ndarray:
    """coremltools' reference decompression of one constexpr op (iOS16 and iOS18 forms)."""
    from coremltools.converters.mil.mil.ops.defs.iOS16 import constexpr_ops as ios16
    from coremltools.converters.mil.mil.ops.defs.iOS18 import compression as ios18

    kind = op.type
    if kind == "constexpr_cast":  # no decompress in coremltools: the cast is the whole op
        from coreml.mil.loader import DTYPE_BY_NAME

        return args["source_val"].astype(DTYPE_BY_NAME[str(args["output_dtype"])].numpy)
    if kind == "constexpr_affine_dequantize":
        return ios16.constexpr_affine_dequantize.decompress(
            args["quantized_data"], args["zero_point"], args["scale"], int(args["axis"]))
    if kind in ("constexpr_lut_to_dense", "constexpr_sparse_to_dense") and "shape" in args:
        return getattr(ios16, kind).decompress(**args)
    if kind == "constexpr_lut_to_dense" and args.get("vector_axis") is None:
        return _lut_in_row_blocks(ios18.constexpr_lut_to_dense.decompress, np.asarray(args["indices"]),
                                  np.asarray(args["lut"]))
    if kind == "constexpr_blockwise_shift_scale":
        return _shift_scale_in_row_blocks(ios18.constexpr_blockwise_shift_scale.decompress, np.asarray(args["data"]),
                                          np.asarray(args["scale"]), args.get("offset"))
    if kind in ("constexpr_lut_to_dense", "constexpr_sparse_to_dense", "constexpr_lut_to_sparse",
                "constexpr_sparse_blockwise_shift_scale"):
        method = getattr(ios18, kind).decompress
        names = method.__code__.co_varnames[:method.__code__.co_argcount]
        return method(**{name: args.get(name) for name in names if name != "cls"})
    raise MilError(f"constexpr op {kind} -> {op.outputs[0][0]}: no reference decompression for this op type")


def _lut_in_row_blocks(decompress, indices: np.ndarray, lut: np.ndarray) -> np.ndarray:
    """coremltools' `constexpr_lut_to_dense.decompress`, rows a block of whole LUT tiles at a time:
    it repeats the LUT to every element before looking up (K entries each: 4.1 GB for SmolLM2's
    113 MB embedding at 64 entries)."""
    tile = len(indices) // lut.shape[0]
    per_element = lut.shape[-2] * lut.shape[-1] * lut.itemsize
    return in_row_blocks(decompress, len(indices), tile, indices[:1].size * per_element,
                          lambda start, stop: (indices[start:stop], lut[start // tile:stop // tile], None))


def _shift_scale_in_row_blocks(decompress, data: np.ndarray, scale: np.ndarray, offset) -> np.ndarray:
    """coremltools' `constexpr_blockwise_shift_scale.decompress`, rows a block of whole scale blocks
    at a time: it makes the codes in the scale's dtype, the scale and offset repeated to every
    element, their difference and the product: four arrays of the weight's size at once, 0.45 GB
    for SmolLM2's embedding with float32 scales."""
    unit = len(data) // len(scale)
    offset = None if offset is None else np.asarray(offset)
    return in_row_blocks(decompress, len(data), unit, 4 * data[:1].size * scale.itemsize,
                          lambda start, stop: (data[start:stop], scale[start // unit:stop // unit],
                                               None if offset is None else offset[start // unit:stop // unit]))


class StoredProgram:
    """The default function's constants and constexpr ops of one saved program, by variable:
    the package's, or a piece's of a split package (`name`, `manifest`: one of
    `coreml.split.program_views`)."""

    def __init__(self, package_dir: str | Path, name: str, manifest: dict):
        self.package_dir, self.manifest = Path(package_dir), manifest
        program = load_program(self.package_dir / name)
        function = program.functions[program.default_function]
        self.where = f"{program.path}: function {function.name}"
        self.producers = {name: op for op in function.block.operations for name, _ in op.outputs}
        self.returned = dict(zip((f.name for f in function.spec_outputs), function.block.outputs))

    def _op(self, var: str) -> Operation:
        op = self.producers.get(var)
        if op is None or not (op.type == "const" or op.type.startswith("constexpr_")):
            raise MilError(f"{self.where}: weight variable {var!r} is produced by "
                           f"{op.type if op else 'nothing'}, not by a const or constexpr op")
        return op

    def readers(self, var: str) -> list[Operation]:
        return [op for op in self.producers.values() if any(operand.name == var for operands in op.inputs.values()
                                                              for operand in operands)]

    def hot_rows(self, record: dict) -> tuple[np.ndarray, np.ndarray]:
        """(the residual rows, float32, row 0 zero; the slot of each table row) of a hot-rows record."""
        return self.value(record["residual"]).astype(np.float32), self.value(record["slot"]).astype(np.int64)

    def value(self, var: str) -> np.ndarray:
        op = self._op(var)
        if op.type == "const":
            return np.asarray(op.attributes["val"])
        args = {k: v for k, v in op.attributes.items() if k != "name"}
        for key, operands in op.inputs.items():
            (operand,) = operands
            args[key] = operand.value if operand.name is None else self.value(operand.name)
        return np.asarray(_decompress(op, args))


def hot_rows_head_norm(package_dir: str | Path) -> float | None:
    """max_j |T_j|_2 + |R_j|_2 over a tied table's rows (T its code, R the hot row's residual,
    zero for a cold row), the scale of the absolute terms the package's head sums for logit j
    (`pipeline.ground.models.numerics.model_logits_bound`); None without hot rows on the head."""
    norm = None
    for program in stored_programs(package_dir):
        for var, record in hot_rows_of(program.manifest).items():
            if not any(op.type == "linear" for op in program.readers(var)):  # a table only looked up
                continue
            residual, slot = program.hot_rows(record)
            rows = np.linalg.norm(program.value(var).astype(np.float32), axis=1)
            rows += np.linalg.norm(residual, axis=1)[slot]
            norm = max(norm or 0.0, float(rows.max()))
    return norm


def stored_programs(package_dir: str | Path) -> list[StoredProgram]:
    """Each program of the package at `package_dir`: its one, or its pieces in chain order."""
    return [StoredProgram(package_dir, name, view) for name, view in program_views(load_manifest(Path(package_dir)))]


def decoded_weights(package_dir: str | Path, scratch: ScratchFile | None = None) -> dict[str, np.ndarray]:
    """HF name -> the weight as the package's program defines it, float32, decoded by coremltools;
    with `scratch`, each one held there as it is decoded (a map, not memory of this process).
    A split head's parts (`package.head_split`) are read from the linears that make them and
    joined in row order: as the tied table where the token lookup reads them too
    (`head_split.token_lookup`), else as `lm_head.weight`, constants of their own apart from the
    embedding table a recipe may have compressed otherwise, so the reference built from them is
    untied as the package is (`pipeline.ground.reference.load_reference` takes that name on a
    tied bundle)."""
    out: dict[str, np.ndarray] = {}
    # A split package's pieces each hold their layers' weights; a tied table two of them hold
    # (the first's lookup, the last's head) is one weight only where both hold it alike.
    for program in stored_programs(package_dir):

        def put(name: str, value: np.ndarray, var: str) -> None:
            if name in out and not np.array_equal(out[name], value):
                raise MilError(f"{program.where}: weight {name} is stored twice with different values "
                               f"({var} and another constant); one PyTorch reference cannot hold both")
            if name not in out:
                out[name] = value if scratch is None else scratch.hold(value)

        hot = hot_rows_of(program.manifest)
        for var, hf_names in weight_vars(program.manifest).items():
            value = program.value(var).astype(np.float32, copy=False)
            if var in hot:
                value = with_hot_rows(value, *program.hot_rows(hot[var]))
            for name in hf_names:
                put(name, value, var)
        split = program.manifest["package"].get("head_split")
        if split is not None:
            weights = [program.producers[program.returned[part["output"]]].inputs["weight"][0].name
                       for part in split["parts"]]
            put(split["weight"] if split.get("token_lookup") else UNTIED_HEAD,
                np.concatenate([program.value(w).astype(np.float32) for w in weights]),
                f"the head's parts {', '.join(weights)}")
    return out

