"""Affine and symmetric block codes (`coreml.codes`), one fp16 scale (and offset) per block
of input columns: int4-b32 (mlx-lm's `q4 g32` grid) and int4-b32-emb8; and per output channel
(the whole input axis one block): int8-pc, a code the Neural Engine reads."""

from dataclasses import dataclass, replace

import numpy as np

from coreml import codes
from coreml.recipes.base import STORAGE, Code, CodeRecipe, register_recipe


@dataclass(frozen=True)
class Affine(Code):
    """Codes per block of `block_size` input columns with fp16 (or fp32) parameters: min/max
    (unsigned codes, a scale and an offset), or `symmetric` absmax (signed codes, a scale)."""

    nbits: int
    block_size: int = 32
    dtype: str = "fp16"
    symmetric: bool = False
    # The block is the smallest divisor of each weight's input axis that is at least
    # `block_size` (the whole axis where it is shorter): a bits-per-weight ceiling that holds
    # on any width, where a fixed block refuses the widths it does not divide.
    at_least: bool = False
    # The offset as a level in the codes' own dtype (GPTQ's zero point): `nbits` a block where
    # a float one takes 16 or 32 (`codes._affine_parameters` says what it costs in fit).
    integer_offset: bool = False

    def record(self) -> dict:
        return {"kind": "symmetric" if self.symmetric else "affine", "nbits": self.nbits,
                **({"block_size_at_least": self.block_size} if self.at_least else {"block_size": self.block_size}),
                "dtype": self.dtype, **({"offset": f"uint{self.nbits}"} if self.integer_offset else {})}

    def for_shape(self, shape: tuple[int, ...]) -> "Affine":
        if not self.at_least or len(shape) != 2:
            return self
        width = shape[1]
        block = next((b for b in range(self.block_size, width + 1) if width % b == 0), width)
        return replace(self, block_size=block, at_least=False)

    def parameter_bits(self) -> int:
        """Bits of one block's (or channel's) scale and offset."""
        width = 16 if self.dtype == "fp16" else 32
        return width + (0 if self.symmetric else self.nbits if self.integer_offset else width)

    def bits(self, shape: tuple[int, ...]) -> float:
        n = int(np.prod(shape))
        return n * self.nbits + n / self.block_size * self.parameter_bits()

    def encode(self, value: np.ndarray) -> codes.ShiftScale:
        if self.symmetric:
            return codes.symmetric_blocks(value, self.nbits, self.block_size, STORAGE[self.dtype])
        return codes.affine_blocks(value, self.nbits, self.block_size, STORAGE[self.dtype], self.integer_offset)


@dataclass(frozen=True)
class PerChannel(Affine):
    """Codes with one fp16 scale (and offset) per output channel: the whole input axis is one
    block. The Neural Engine reads per-channel scales (`coreml.ane.weight_compression`), where
    per-block ones are the GPU's."""

    block_size: int = 0  # unused: the block is each weight's own input axis

    def record(self) -> dict:
        return {"kind": "symmetric" if self.symmetric else "affine", "nbits": self.nbits, "per": "output channel",
                "dtype": self.dtype}

    def bits(self, shape: tuple[int, ...]) -> float:
        return int(np.prod(shape)) * self.nbits + shape[0] * self.parameter_bits()

    def encode(self, value: np.ndarray) -> codes.ShiftScale:
        return Affine.encode(replace(self, block_size=value.shape[1]), value)  # one block: the whole axis


register_recipe(CodeRecipe("int4-b32", Affine(4)))
# The grid a Q4_1/Q8_0 GGUF import carries: the layers' affine uint4 per 32 (fp16 scale
# and offset, as Q4_1 stores them) and the tied embedding/head's int8 per 32 with an fp16
# scale (Q8_0's own), 5.0 and 8.5 bits. docs/COMPRESSION.md: the 4-bit head is what costs
# int4-b32 its top-1 agreement.
register_recipe(CodeRecipe("int4-b32-emb8", Affine(4), embedding=Affine(8, symmetric=True)))
# Q8_0's grid everywhere: int8 per 32 with one fp16 scale, 8.5 bits per weight (mlx-lm's q8
# g64 spends the same on an fp16 scale and offset per 64; coremltools' int8-b32 9.0 on fp32
# scales). A Q8_0 tensor (Gemma 3's embedding/head and v) gets its own codes and scale back;
# the op's fp16 product q * scale then rounds each value once (2^-11 relative), as
# int4-b32-emb8's embedding does.
register_recipe(CodeRecipe("int8-b32-fp16scale", Affine(8, symmetric=True)))
# int8 with one fp16 scale per output channel, symmetric: 8 bits per weight and the scales,
# for the Neural Engine (TARGET=ane), whose per-channel scales it reads; the embedding/head too.
register_recipe(CodeRecipe("int8-pc", PerChannel(8, symmetric=True)))
