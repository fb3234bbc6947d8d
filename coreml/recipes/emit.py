"""Codes written into a MIL program as iOS18 constexpr ops that decode them to float32."""

from collections.abc import Mapping

import numpy as np
from coremltools.converters.mil.mil import Builder as mb
from coremltools.converters.mil.mil import types
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass

from coreml import codes
from coreml.recipes.base import Encoder


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


class WriteCodes(AbstractGraphPass):
    """Replace each named fp32 constant by the constexpr ops of the code `encode(value)` gives."""

    def __init__(self, encoders: Mapping[str, Encoder]):
        super().__init__()
        self.encoders = encoders

    def apply(self, prog):
        for function in prog.functions.values():
            for op in list(function.operations):
                if op.op_type == "const" and op.name in self.encoders:
                    code = self.encoders[op.name](np.asarray(op.val.val, dtype=np.float32))
                    with function:
                        new = emit_code(code, before_op=op)
                        op.enclosing_block.replace_uses_of_var_after_op(
                            anchor_op=op, old_var=op.outputs[0], new_var=new, no_check_var_types=True)
                        function.remove_ops([op])
                    new.set_name(op.name)
