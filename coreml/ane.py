"""A static check of a saved program against the Neural Engine's published limits, and the
compute units the program can therefore claim.

    report = ane_report(package_dir / "model.mlpackage")
    report["functions"]["decode"]["checks"]   # [{"check", "verdict": "pass"|"fail", "detail"}, ...]
    report["compute_units"]                   # ["cpu", "gpu"] or ["cpu", "gpu", "ane"]

Core ML decides at load time, op by op, where a program runs; Apple documents no complete list
of what the Neural Engine takes. These checks are the limits public sources state, each a
necessary condition, not a promise that Core ML will place an op there:

- `fp16_compute`: the Neural Engine computes in fp16 only; a FLOAT32-typed ML Program runs on
  the CPU and GPU, never the Neural Engine (coremltools, "Typed Execution",
  https://apple.github.io/coremltools/docs-guides/source/typed-execution.html). Every arithmetic
  op must be fp16, except the positional subgraph an fp16 package keeps in float32 on purpose
  (`coreml.precisions.POSITIONAL_REASON`): it reads only the position input and shapes, runs
  once per call before the first layer, and is listed here as the CPU prologue it becomes.
- `fixed_shapes`: the Neural Engine compiles a program for fixed shapes; a flexible input is
  taken there only as enumerated shapes, never as a range (coremltools, "Flexible Input
  Shapes": "enumerated shapes ... may run on the Neural Engine; range ... CPU or GPU",
  https://apple.github.io/coremltools/docs-guides/source/flexible-inputs.html; ANEMLL converts
  every part at fixed shapes: a batch of 64 for prefill, 1 for decode,
  https://github.com/Anemll/Anemll docs/convert_model.md).
- `dimension_limits`: with a tensor's axes right-aligned onto Core ML's (N, C, H, W), N and C
  at most 65536 and H and W at most 16384, for activations and the weights of linear and matmul
  ops (the limits issue 21 cites from ANEMLL; ANEMLL splits the LM head of a wide vocabulary into
  parts for this reason, `--lut3` "LM head" conversion in docs/convert_model.md, and Apple's
  "Deploying Transformers on the Apple Neural Engine",
  https://machinelearning.apple.com/research/neural-engine-transformers, keeps the channel axis
  in C for the same engine). A vocabulary wider than 16384 fails here until its head is split
  (`coreml.layout`: `cmfdeploy coreml --precision fp16` splits it). A tied table is then looked
  up from the head's parts; an untied head's lookup table [vocab, hidden], which the split leaves
  whole, is a gather's operand, not a matrix one: no
  public source states a limit on a gather's table. It is named in the detail whenever it is
  past the limits, as the lookup that, like the positional prologue, reads only the token ids
  (its indices computed from the integer inputs through integer values alone), runs once
  before the first layer, and falls to the CPU where the Neural Engine does not take it; a
  gather of an over-limit table whose indices an activation reaches fails.
- `weight_compression`: the Neural Engine reads palettized weights (`constexpr_lut_to_dense`,
  scalar LUT entries) and per-channel or per-tensor scales (`constexpr_blockwise_shift_scale`
  whose scale has at most one axis, the whole of it; `constexpr_affine_dequantize`, per-channel
  by definition); per-block scales are the GPU's (coremltools, "Quantization Overview" and
  "Palettization Overview": per-block int4 is "recommended for the GPU", per-channel and LUT
  schemes run on the Neural Engine,
  https://apple.github.io/coremltools/docs-guides/source/opt-quantization-overview.html). Sparse
  weights and vector LUTs, which no source documents for it, fail.
- `no_input_output_alias`: no value is both a function input and one of its outputs (a
  pass-through the Neural Engine cannot bind as input and output at once; states, read and
  written through `read_state`/`coreml_update_state`, are not values and do not count).

A program that passes every check of a function may claim cpu, gpu and ane for that function;
otherwise cpu and gpu (an ML Program runs on both at any precision). The package's claim is what
every function can claim.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from coreml.crosscheck import ProgramFunction, _arithmetic, _positional, read_program
from coreml.precisions import positional_values

ALL_UNITS = ("cpu", "gpu", "ane")
NC_LIMIT, HW_LIMIT = 65536, 16384
WEIGHT_READERS = {"linear": ("weight",), "matmul": ("x", "y"), "conv": ("weight",)}
# Decompression ops and how the Neural Engine takes them (a reason when it does not).
LUT_OP, SCALE_OP, AFFINE_OP = "constexpr_lut_to_dense", "constexpr_blockwise_shift_scale", "constexpr_affine_dequantize"


def _check(name: str, failures: list[str], passed: str) -> dict:
    return {"check": name, "verdict": "fail" if failures else "pass",
            "detail": "; ".join(failures[:5]) + (f"; and {len(failures) - 5} more" if len(failures) > 5 else "")
            if failures else passed}


def fp16_compute(function: ProgramFunction) -> dict:
    fp16, fp32 = _arithmetic(function, "fp16"), _arithmetic(function, "fp32")
    positional = _positional(function)
    stray = sorted(f"{op} -> {var}" for var, op in fp32.items() if var not in positional)
    prologue = sorted({op for var, op in fp32.items() if var in positional})
    if not fp16:
        return _check("fp16_compute", ["no fp16 arithmetic: the program computes in float32"], "")
    return _check("fp16_compute", [f"float32 arithmetic on activations: {s}" for s in stray],
                  f"{len(fp16)} arithmetic ops in fp16" + (
                      f"; the positional prologue ({len(fp32)} ops: {', '.join(prologue)}) runs in float32 "
                      "on the CPU before the first layer" if fp32 else ""))


def fixed_shapes(function: ProgramFunction) -> dict:
    failures = [f"input {name!r} takes a range {[list(r) for r in spec.ranges if r[0] != r[1]]}"
                for name, spec in function.inputs.items()
                if spec.ranges is not None and any(lo != hi for lo, hi in spec.ranges)]
    enumerated = [name for name, spec in function.inputs.items() if spec.enumerated]
    return _check("fixed_shapes", failures,
                  "every input is fixed" + (f" or enumerated ({', '.join(enumerated)})" if enumerated else ""))


def _over_limits(shape: tuple) -> list[str]:
    """Axes of `shape` past the limits, the axes right-aligned onto (N, C, H, W)."""
    over = []
    for index, size in enumerate(shape):
        from_end = len(shape) - index  # W = 1, H = 2, C = 3, N = 4 and beyond
        limit = HW_LIMIT if from_end <= 2 else NC_LIMIT
        if size is not None and size > limit:
            over.append(f"axis {index} = {size} > {limit} ({'W' if from_end == 1 else 'H' if from_end == 2 else 'N/C'})")
    return over


def _integer_values(function: ProgramFunction) -> set[str]:
    """The values computed from the function's integer inputs (token ids, position) and constants
    through integer and boolean values alone: indices no activation reaches (the token lookup's,
    with the converter's wrap of negative indices)."""
    def integral(spec) -> bool:
        return spec is not None and spec.dtype is not None and spec.dtype.name.startswith(("int", "uint", "bool"))

    inputs = [name for name, spec in function.inputs.items() if spec.dtype is not None
              and np.issubdtype(spec.dtype.numpy, np.integer)]
    ops = [step for step in function.graph if all(integral(function.producers[w][1]) for w in step[2])]
    constants = {var for var, (op, _) in function.producers.items() if op == "const"}
    return positional_values(ops, constants, inputs)


def dimension_limits(function: ProgramFunction) -> dict:
    weights = {name for op, _, _, keyed, _ in function.graph if op in WEIGHT_READERS
               for key in WEIGHT_READERS[op] for name in keyed.get(key, ())}
    integers = _integer_values(function)
    tables = {keyed["x"][0]: keyed["indices"][0] in integers
              for op, _, _, keyed, _ in function.graph if op == "gather" and keyed.get("x") and keyed.get("indices")}
    failures, lookups = [], []
    for var, (op, spec) in function.producers.items():
        is_weight = op == "const" or op.startswith("constexpr_")
        if spec is None or (is_weight and var not in weights and var not in tables):
            continue
        if over := _over_limits(spec.shape):
            line = f"{op} -> {var} {list(spec.shape)}: {', '.join(over)}"
            if var in tables and var not in weights:
                (lookups if tables[var] else failures).append(
                    line + ("" if tables[var] else " (a gather table whose indices an activation reaches)"))
            else:
                failures.append(line)
    passed = f"every activation and linear/matmul weight within N, C <= {NC_LIMIT} and H, W <= {HW_LIMIT}"
    if lookups:
        passed += ("; the token lookup's table is past them (" + "; ".join(lookups) + "): a gather reading only "
                   "the token ids, once before the first layer, that runs on the CPU where the Neural Engine does "
                   "not take it")
    return _check("dimension_limits", failures, passed)


def _scale_is_per_channel(data: tuple, scale: tuple) -> bool:
    """At most one axis of the scale is wider than 1, and that axis is the data's whole axis."""
    wide = [axis for axis, size in enumerate(scale) if size != 1]
    return len(wide) <= 1 and all(scale[a] == data[a] for a in wide)


def weight_compression(function: ProgramFunction) -> dict:
    failures, seen = [], {}
    for op, _, writes, _, types in function.graph:
        if not op.startswith("constexpr_"):
            continue
        seen[op] = seen.get(op, 0) + 1
        shape = {key: spec.shape for key, spec in types.items() if spec is not None}
        where = f"{op} -> {writes[0]}"
        if op == LUT_OP:
            if shape.get("lut") and len(shape["lut"]) > 1 and shape["lut"][-1] != 1:
                failures.append(f"{where}: vector LUT (vector size {shape['lut'][-1]}), not documented for the Neural Engine")
        elif op == SCALE_OP:
            if "data" in shape and "scale" in shape and not _scale_is_per_channel(shape["data"], shape["scale"]):
                failures.append(f"{where}: per-block scale {list(shape['scale'])} of data {list(shape['data'])} "
                                "(per-block quantization is the GPU's)")
        elif op != AFFINE_OP:
            failures.append(f"{where}: {op} is not a compression the Neural Engine is documented to read")
    summary = ", ".join(f"{count} {op}" for op, count in sorted(seen.items()))
    return _check("weight_compression", failures,
                  f"palettized or per-channel weights only ({summary})" if seen else "no compressed weights")


def no_input_output_alias(function: ProgramFunction, block_outputs: dict[str, str]) -> dict:
    failures = [f"output {output!r} is input {var!r} itself" for output, var in block_outputs.items()
                if var in function.inputs]
    failures += [f"{name!r} is both an input and an output" for name in sorted(set(function.inputs) & set(function.outputs))]
    return _check("no_input_output_alias", failures, "no input is returned as an output")


def ane_report(mlpackage: Path) -> dict:
    """Each function's checks with their verdicts and the compute units it can claim, and the
    units the package can claim (those every function can)."""
    from coreml.mil.loader import program_spec

    program = read_program(Path(mlpackage))
    _, model = program_spec(Path(mlpackage))
    functions = {}
    for name, function in program.functions.items():
        block = model.mlProgram.functions[name].block_specializations[model.mlProgram.functions[name].opset]
        returned = dict(zip(function.outputs, block.outputs))
        checks = [fp16_compute(function), fixed_shapes(function), dimension_limits(function),
                  weight_compression(function), no_input_output_alias(function, returned)]
        passed = all(c["verdict"] == "pass" for c in checks)
        functions[name] = {"checks": checks, "compute_units": list(ALL_UNITS if passed else ALL_UNITS[:2])}
    units = [u for u in ALL_UNITS if all(u in f["compute_units"] for f in functions.values())]
    return {"functions": functions, "compute_units": units}


def package_ane_report(package_dir: Path, block: dict) -> dict:
    """`ane_report` of the package whose manifest block (`package`) is `block`; of a split
    package (`coreml.split`), each piece's functions as `<piece>:<function>`, and the units
    every piece can claim."""
    if "pieces" not in block:
        return ane_report(Path(package_dir) / block["name"])
    reports = {piece["name"]: ane_report(Path(package_dir) / piece["name"]) for piece in block["pieces"]}
    functions = {f"{name}:{function}": verdicts for name, report in reports.items()
                 for function, verdicts in report["functions"].items()}
    units = [u for u in ALL_UNITS if all(u in report["compute_units"] for report in reports.values())]
    return {"functions": functions, "compute_units": units}


def ane_markdown(report: dict) -> list[str]:
    """The report as markdown lines: one table row per function and check."""
    lines = ["| function | check | verdict | detail |", "|---|---|---|---|"]
    for name, function in report["functions"].items():
        lines += [f"| {name} | {c['check']} | {c['verdict']} | {c['detail']} |" for c in function["checks"]]
    lines += ["", "Compute units the package can claim: " + ", ".join(report["compute_units"])]
    return lines
