"""Codes written into a MIL program as iOS18 constexpr ops that decode them to the replaced
constant's dtype (float32, or fp16 in an fp16 program)."""

import hashlib
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
from coremltools.converters.mil.mil import Builder as mb
from coremltools.converters.mil.mil import types
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass

from coreml import codes
from coreml.recipes.base import Encoder, RecipePrecondition


def _subbyte(values: np.ndarray, nbits: int, signed: bool) -> np.ndarray:
    """`values` in the numpy dtype coremltools serialises as MIL int4/int8 or uint1..4/uint6/uint8
    (a LUT's indices must be exactly log2 of its size wide: 64 entries take uint6)."""
    if nbits == 8:
        return values.astype(np.int8 if signed else np.uint8)
    return values.astype(types.np_int4_dtype if signed else getattr(types, f"np_uint{nbits}_dtype"))


def _parameters_in_fp16(code):
    """`code` with its float parameters (scale, float offset, LUT) in fp16."""
    def fp16(array):
        return array.astype(np.float16) if array is not None and array.dtype.kind == "f" else array

    if isinstance(code, codes.ShiftScale):
        return replace(code, scale=fp16(code.scale), offset=fp16(code.offset))
    if isinstance(code, codes.Palette):
        return replace(code, lut=fp16(code.lut), row_scale=fp16(code.row_scale))
    return code


# MIL's name of each float dtype a constant can have (coremltools' constexpr_cast `output_dtype`).
MIL_FLOAT = {np.dtype(np.float32): "fp32", np.dtype(np.float16): "fp16"}


def emit_code(code, before_op, dtype: np.dtype = np.dtype(np.float32)) -> "mb.Var":
    """The constexpr op(s) that decode `code` to `dtype`, the replaced constant's own (float32 in
    an FP32 program, fp16 in an fp16 one: its ops read their operands in one dtype), placed before
    `before_op`.

    A constexpr op's output dtype is its scale's or LUT's. fp16 parameters of an FP32 program
    widen to fp32 through iOS18 `constexpr_cast` (whose operands are inputs, so it may read
    another constexpr op's output), exactly; fp32 parameters of an fp16 program (palette4-int8lut's
    LUT) are rounded to fp16 where they are written, as the converter rounds every constant of an
    fp16 program (`constexpr_cast` only widens). The package's decoded weights are read back from
    the program (`coreml.decoded`), so the gates see the rounded values.
    """
    if dtype == np.float16:
        code = _parameters_in_fp16(code)
    if isinstance(code, codes.ShiftScale):
        offset = code.offset
        if offset is not None and offset.dtype.kind in "iu":  # an integer offset has the data's own dtype
            offset = _subbyte(offset, code.nbits, code.signed)
        out = mb.constexpr_blockwise_shift_scale(data=_subbyte(code.data, code.nbits, code.signed),
                                                 scale=code.scale, offset=offset, before_op=before_op)
        decoded = code.scale.dtype
    elif isinstance(code, codes.Palette):
        out = mb.constexpr_lut_to_dense(indices=_subbyte(code.indices, code.nbits, False),
                                        lut=code.lut[..., None], before_op=before_op)
        if code.row_scale is not None:  # coremltools' per-channel scale of a palette (iOS18 joint compression)
            out = mb.constexpr_blockwise_shift_scale(data=out, scale=code.row_scale, before_op=before_op)
        decoded = code.lut.dtype
    elif dtype == np.float16:  # a float16 array in an fp16 program: the constant as it already was
        return mb.const(val=code.astype(np.float16), before_op=before_op)
    else:  # a float16 array: the weight itself, stored at half size
        out, decoded = code.astype(np.float16), np.float16
        return mb.constexpr_cast(source_val=out, output_dtype=MIL_FLOAT[np.dtype(dtype)], before_op=before_op)
    if np.dtype(decoded) != np.dtype(dtype):
        out = mb.constexpr_cast(source_val=out, output_dtype=MIL_FLOAT[np.dtype(dtype)], before_op=before_op)
    return out


def decoded_sha256(code, dtype: np.dtype) -> str:
    """The sha256 of what `emit_code(code, dtype=dtype)`'s ops decode to (C order, in `dtype`),
    by the code's own arithmetic (`decode`) on the parameters as they are written: the recipe's
    record of its weight (`selection.weights[].decoded_sha256`), which the gates hold the
    package's decoding by coremltools to (`pipeline.stages.gates.invariants.WeightsAsIntended`)."""
    if dtype == np.float16:
        code = _parameters_in_fp16(code)
    elif not isinstance(code, (codes.ShiftScale, codes.Palette)):
        code = np.asarray(code).astype(np.float16)  # a plain array is written at half size
    digest = hashlib.sha256()
    for block in codes.decoded_blocks(code):
        digest.update(np.ascontiguousarray(block, dtype))
    return digest.hexdigest()


def emit_hot_rows(code: codes.HotRows, table: "mb.Var", before_op, dtype: np.dtype) -> dict:
    """Add `code`'s correction of its hot rows wherever `table` (its table code's output) is read:
    after a lookup `gather(table, ids)`, `+ gather(residual, gather(slot, ids))` (residual row 0
    is zero, so a cold row's share is an exact zero); after a head `linear(h, table)`, the hot
    columns' `linear(h, residual[1:])` added into the logits by a scatter (no second
    vocabulary-wide tensor). Returns the record `coreml.decoded` reads the weights back by."""
    if dtype != np.float32:
        raise RecipePrecondition(f"hot rows of {table.name}: an fp16 program would round each product apart "
                                 "before the add, a bound not derived (tests/test_coreml_recipes.py holds FP32's)")
    residual = emit_code(code.residual, before_op=before_op, dtype=dtype)
    residual.op.name = f"{table.name}_hot_residual"
    residual.set_name(residual.op.name)
    slot = mb.const(val=code.slot, before_op=before_op, name=f"{table.name}_hot_slot")
    hot_ids = mb.const(val=code.hot_ids.astype(np.int32), before_op=before_op, name=f"{table.name}_hot_ids")
    for reader in list(table.child_ops):
        block = reader.enclosing_block
        following = block.operations.op_to_node[reader].next
        after = following.op if following is not None else None  # None: appended at the block's end
        read, name = reader.outputs[0], f"{table.name}_hot_{reader.name}"  # the builder's own names can repeat the program's
        if reader.op_type == "gather" and reader.x is table and int(reader.axis.val) == 0 and int(reader.batch_dims.val) == 0:
            rows = mb.gather(x=slot, indices=reader.indices, axis=0, before_op=after, name=f"{name}_slot")
            share = mb.gather(x=residual, indices=rows, axis=0, before_op=after, name=f"{name}_rows")
            total = mb.add(x=read, y=share, before_op=after, name=f"{name}_total")
        elif reader.op_type == "linear" and reader.weight is table:
            rank = reader.x.rank
            products = mb.linear(x=reader.x, weight=residual, before_op=after, name=f"{name}_products")
            hot = mb.slice_by_index(x=products, begin=[0] * (rank - 1) + [1], end=[0] * rank,
                                    begin_mask=[True] * (rank - 1) + [False], end_mask=[True] * rank,
                                    before_op=after, name=f"{name}_hot")  # the zero row's column dropped
            total = mb.scatter(data=read, indices=hot_ids, updates=hot, axis=-1, mode="add", before_op=after,
                               name=f"{name}_total")
        else:
            raise RecipePrecondition(f"hot rows of {table.name}: read by {reader.op_type} {reader.name}, whose "
                                     "axes this correction does not know")
        block.replace_uses_of_var_after_op(anchor_op=total.op, old_var=read, new_var=total)
        if read.name == total.name:  # a function output (the logits) keeps its name on the sum: the read gets another
            read.set_name(f"{name}_table")
    return {"residual": residual.name, "slot": slot.name, "hot_ids": hot_ids.name, "rows": int(len(code.hot_ids)),
            "ids_sha256": hashlib.sha256(code.hot_ids.astype("<i4").tobytes()).hexdigest()}


class WriteCodes(AbstractGraphPass):
    """Replace each named float constant by the constexpr ops of the code `encode(value)` gives
    (`value` widened to float32 exactly), decoding to the constant's own dtype. A code with
    hot rows writes its table so and its correction after each read (`emit_hot_rows`);
    `records` gets, by constant name, the sha256 of each code's decoding (`decoded_sha256`) or
    the record of its hot rows."""

    def __init__(self, encoders: Mapping[str, Encoder]):
        super().__init__()
        self.encoders = encoders
        self.records: dict[str, dict] = {}

    def apply(self, prog):
        for function in prog.functions.values():
            for op in list(function.operations):
                if op.op_type == "const" and op.name in self.encoders:
                    code = self.encoders[op.name](np.asarray(op.val.val, dtype=np.float32))
                    dtype = np.dtype(types.nptype_from_builtin(op.outputs[0].dtype))
                    hot = code if isinstance(code, codes.HotRows) else None
                    with function:
                        new = emit_code(code if hot is None else hot.table, before_op=op, dtype=dtype)
                        op.enclosing_block.replace_uses_of_var_after_op(
                            anchor_op=op, old_var=op.outputs[0], new_var=new, no_check_var_types=True)
                        new.set_name(op.name)
                        self.records[op.name] = ({"decoded_sha256": decoded_sha256(code, dtype)} if hot is None
                                                 else {"hot_rows": emit_hot_rows(hot, new, op, dtype)})
                        function.remove_ops([op])
