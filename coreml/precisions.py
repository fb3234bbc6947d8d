"""Compute precisions of a package, one registered unit each: what `cmfdeploy coreml
--precision NAME` builds and what every later stage reads back from the package's manifest.

    PRECISIONS["fp16"].compute_precision   # "float16": every arithmetic op typed fp16
    PRECISIONS["fp16"].float_dtype         # "float16": float inputs, outputs and the chunk-KV cache
    PRECISIONS["fp16"].compute_units       # "CPU_AND_NE": the package's intended target, recorded
    PRECISIONS["fp16"].unit_roundoff       # 2**-11: what the gates' exactness bound is built on

The registry is read where nothing is converted (the gates, the CLI's --help), so it imports
neither torch nor coremltools. It also holds the rule that picks the ops an fp16 program keeps
in float32 (`positional_values`): the converter applies it through coremltools' op_selector, and
`coreml.crosscheck` and `coreml.ane` apply it again to the saved program, so a manifest's list of
fp32 ops is checked against the program, never taken on trust.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pipeline.ground.errors import CmfdeployError
from pipeline.ground.registry import Registry
from pipeline.ground.models.numerics import U16, U32

# Core ML's compute units (MLComputeUnits): an FP32-typed ML Program runs on the CPU and the GPU
# only, never on the Neural Engine (coremltools' "Typed Execution" guide:
# https://apple.github.io/coremltools/docs-guides/source/typed-execution.html).
COMPUTE_UNITS = ("CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE", "ALL")

# Why an fp16 program keeps its positional subgraph in float32 (the manifest's `fp32_ops` reason).
POSITIONAL_REASON = (
    "computed from the `position` input and tensor shapes alone (absolute positions, cache-slot "
    "masks, RoPE angles and their cos/sin): fp16 holds integers exactly only up to 2048, and a "
    "RoPE angle p*inv_freq rounded to fp16 is off by up to p*2^-11 rad (0.06 rad at position 128, "
    "1 rad at 2048) before its cos/sin; in float32 the angle errs by p*2^-24 and only cos/sin "
    "are rounded to fp16 where they meet the activations. These ops read no activation"
)
# The input every positional value derives from; shape-only ops make the rest (a chunk's token
# count, the cache's slot count) positional without reading any value.
POSITION_INPUT = "position"
SHAPE_ONLY_OPS = frozenset({"shape", "fill_like"})


class UnknownPrecision(CmfdeployError):
    """A precision no unit of coreml.precisions registers."""


@dataclass(frozen=True)
class Precision:
    """One compute precision: how a package of it is converted and what it claims."""

    name: str
    description: str
    compute_precision: str  # the manifest's package.compute_precision ("float32" | "float16")
    float_dtype: str  # float inputs/outputs, and the K/V cache of a kind that passes it in and out
    compute_units: str  # the intended target recorded in the manifest (MLComputeUnits name)
    allowed_compute_units: tuple[str, ...]  # what a package of this precision may claim at all
    unit_roundoff: float  # of the arithmetic the gates' exactness bound is derived from
    default_budget: str  # the gates' quality budget when the user declares none
    keeps_positional_fp32: bool  # the positional subgraph stays float32 (POSITIONAL_REASON)
    # The Neural Engine's layout (docs/FP16.md "Neural Engine layout"): token counts enumerated
    # (`chunk_lengths`, never a range) and a head wider than coreml.ane.HW_LIMIT split into parts.
    # False for a precision whose programs never run there (an FP32 program runs on CPU and GPU).
    neural_engine_layout: bool = False

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(self.float_dtype)

    def ct_convert_options(self) -> dict:
        """ct.convert's compute_precision, and for fp16 its pass pipeline: coremltools' own with
        the fp16 pass swapped for `BLOCKWISE_FP16_PASS`, whose op_selector keeps the positional
        subgraph (`positional_values`) in float32 where `keeps_positional_fp32`."""
        import coremltools as ct

        if self.compute_precision == "float32":
            return {"compute_precision": ct.precision.FLOAT32}
        if not self.keeps_positional_fp32:
            return {"compute_precision": ct.precision.FLOAT16, "pass_pipeline": _fp16_pipeline(lambda op: True)}
        positional: dict[int, set[str]] = {}  # per block, computed at the pass's first op of it

        def to_fp16(op) -> bool:
            block = op.enclosing_block
            if id(block) not in positional:
                positional[id(block)] = _block_positional(block)
            return not any(o.name in positional[id(block)] for o in op.outputs)

        return {"compute_precision": ct.precision.FLOAT16, "pass_pipeline": _fp16_pipeline(to_fp16)}


# coremltools' fp16 pass with its overflow check done block by block (`_register_blockwise_fp16_pass`).
BLOCKWISE_FP16_PASS = "cmfdeploy::add_fp16_cast"
COREMLTOOLS_FP16_PASS = "common::add_fp16_cast"
# Elements of a constant the overflow check judges at once: 4 MB of float32.
OVERFLOW_CHECK_BLOCK = 1 << 20


def _fp16_pipeline(op_selector):
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipeline

    _register_blockwise_fp16_pass()
    pipeline = PassPipeline()
    pipeline.passes = [BLOCKWISE_FP16_PASS if name == COREMLTOOLS_FP16_PASS else name for name in pipeline.passes]
    pipeline.set_options(BLOCKWISE_FP16_PASS, {"op_selector": op_selector})
    return pipeline


def _register_blockwise_fp16_pass() -> None:
    """Register coremltools' `add_fp16_cast` with one change: its check that a float32 constant
    fits fp16 (`fp16_overflow`) goes block by block. Its own takes abs of the whole constant, the
    int64 indices of its finite-looking entries and their gathered values, about 4 copies at
    once: 0.45 GB for SmolLM2-135M's 113 MB tied table, the conversion's peak, and 2.7 GB for
    Gemma 3's. The rule is the same: an op stays float32 where a float32 constant it reads has an
    entry with 65504 < |v| < 1e38 (|v| >= 1e38 stands for an infinity, which fp16 carries; NaN
    fails both comparisons in either form). The class keeps coremltools' name, so the scope the
    pass writes into the program is the same."""
    from coremltools.converters.mil.mil.passes.defs.quantization import add_fp16_cast as coremltools_pass
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    if BLOCKWISE_FP16_PASS in PASS_REGISTRY:
        return

    class add_fp16_cast(coremltools_pass):
        @staticmethod
        def fp16_overflow(op) -> bool:
            for inputs in op.inputs.values():
                for var in inputs if isinstance(inputs, (list, tuple)) else [inputs]:
                    if var.op is not None and var.op.op_type == "const" and var.is_tensor_or_scalar_of(dtype="fp32"):
                        if overflows_fp16(np.asarray(var.op.val.val)):
                            return True
            return False

    namespace, name = BLOCKWISE_FP16_PASS.split("::")
    PASS_REGISTRY.add(namespace, add_fp16_cast, override=False, name=name)


def overflows_fp16(value: np.ndarray) -> bool:
    """Whether an entry of a float32 `value` has 65504 < |v| < 1e38: fp16 cannot hold it."""
    flat = value.reshape(-1)
    for start in range(0, flat.size, OVERFLOW_CHECK_BLOCK):
        magnitude = np.abs(flat[start:start + OVERFLOW_CHECK_BLOCK])
        if np.any((magnitude > 65504) & (magnitude < 1e38)):
            return True
    return False


def _block_positional(block) -> set[str]:
    """`positional_values` of a coremltools MIL block (pymil), before the fp16 pass runs."""
    ops = []
    for op in block.operations:
        reads = [v.name for value in op.inputs.values() for v in (value if isinstance(value, (list, tuple)) else [value])]
        ops.append((op.op_type, reads, [o.name for o in op.outputs]))
    constants = {o.name for op in block.operations if op.op_type == "const" for o in op.outputs}
    return positional_values(ops, constants)


PRECISIONS: Registry[Precision] = Registry("precision", UnknownPrecision)


def register_precision(precision: Precision) -> Precision:
    return PRECISIONS.add(precision.name, precision)


FP32 = register_precision(Precision(
    name="fp32",
    description="float32 arithmetic, float32 I/O and chunk-KV cache (a stateful cache is fp16: Core ML states are)",
    compute_precision="float32",
    float_dtype="float32",
    compute_units="CPU_ONLY",
    allowed_compute_units=("CPU_ONLY", "CPU_AND_GPU"),
    unit_roundoff=U32,
    default_budget="ppl=2%,top1=0.95",
    keeps_positional_fp32=False,
))
FP16 = register_precision(Precision(
    name="fp16",
    description="fp16 arithmetic (positional subgraph in float32), fp16 I/O and K/V cache",
    compute_precision="float16",
    float_dtype="float16",
    compute_units="CPU_AND_NE",
    allowed_compute_units=COMPUTE_UNITS,
    unit_roundoff=U16,
    default_budget="ppl=0.5%,top1=0.99",
    keeps_positional_fp32=True,
    neural_engine_layout=True,
))


def precision(name: str, where: object = "--precision") -> Precision:
    """The registered precision `name`; UnknownPrecision naming `where` and the known ones otherwise."""
    return PRECISIONS.lookup(name, where)


def package_precision(block: dict, where: object = "package") -> Precision:
    """The precision a manifest's `package` block names (packages made before precisions were
    recorded computed in float32)."""
    return precision(block.get("precision", "fp32"), f"{where}: field 'package.precision'")


def positional_values(ops: Iterable[tuple], constants: Iterable[str],
                      inputs: Iterable[str] = (POSITION_INPUT,)) -> set[str]:
    """The values of one function computed from `inputs`, tensor shapes and constants alone.

    `ops` are (op type, the names of the values it reads, the names it writes, ...) in program order;
    `constants` the names of constant values. A value is positional when its op reads at least
    one positional value and otherwise only constants, or when the op reads shapes alone
    (`SHAPE_ONLY_OPS`). Token ids are not among the inputs, so the embedding lookup and all
    that follows it are not positional.
    """
    positional, constants = set(inputs), set(constants)
    for op_type, reads, writes, *_ in ops:
        reads = [r for r in reads if r not in constants]
        if op_type in SHAPE_ONLY_OPS or (reads and all(r in positional for r in reads)):
            positional.update(writes)
    return positional
