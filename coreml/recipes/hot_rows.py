"""Hot rows: the tied embedding/head coded as GPTQ codes it, plus an int8 code of what that
misses on the rows calibration text reads most (`coreml.codes.HotRows`).

Why (docs/COMPRESSION.md, "Where the tied table's loss lives"): a 262k-row table is two
thirds of Gemma 3, and at 4 bits it costs about half its loss in each use. GPTQ fixes the head
use and cannot touch the lookup, which reads only the rows of the tokens in the text: English
text reads a few thousand of them (the 4096 most read in calibration cover 92% of held-out
tokens). Those rows get an int8 correction: 1.6% of the table at 8.5 bits, about 0.06 bits
per weight, and a uint16 slot per row (0.016 bits). Every other row, and every row's share of
the head, keeps the 4-bit code, whose GPTQ already weighs the head use.

The package reads the table twice as before, each time adding the correction
(`coreml.recipes.emit.emit_hot_rows`): the lookup `gather(T, ids) + gather(R, gather(slot,
ids))` and the head `h T^T` with `h R^T` added into its hot columns (a scatter). Its weights
are one matrix, `T + R[slot]`, which `coreml.decoded` hands the gates' reference.
"""

from dataclasses import dataclass, replace

import numpy as np

from coreml import codes
from coreml.calibration import Calibration
from coreml.recipes.affine import Affine
from coreml.precisions import package_precision
from coreml.recipes.base import (STORAGE, Code, Context, Encoder, Prepared, RecipePrecondition, Weight,
                                 register_recipe)
from coreml.recipes.gptq import ZERO_POINT, GptqAffine, GptqRecipe

# Bits of the slot map per table row: a uint16 index (MIL gather takes uint16 indices from iOS17).
SLOT_BITS = 16


@dataclass(frozen=True)
class HotRowsStep(Code):
    """`table`'s GPTQ code of the whole table, and for at most `rows` of its rows, the ones
    calibration text reads most (read at least once), `residual`'s code of what it misses."""

    table: GptqAffine
    rows: int
    residual: Affine = Affine(8, symmetric=True)

    def record(self) -> dict:
        return {**self.table.record(), "hot_rows": {
            "rows": self.rows, "chosen": "the rows calibration text reads most (ties: lower id), each read at least once",
            "residual": self.residual.record(), "slot": f"uint{SLOT_BITS}"}}

    def for_shape(self, shape: tuple[int, ...]) -> "HotRowsStep":
        return replace(self, table=self.table.for_shape(shape))

    def bits(self, shape: tuple[int, ...]) -> float:
        """At most: `rows` hot rows (fewer where calibration reads fewer), the zero row, the
        slots, and the hot ids as int32 (the head's scatter indices)."""
        hot = min(self.rows, shape[0])
        return self.table.bits(shape) + self.residual.bits((hot + 1, shape[1])) + SLOT_BITS * shape[0] + 32 * hot

    def encode(self, value: np.ndarray):
        raise RecipePrecondition(f"hot rows of a {list(value.shape)} table: chosen by calibration text, "
                                 "which a data-free fit does not have")

    def corrected(self, table: codes.ShiftScale, value: np.ndarray, counts: np.ndarray) -> codes.HotRows:
        """`table`, the table step's code of `value`, with its hot rows by `counts` (reads per row)."""
        read = np.flatnonzero(counts)
        hot = read[np.lexsort((read, -counts[read]))][:self.rows]
        return codes.hot_rows(table, value, hot, self.residual.nbits, self.residual.block_size,
                              STORAGE[self.residual.dtype])


@dataclass(frozen=True)
class HotRowsRecipe(GptqRecipe):
    """A GPTQ recipe whose tied embedding/head step is a `HotRowsStep`."""

    embedding: HotRowsStep

    def prepare(self, weights: list[Weight], context: Context) -> Prepared:
        precision = package_precision(context.manifest["package"], context.package_dir)
        if precision.compute_precision != "float32":  # refused before calibration, not after it
            raise RecipePrecondition(f"{context.package_dir}: recipe {self.name} writes hot rows into FP32 programs "
                                     f"only, and this package computes in {precision.compute_precision} "
                                     "(coreml.recipes.emit.emit_hot_rows)")
        return super().prepare(weights, context)

    def encoders(self, weights: list[Weight], calib: Calibration) -> dict[str, Encoder]:
        encoders = super().encoders(weights, calib)
        hessians = calib.input_hessians()
        for w in weights:
            step = self.steps(w)["code"]
            if isinstance(step, HotRowsStep):
                encoders[w.name] = lambda value, h=hessians.get(w.hf_names[0]), s=step, c=calib.row_counts(w.shape[0]): \
                    s.corrected(_table_code(calib, s.table, value, h), value, c)
        return encoders


def _table_code(calib: Calibration, step: GptqAffine, value: np.ndarray, hessian: np.ndarray | None):
    """The table's code as `step` alone codes it (the same GPTQ code, and cache entry, as the
    recipe without hot rows); min/max for a table only looked up (no head use's Hessian)."""
    if hessian is None:
        return step.encode(value)
    return calib.cached_code(lambda: step.encode_for(value, hessian), step.record(), value, hessian)


# gptq-int4-b32-zp with 4096 hot rows: on Gemma 3 4.53 bits per weight, the table's own loss
# from +2.60% to +0.39% of held-out perplexity (docs/COMPRESSION.md). Its layers' codes are
# gptq-int4-b32-zp's, so `mixed` measures them once for both.
register_recipe(HotRowsRecipe("gptq-int4-b32-zp-hot", GptqAffine(4, 32, **ZERO_POINT),
                              embedding=HotRowsStep(GptqAffine(4, 64, at_least=True, **ZERO_POINT), rows=4096)))
