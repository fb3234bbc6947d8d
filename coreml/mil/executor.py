"""Run one function of a loaded ML Program with numpy.

Constants (`const` and the `constexpr_*` decompression ops) are evaluated once when the
executor is built; `run` then walks the remaining operations in program order, binding values
by name. Every op result is cast to the dtype the program declares for it and checked against
the declared fixed dimensions, so dtype rules (fp16 states, int32 indices, bool masks) hold
exactly and a wrong op implementation fails at the op, not at the logits.

fp16 programs (compute_precision FLOAT16) run in the accumulation model this executor emulates:
float32 inside an op, fp16 at its boundaries. Every fp16 operand is widened to float32 before the
op's numpy function sees it (constants once, here; activations and states at each call), the op
computes in float32 (its sums, exp, rsqrt, matrix products: numpy's float16 loops would round
after every element, and its float16 matmul has no BLAS path and is two orders slower), and
`_conform` rounds the result to the fp16 the program declares, to nearest even. That is what the
GPU does by default: Core ML keeps fp16 weights and intermediate tensors but accumulates in
float32 unless `MLModelConfiguration.allowLowPrecisionAccumulationOnGPU` is set
(https://developer.apple.com/documentation/coreml/mlmodelconfiguration/allowlowprecisionaccumulationongpu;
coremltools' typed-execution guide,
https://apple.github.io/coremltools/docs-guides/source/typed-execution.html: an FLOAT16-typed
program's values are fp16 on every unit, an FLOAT32-typed one runs on CPU and GPU only). The
Neural Engine's internal accumulator is not documented (public reverse engineering,
github.com/hollance/neural-engine docs/16-bit.md, finds fp16 storage throughout); every unit
agrees with this model at op boundaries, where the program's types are, and a gate bound
derived from fp16's unit roundoff at each boundary plus float32 within an op is what holds for
the GPU, the documented case. Weight decompression (`constexpr_*`, evaluated once at load) is
the exception: MIL defines it in its operands' dtype, so it sees them as stored.

Constants cost no memory of the process: a `const` is a view of the package's weight file,
and a value made here once (a decompressed weight, an fp16 constant widened to float32) is
moved to a scratch file and read back through a map (`pipeline.ground.scratch`), so a
compressed package's weights are held as the FP32 package's are. A run drops each map's pages
from the process once the step that read them is done (`pipeline.ground.pages`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

import numpy as np

from coreml.mil.errors import MilError, UnsupportedOp
from coreml.mil.loader import FeatureSpec, Function, Operation, Program, TensorSpec
from coreml.mil.ops import OPS, SLICE_KEYS, index_slices
from pipeline.ground.halves import as_dtype
from pipeline.ground.pages import is_mapped, release_pages
from pipeline.ground.scratch import ScratchFile

# Ops that take a part of their `x` as it is: one reading a cast's result may read what was cast
# (`Executor._slice_before_casts`).
SLICES = frozenset({"slice_by_index", "slice_by_size"})
# A value the executor makes once and at least this large goes to its scratch file.
SCRATCH_BYTES = 1 << 20
# A single-token step reads every weight for one token, and dropping each weight's pages after
# its op, to fault them in again the next step, was half of it (Gemma 3's chunk-KV step: 163 ->
# 85 ms). A program whose mapped constants are at most this many bytes keeps their pages between
# single-token runs (`run(..., single_token=True)`), so its process's total RSS grows by at most
# that much while it decodes (SmolLM2-135M's chunk-KV gate: 1.4 GiB before); a larger model
# (the 1.7B's 6.85 GB, whose gate was 10.6 GiB) drops them after every op, as every other run does.
RESIDENT_DECODE_BYTES = 2 << 30


class StateCell:
    """One state buffer; writes keep its declared dtype and shape (Core ML states are fixed)."""

    def __init__(self, name: str, value: np.ndarray):
        self.name = name
        self.value = value

    def write(self, data: np.ndarray) -> None:
        data = np.asarray(data)
        if data.shape != self.value.shape:
            raise MilError(f"state {self.name!r}: write of shape {data.shape} into {self.value.shape}")
        self.value = as_dtype(data, self.value.dtype) if data.dtype != self.value.dtype else data.copy()


class State:
    """The states of one function, updated in place by `run(..., state=)`. Same reading and
    writing interface as coremltools' MLState, so callers snapshot either engine alike."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.cells = {name: StateCell(name, np.array(a)) for name, a in arrays.items()}

    def _cell(self, name: str) -> StateCell:
        if name not in self.cells:
            raise MilError(f"no state {name!r}; the states are {sorted(self.cells)}")
        return self.cells[name]

    def read_state(self, name: str) -> np.ndarray:
        return self._cell(name).value.copy()

    def write_state(self, name: str, value: np.ndarray) -> None:
        self._cell(name).write(value)


@dataclass(frozen=True)
class _Step:
    op: Operation
    fn: object
    where: str
    static: dict  # operands known when the executor is built (attributes, consts, immediates)
    # (input key, operands, is_list); an operand is a variable name or a _Known value
    dynamic: tuple[tuple[str, tuple, bool], ...]
    # A `linear` whose weight is a constant: `run_batch` applies it to every input's rows at once
    rows_at_once: bool = False
    # fp16 operands widen to float32 (the accumulation model above); not for ops that only move values
    widens: bool = True
    # constants over a file's map, whose pages a run drops once the step has read them
    mapped: tuple[np.ndarray, ...] = ()


@dataclass(frozen=True)
class _Known:
    value: object


def _update_as_whole(update, shape):
    """A slice_update over all of its x (`Executor._whole_updates`)."""
    return np.reshape(update, shape)


def _op_label(op: Operation) -> str:
    if op.outputs:
        return ", ".join(name for name, _ in op.outputs)
    name = op.attributes.get("name")
    return str(np.asarray(name).reshape(-1)[0]) if name is not None else "?"


def _widened(value):
    """An fp16 operand as float32 (exact: every fp16 value is a float32 value); others as they are."""
    return as_dtype(value, np.float32) if isinstance(value, np.ndarray) and value.dtype == np.float16 else value


def _conform(value, spec: TensorSpec | None, where: str):
    """Cast an op result to its declared dtype and check the declared fixed dimensions."""
    if spec is None or spec.is_state:
        return value
    value = np.asarray(value)
    if value.dtype != spec.dtype.numpy:
        value = as_dtype(value, spec.dtype.numpy)
    if spec.rank_known and spec.shape:  # scalars (no dims) are left unchecked, as is an unknown rank
        if value.ndim != len(spec.shape):
            raise MilError(f"{where}: result shape {value.shape} does not match the declared {spec.shape}")
        for declared, actual in zip(spec.shape, value.shape):  # a loop: this runs for every op
            if declared is not None and declared != actual:
                raise MilError(f"{where}: result shape {value.shape} does not match the declared {spec.shape}")
    return value


class Executor:
    """Executes `program.functions[function_name]`; constants are decompressed once here."""

    def __init__(self, program: Program, function_name: str | None = None):
        name = function_name or program.default_function
        if name not in program.functions:
            raise MilError(f"{program.path}: no function {name!r}; it has {sorted(program.functions)}")
        self.program = program
        self.function: Function = program.functions[name]
        self.where = f"{program.path}: function {name}"
        self.constants: dict[str, object] = {}
        self._wide_constants: dict[str, object] = {}
        self._scratch: ScratchFile | None = None
        self._steps: list[_Step] = []
        self._plan()
        self._whole_updates()
        self._slice_before_casts()
        del self._wide_constants  # each is held by the steps that read it
        self._mapped_constants()
        self._dead_after = self._liveness()
        self._row_tails = self._tails_of_rows()
        # For `run(rows_later=True)`: step index -> the output whose tail it is part of, and the
        # outputs that run makes.
        self._tail_of_step = {index: name for name, tail in self._row_tails.items() for index in tail}
        self._made_with_rows_later = [f.name for f in self.function.spec_outputs if f.name not in self._row_tails]
        self._needed: dict[frozenset[str], tuple[bool, ...]] = {}

    # -- building ---------------------------------------------------------------------------
    def _plan(self) -> None:
        unknown: dict[str, str] = {}  # op type -> where it first occurs
        for op in self.function.block.operations:
            where = f"{self.where}, op {op.type} -> {_op_label(op)}"
            if op.blocks:
                raise UnsupportedOp(f"{where}: ops with nested blocks ({op.type}) are not supported")
            if op.type == "const":
                (name, spec), = op.outputs
                self.constants[name] = _conform(op.attributes["val"], spec, where)
            elif op.type not in OPS:
                unknown.setdefault(op.type, where)
            else:
                step = self._compile(op, where)
                if op.type.startswith("constexpr_"):
                    self._fold(step)
                else:
                    self._steps.append(step)
        if unknown:
            first = next(iter(unknown.values()))
            raise UnsupportedOp(f"{first}: MIL op types {sorted(unknown)} are not implemented by the executor")
        self._drop_folded_intermediates()
        if len(self.function.spec_outputs) != len(self.function.block.outputs):
            raise MilError(
                f"{self.where}: the spec describes {len(self.function.spec_outputs)} outputs, "
                f"the program returns {len(self.function.block.outputs)}"
            )

    def _whole_updates(self) -> None:
        """A `slice_update` whose slices cover all of its x, in order, is its update in x's shape
        (converted to the dtype the program declares, as every result is): the step no longer
        reads x. coremltools converts torch's `cache[:] = new` on a state to such an update of
        the state's float32 read, which otherwise keeps that read alive to the program's end."""
        for index, step in enumerate(self._steps):
            spec = step.op.outputs[0][1] if step.op.type == "slice_update" else None
            if (spec is None or not spec.rank_known or None in spec.shape
                    or sorted(key for key, _, _ in step.dynamic) != ["update", "x"]):
                continue
            slices, _ = index_slices(spec.shape, **{k: step.static.get(k) for k in SLICE_KEYS})
            if all(range(size)[part] == range(size) for size, part in zip(spec.shape, slices)):
                self._steps[index] = replace(step, fn=_update_as_whole, static={"shape": spec.shape},
                                             dynamic=tuple(d for d in step.dynamic if d[0] == "update"))

    def _slice_before_casts(self) -> None:
        """Drop a cast that only slices read, and have them slice its input: `_store` conforms
        each slice's result to the dtype the program declares for it, the cast's, and a cast is
        elementwise, so every value is the one the program defines. Only the slices are cast.
        coremltools' torch frontend reads an fp16 state through one cast of the whole state to
        float32 (its `read_state` then `cast`), which an FP32 stateful program slices a layer at
        a time: at SmolLM2's context 8192, 378 MB of float32 K/V held through the step."""
        readers = self._readers()
        returned, dropped = set(self.function.block.outputs), set()
        for index, step in enumerate(self._steps):
            if step.op.type != "cast" or len(step.dynamic) != 1:
                continue
            (_, (source,), _), = step.dynamic
            (name, spec), = step.op.outputs
            reads = readers.get(name, [])
            if (isinstance(source, _Known) or spec is None or name in returned or not reads
                    or any(self._steps[i].op.type not in SLICES or key != "x"
                           or getattr(self._steps[i].op.outputs[0][1], "dtype", None) != spec.dtype
                           for i, key in reads)):
                continue
            for i, _ in reads:
                reader = self._steps[i]
                self._steps[i] = replace(reader, dynamic=tuple(
                    (key, (source,), lists) if key == "x" else (key, operands, lists)
                    for key, operands, lists in reader.dynamic))
            dropped.add(index)
        self._steps = [step for index, step in enumerate(self._steps) if index not in dropped]

    def _readers(self) -> dict[str, list[tuple[int, str]]]:
        """Value name -> (step index, input key) of each step that reads it, in program order."""
        readers: dict[str, list[tuple[int, str]]] = {}
        for index, step in enumerate(self._steps):
            for key, operands, _ in step.dynamic:
                for operand in operands:
                    if not isinstance(operand, _Known):
                        readers.setdefault(operand, []).append((index, key))
        return readers

    def _liveness(self) -> tuple[tuple[str, ...], ...]:
        """Per step, the values nothing reads after it: a run drops them, so it holds only live
        intermediates (SmolLM2-135M's 128-token prefill otherwise keeps ~450 MiB of dead ones)."""
        last_read: dict[str, int] = {}
        for index, step in enumerate(self._steps):
            for name, _ in step.op.outputs:
                last_read[name] = index  # an unread result dies where it is made
            for _, operands, _ in step.dynamic:
                for operand in operands:
                    if not isinstance(operand, _Known):
                        last_read[operand] = index
        returned = set(self.function.block.outputs)
        dead: list[list[str]] = [[] for _ in self._steps]
        for name, index in last_read.items():
            if name not in returned:
                dead[index].append(name)
        return tuple(map(tuple, dead))

    def _tails_of_rows(self) -> dict[str, tuple[int, ...]]:
        """Output feature name -> the steps that make it from rows alone: a constant-weight
        `linear` (each output row a function of its input row) and the casts after it, each
        result read by the next step only. `run_batch(rows=...)` gives such an output's wanted
        rows by feeding the linear only those: a chunk-KV package's head over a 262k vocabulary
        is 63% of Gemma 3's multiply-adds a token, and scoring reads one row of a prefix's 64."""
        readers = {name: [index for index, _ in reads] for name, reads in self._readers().items()}
        made_by = {name: index for index, step in enumerate(self._steps) for name, _ in step.op.outputs}
        tails = {}
        for feature, var in zip(self.function.spec_outputs, self.function.block.outputs):
            if readers.get(var):
                continue
            chain, name = [], var
            while name in made_by:
                index = made_by[name]
                step = self._steps[index]
                chain.insert(0, index)
                if step.rows_at_once:
                    tails[feature.name] = tuple(chain)
                    break
                if step.op.type != "cast" or len(step.dynamic) != 1:
                    break
                (_, (operand,), _), = step.dynamic
                if isinstance(operand, _Known) or readers.get(operand) != [index]:
                    break
                name = operand
        return tails

    def _compile(self, op: Operation, where: str) -> _Step:
        """Split the op's operands into those known now and the names bound at run time."""
        lists = OPS[op.type].lists
        static = {k: v for k, v in op.attributes.items() if k != "name"}
        dynamic = []
        # Decompression (constexpr_*) is defined in its operands' own dtype (an fp16 scale
        # multiplies in fp16, as coremltools' value inference does), and an op that only moves
        # values (`OpDef.moves`) is exact in any: their operands stay as stored.
        widens = not (op.type.startswith("constexpr_") or OPS[op.type].moves)
        widen = _widened if widens else (lambda value: value)
        for key, args in op.inputs.items():
            operands = tuple(
                _Known(widen(a.value)) if a.name is None
                else _Known(self._wide(a.name) if widen is _widened else self.constants[a.name])
                if a.name in self.constants else a.name
                for a in args
            )
            if all(isinstance(o, _Known) for o in operands):
                values = tuple(o.value for o in operands)
                static[key] = values if key in lists else values[0]
            else:
                dynamic.append((key, operands, key in lists))
        if OPS[op.type].opset:
            try:
                static["opset"] = self.function.ios
            except MilError as exc:
                raise MilError(f"{where}: {exc}") from None
        rows_at_once = op.type == "linear" and [key for key, _, _ in dynamic] == ["x"]
        return _Step(op, OPS[op.type].fn, where, static, tuple(dynamic), rows_at_once, widens)

    def _mapped_constants(self) -> None:
        """Give each step the constants it reads through a map (after folding, so a decompressed
        weight is its scratch map's view): a run drops their pages once the step is done, so
        a forward holds about one layer's weights resident, not the whole file
        (`pipeline.ground.pages`)."""
        seen = {}
        for index, step in enumerate(self._steps):
            values = [v for value in step.static.values() for v in (value if isinstance(value, tuple) else (value,))]
            mapped = tuple(v for v in values if is_mapped(v))
            if mapped:
                self._steps[index] = replace(step, mapped=mapped)
                seen.update((id(v), v.nbytes) for v in mapped)
        self.mapped_bytes = sum(seen.values())

    def _wide(self, name: str):
        """Constant `name` as the ops see it (fp16 widened to float32), made once per constant."""
        if name not in self._wide_constants:
            value = self.constants[name]
            widened = _widened(value)
            self._wide_constants[name] = widened if widened is value else self._held(widened)
        return self._wide_constants[name]

    def _held(self, value):
        """`value`, made here once, as a map of the scratch file where it is large."""
        if not isinstance(value, np.ndarray) or value.nbytes < SCRATCH_BYTES:
            return value
        if self._scratch is None:
            self._scratch = ScratchFile()
        return self._scratch.hold(value)

    def _drop_folded_intermediates(self) -> None:
        """Forget a decompressed constant that only other constexpr ops read (int4-b32's fp16
        product before its cast to fp32): each weight is then held once, as the ops that run
        read it. `const` values stay: they are views of the weight file, not copies."""
        read = {a.name for step in self._steps for args in step.op.inputs.values() for a in args if a.name}
        kept = read | set(self.function.block.outputs)
        for op in self.function.block.operations:
            if op.type.startswith("constexpr_"):
                for name, _ in op.outputs:
                    if name not in kept:
                        del self.constants[name]

    def _fold(self, step: _Step) -> None:
        if step.dynamic:
            raise MilError(f"{step.where}: a constexpr op with non-constant operands {[d[0] for d in step.dynamic]}")
        self._store(step, self._call(step, step.static), self.constants)
        for name, _ in step.op.outputs:
            self.constants[name] = self._held(self.constants[name])

    # -- running ----------------------------------------------------------------------------
    @staticmethod
    def _bind(step: _Step, env: Mapping[str, object]) -> dict[str, object]:
        kwargs = dict(step.static)
        for key, operands, is_list in step.dynamic:
            try:
                values = tuple(o.value if isinstance(o, _Known) else _widened(env[o]) if step.widens else env[o]
                               for o in operands)
            except KeyError as exc:
                raise MilError(f"{step.where}: operand {exc.args[0]!r} is not defined before its use") from None
            kwargs[key] = values if is_list else values[0]
        return kwargs

    @staticmethod
    def _call(step: _Step, kwargs: dict[str, object]):
        try:
            return step.fn(**kwargs)
        except (MilError, ValueError, IndexError, TypeError) as exc:
            raise MilError(f"{step.where}: {exc}") from exc

    @staticmethod
    def _store(step: _Step, result, env: dict[str, object], rows_cut: bool = False) -> None:
        """Bind the step's results, each conformed to its declared type (`rows_cut`: its rows
        are a selection of a row tail's, so their count is not the declared one)."""
        outputs = step.op.outputs
        results = result if isinstance(result, tuple) else (result,)
        if len(results) != len(outputs):
            raise MilError(f"{step.where}: produced {len(results)} values for {len(outputs)} outputs")
        for (name, spec), value in zip(outputs, results):
            env[name] = _conform(value, _rows_free(spec) if rows_cut else spec, step.where)

    def make_state(self) -> State:
        """Fresh zero-filled states of this function, in their declared (typically fp16) dtype."""
        return State({s.name: np.zeros(s.shape, s.dtype.numpy) for s in self.function.spec_states})

    def run(self, inputs: Mapping[str, object], state: State | None = None,
            single_token: bool = False, rows_later: bool = False) -> dict[str, np.ndarray]:
        """The function's outputs for `inputs` (and `state`, updated in place). `single_token`:
        the inputs are one token, whose weights' pages are kept for the next (`RESIDENT_DECODE_BYTES`).

        `rows_later`: an output made from rows alone (`row_outputs`: the head) is not made; the
        rows its linear would read stand in its place, for `finish_rows` to make the output of
        many calls' rows at once. A decode step otherwise reads the head's weight whole for one
        row (Gemma 3's 262k x 640: two thirds of a chunk-KV step), and no call reads another's
        logits."""
        env = self._start(inputs, state)
        release = not (single_token and self.mapped_bytes <= RESIDENT_DECODE_BYTES)
        tails = self._tail_of_step if rows_later else {}
        rows = {}
        for index, (step, dead) in enumerate(zip(self._steps, self._dead_after)):
            if index not in tails:
                self._store(step, self._call(step, self._bind(step, env)), env)
                for constant in step.mapped if release else ():
                    release_pages(constant)
            elif index == self._row_tails[tails[index]][0]:
                rows[tails[index]] = self._bind(step, env)["x"]
            for name in dead:
                env.pop(name, None)  # absent: made by a step left for `finish_rows`
        if not rows_later:
            return self._outputs(env)
        return {**self._outputs(env, self._made_with_rows_later), **rows}

    @property
    def row_outputs(self) -> frozenset[str]:
        """The outputs made from rows alone (`_tails_of_rows`), which `run(rows_later=True)` leaves."""
        return frozenset(self._row_tails)

    def finish_rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Output `name` of `rows`: what `run(rows_later=True)` returned in its place, stacked
        along the rows axis (-2) from any number of calls. Its tail (the linear, then its casts)
        runs over all of them at once, as `run_batch` runs a batch's rows: each row is the one
        a call would make, its sums in the order of a product of many rows."""
        env: dict[str, object] = {}
        for index in self._row_tails[name]:
            step = self._steps[index]
            kwargs = {**step.static, "x": rows} if step.rows_at_once else self._bind(step, env)
            self._store(step, self._call(step, kwargs), env, rows_cut=True)
            for constant in step.mapped:
                release_pages(constant)
        return self._outputs(env, {name})[name]

    def run_batch(self, batch: list[Mapping[str, object]], rows: list[Mapping[str, np.ndarray] | None] | None = None,
                  outputs: Collection[str] | None = None) -> list[dict[str, np.ndarray]]:
        """`run` of each input set (of a function without states), op by op across the batch,
        with every `linear` of a constant weight applied to all their rows at once. A few-token
        call is bound by reading the weights (538 MB on SmolLM2-135M), which a batch then reads
        once; each row's sums are `run`'s up to the product's summation order.

        `rows`: per input set, output name -> the rows (axis -2) of it wanted, in that order;
        only those are returned. An output made from rows alone (`_tails_of_rows`: the head)
        computes only them; any other is sliced once made. `outputs`: the outputs returned (None:
        all); an op that only the others read is not run (a chunk-KV call's stacked caches,
        which a scoring candidate never reads)."""
        if self.function.spec_states:
            raise MilError(f"{self.where}: run_batch takes functions without states; run each with its own")
        envs = [self._start(inputs, None) for inputs in batch]
        wanted = [dict(selection or {}) for selection in (rows or [None] * len(batch))]
        cuts = [{index: selection for name, selection in each.items() if name in self._row_tails
                 for index in self._row_tails[name]} for each in wanted]
        needed = self._needed_steps(frozenset(outputs) if outputs is not None else None)
        for index, (step, dead) in enumerate(zip(self._steps, self._dead_after)):
            if needed[index]:
                if step.rows_at_once:
                    self._linear_rows(step, envs, [cut.get(index) for cut in cuts])
                else:
                    for env, cut in zip(envs, cuts):
                        self._store(step, self._call(step, self._bind(step, env)), env, rows_cut=index in cut)
                for constant in step.mapped:
                    release_pages(constant)
            for env in envs:
                for name in dead:
                    env.pop(name, None)  # absent: made by a step not run
        results = [self._outputs(env, outputs) for env in envs]
        for out, each in zip(results, wanted):
            for name, selection in each.items():
                if name not in self._row_tails:
                    out[name] = out[name][..., np.asarray(selection, np.intp), :]
        return results

    def _needed_steps(self, outputs: frozenset[str] | None) -> tuple[bool, ...]:
        """Per step, whether the function's `outputs` (feature names; None: all) read its results."""
        if outputs is None:
            return (True,) * len(self._steps)
        if outputs not in self._needed:
            unknown = outputs - {f.name for f in self.function.spec_outputs}
            if unknown:
                raise MilError(f"{self.where}: outputs {sorted(unknown)} are not among the function's")
            wanted = {var for feature, var in zip(self.function.spec_outputs, self.function.block.outputs)
                      if feature.name in outputs}
            needed = []
            for step in reversed(self._steps):
                needed.append(any(name in wanted for name, _ in step.op.outputs))
                if needed[-1]:
                    wanted.update(o for _, operands, _ in step.dynamic for o in operands if not isinstance(o, _Known))
            self._needed[outputs] = tuple(reversed(needed))
        return self._needed[outputs]

    def _linear_rows(self, step: _Step, envs: list[dict[str, object]], cuts: list[np.ndarray | None]) -> None:
        xs = [np.asarray(self._bind(step, env)["x"]) for env in envs]
        xs = [x if cut is None else x[..., np.asarray(cut, np.intp), :] for x, cut in zip(xs, cuts)]
        rows = np.concatenate([x.reshape(-1, x.shape[-1]) for x in xs])
        products = self._call(step, {**step.static, "x": rows})
        start = 0
        for env, x, cut in zip(envs, xs, cuts):
            count = x.size // x.shape[-1]
            self._store(step, products[start:start + count].reshape(*x.shape[:-1], products.shape[-1]), env,
                        rows_cut=cut is not None)
            start += count

    def _start(self, inputs: Mapping[str, object], state: State | None) -> dict[str, object]:
        env: dict[str, object] = dict(self.constants)
        env.update(self._check_inputs(inputs))
        if self.function.spec_states:
            if not isinstance(state, State):
                raise MilError(f"{self.where}: this function has states; pass state=make_state(), not {state!r}")
            missing = {s.name for s in self.function.spec_states} - set(state.cells)
            if missing:
                raise MilError(f"{self.where}: state object lacks {sorted(missing)}")
            env.update(state.cells)
        return env

    def _outputs(self, env: dict[str, object], names: Collection[str] | None = None) -> dict[str, np.ndarray]:
        outputs = {}
        for feature, var in zip(self.function.spec_outputs, self.function.block.outputs):
            if names is not None and feature.name not in names:
                continue
            value = np.asarray(env[var])
            # Not copied where the dtype is already the declared one: a chunk-KV call's written
            # caches would otherwise be held twice (the 1.7B model: 100 MB a branch).
            outputs[feature.name] = value.astype(feature.dtype.numpy, copy=False) if feature.dtype else value
        return outputs

    def _check_inputs(self, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
        declared = {f.name: f for f in self.function.spec_inputs}
        unknown = set(inputs) - set(declared)
        if unknown:
            raise MilError(f"{self.where}: unknown inputs {sorted(unknown)}; expected {sorted(declared)}")
        checked = {}
        for name, feature in declared.items():
            if name not in inputs:
                raise MilError(f"{self.where}: input {name!r} is missing")
            if feature.dtype is None:
                raise MilError(f"{self.where}: input {name!r} has an array dtype the executor does not know")
            value = np.asarray(inputs[name])
            _check_shape(feature, value.shape, f"{self.where}: input {name!r}")
            if not np.can_cast(value.dtype, feature.dtype.numpy, casting="same_kind"):
                raise MilError(f"{self.where}: input {name!r} has dtype {value.dtype}, expected {feature.dtype.name}")
            # No copy when the dtype already is the declared one: every op returns a new array.
            checked[name] = value.astype(feature.dtype.numpy, copy=False)
        return checked


def _rows_free(spec: TensorSpec | None) -> TensorSpec | None:
    """`spec` with its rows (axis -2) of any count."""
    if spec is None or len(spec.shape) < 2:
        return spec
    return replace(spec, shape=spec.shape[:-2] + (None,) + spec.shape[-1:])


def _check_shape(feature: FeatureSpec, shape: tuple[int, ...], where: str) -> None:
    if feature.enumerated is not None:
        if tuple(shape) not in feature.enumerated:
            raise MilError(f"{where}: shape {shape} is not one of the enumerated shapes {list(feature.enumerated)}")
        return
    ranges = feature.ranges or tuple((d, d) for d in feature.shape)
    if len(shape) != len(ranges) or any(
        n < lo or (hi != -1 and n > hi) for n, (lo, hi) in zip(shape, ranges)
    ):
        raise MilError(f"{where}: shape {shape} outside the declared {['%d..%s' % (lo, hi if hi != -1 else 'inf') for lo, hi in ranges]}")
