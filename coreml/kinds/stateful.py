"""The stateful package: the K/V cache kept as Core ML state (fp16, as Core ML requires), with
a `prefill` (flexible T) and a `decode` (T=1) function in one multifunction package; or, in the
interface of a Swift loader that calls a model's default function with any token count
(`coreml.interfaces`: `single_function`), one function taking 1..context tokens, its position
derived from the loader's causal mask (`mask_step`).

At FP32 the saved package is run on the executor against the fp16-cache torch graph (`measure`).
At a precision below float32 each traced function is checked instead, in torch, against that
graph (`check_traced`): the package's own numerics are then the gates' to judge."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from coreml.interfaces import MASK_DTYPE, Interface, causal_mask, package_interface, step_inputs
from coreml.kinds.base import (CACHE_MEANING, PackageKind, chunked_prompt_lines, feature, position_feature,
                               register_kind)
from coreml.layout import enumerated_lengths
from coreml.split import MB
from coreml.kinds.cache_runner import KVSnapshot, CacheRunner, package_features, input_ids_array
from coreml.kinds.schedules import CheckSchedule, noise_caches
from coreml.package import open_package

if TYPE_CHECKING:
    from torch import nn

    from coreml.kinds.export import Reference
    from coreml.precisions import Precision
    from manifests.identity import Manifest


def role_functions(block: dict) -> dict[str, str]:
    """The function of a stateful package (`block`: its manifest's `package`) that runs a chunk of
    2+ tokens (`prefill`) and the one that runs a single token (`decode`): the functions so named,
    or a single-function package's one function for both."""
    return {role: role if "functions" in block else "main" for role in ("prefill", "decode")}


class StatefulRunner(CacheRunner):
    """Feeds a stateful package through the same snapshot interface as ChunkKVRunner.

    `package` is any function of the package opened with `open_package`; the runner runs
    its `prefill` (chunks of 2+ tokens) and `decode` (1 token) on the same backend, each with
    the inputs of the package's interface (`coreml.interfaces.step_inputs`: a loader's causal
    mask built from the position where it takes one). Each run writes the snapshot's fp16
    caches into a fresh state, so a state never outlives one call and no snapshot shares
    memory with one.
    """

    cache_dtype = np.float16

    def __init__(self, package):
        block = package.manifest["package"] if package.manifest else {}
        self.unit = package_interface(block, package.path)
        states = package_features(package, "states", "stateful", (self.unit.key_cache, self.unit.value_cache))
        self.package = package
        self.cache_shape = tuple(states[self.unit.key_cache]["shape"])
        self.functions = {role: package if package.function_name == name else package.function(name)
                          for role, name in role_functions(block).items()}
        self._layout("prefill")

    def run(self, snapshot: KVSnapshot, ids) -> tuple[np.ndarray, KVSnapshot]:
        ids = input_ids_array(ids)
        end = self._end(snapshot, ids)
        keys, values, position, outs = snapshot.key_cache, snapshot.value_cache, snapshot.position, []
        for piece in self._pieces(ids):  # the prefill's enumerated lengths where it has them
            out, keys, values = self._call("decode" if piece.shape[1] == 1 else "prefill", keys, values, position, piece)
            outs.append(out)
            position += piece.shape[1]
        # A state's reads are copies of their own (MLState's and the executor's alike).
        return self._logits(outs), self._snapshot(keys, values, end, fresh=bool(outs))

    def _call(self, function_name: str, keys, values, position: int, piece: np.ndarray, **options):
        """One prediction of the function from the caches: (its outputs, the caches it leaves). Its
        state is one of the function that runs the piece (Core ML binds a state to the model that
        made it), holding what the piece before wrote."""
        function, unit = self.functions[function_name], self.unit
        state = function.make_state()
        state.write_state(unit.key_cache, keys)
        state.write_state(unit.value_cache, values)
        out = function.predict(step_inputs(unit, piece, position), state=state, **options)
        return out, state.read_state(unit.key_cache), state.read_state(unit.value_cache)

    def _decoder(self):
        return self.functions["decode"]

    def _decode(self, snapshot: KVSnapshot, token: np.ndarray) -> tuple[dict, KVSnapshot]:
        out, keys, values = self._call("decode", snapshot.key_cache, snapshot.value_cache, snapshot.position, token,
                                       rows_later=True)
        return out, self._snapshot(keys, values, snapshot.position + 1, fresh=True)


@register_kind
class Stateful(PackageKind):
    name = "stateful"
    description = ("Stateful decoder: fp16 KV cache as Core ML state; prefill (1..context tokens) "
                   "and decode (1 token)")
    # A single-function interface's package takes one step fewer: no second function to trace.
    steps = 4
    runner = StatefulRunner
    # Schedules the traced decode function (T=1) is checked on: from the start, and up to the last
    # slot (`CheckSchedule`: its start counted from the context's end).
    DECODE_CHECKS = (CheckSchedule((1, 1, 1, 1)), CheckSchedule((1, 1, 1), -3))

    def cache_dtype(self, precision: Precision) -> type[np.floating]:
        return np.float16  # Core ML states are fp16 at every precision

    def description_for(self, ref: Reference) -> str:
        unit = ref.interface
        if not unit.single_function:
            return self.description
        return (f"Stateful decoder: fp16 KV cache as Core ML state; one function (1..context tokens) in the "
                f"{unit.name} interface, positions from the causal mask")

    def interface(self, ref: Reference) -> dict:
        block, cache, unit = super().interface(ref), list(ref.cache_shape), ref.interface
        if unit.mask_input is None:
            block["inputs"].append(position_feature())
        else:  # K: the mask's key columns, up to the context plus the loader's extra ones
            block["dims"]["K"] = [1, ref.context + unit.mask_extra_columns]
            block["inputs"].append(mask_feature(unit))
        block["states"] = [feature(unit.key_cache, "float16", cache, f"keys {CACHE_MEANING}"),
                           feature(unit.value_cache, "float16", cache, f"values {CACHE_MEANING}")]
        if unit.single_function:
            # The loader calls the default function with any token count: a range, not the
            # Neural Engine's enumerated lengths.
            block.pop("enumerated", None)
            return block
        block["functions"] = {"prefill": {"dims": {"T": [1, ref.context]}}, "decode": {"dims": {"T": [1, 1]}}}
        if "enumerated" in block:  # prefill takes the enumerated lengths; decode stays fixed at 1
            block["functions"]["prefill"]["enumerated"] = block["enumerated"]
        block["default_function"] = "decode"
        return block

    def graph(self, ref: Reference) -> nn.Module:
        """The chunk-KV graph over fp16 buffers (named as the interface names its states) that the
        converter turns into Core ML states; its second input is the position, or the loader's
        causal mask (`mask_step`).

        The whole cache is written back each call: the reference contract returns full caches,
        and a full `[:]` write is the in-place form coremltools maps to `coreml_update_state`.
        """
        import torch
        from torch import nn

        class StatefulGraph(nn.Module):
            def __init__(self, model: nn.Module, cache_shape: tuple[int, ...], unit: Interface):
                super().__init__()
                # The slot count as a number: read from a tensor's shape, the tracer makes it a
                # value the converter cannot fold.
                self.model, self.unit, self.slots = model, unit, cache_shape[3]
                for name in (unit.key_cache, unit.value_cache):
                    self.register_buffer(name, torch.zeros(cache_shape, dtype=torch.float16))

            def forward(self, input_ids, where):
                key_cache, value_cache = getattr(self, self.unit.key_cache), getattr(self, self.unit.value_cache)
                # The fp16 state is read into float32 and written back a layer at a time
                # (`compute_dtype`): no float32 copy of the whole cache in the program.
                if self.unit.mask_input is None:
                    logits, new_k, new_v = self.model.forward_with_cache_tensors(input_ids, where, key_cache, value_cache,
                                                                                 compute_dtype=torch.float32)
                else:
                    position, bias = mask_step(input_ids, where, self.unit.mask_extra_columns, self.slots)
                    logits, new_k, new_v = self.model.forward_with_cache_tensors(
                        input_ids, position, key_cache, value_cache, attention_bias=bias, compute_dtype=torch.float32)
                key_cache[:] = new_k
                value_cache[:] = new_v
                return logits

        from coreml.kinds.export import traced_model

        return StatefulGraph(traced_model(ref), ref.cache_shape, ref.interface)

    def export(self, ref: Reference, package_dir: Path, step: Callable[[str], None]) -> Manifest:
        from coreml.kinds.export import describe_model, finish_package
        from coreml.manifest import MODEL_NAME, save_model, working_files_in
        from coreml.multifunction import merge_functions

        from coreml.kinds.export import BadConversion, traced_check_record
        from coreml.kinds.stateful_split import export_split, split_plan

        plan = split_plan(ref)
        if plan is not None:
            if ref.interface.single_function:
                raise BadConversion(
                    f"{ref.bundle_dir}: the stateful package would be cut into {len(plan)} pieces (conversion field "
                    f"'max_package_mb' is {ref.max_package_bytes / MB:g}), but the {ref.interface.name} interface's "
                    "loader runs one package; convert it in the cmfdeploy interface, or with a larger limit")
            return export_split(self, ref, plan, package_dir, step)
        start = time.perf_counter()
        block = self.interface(ref)
        package_dir.mkdir(parents=True)
        traced_errors: dict[str, dict[str, float]] = {}
        with tempfile.TemporaryDirectory(dir=package_dir.parent) as scratch:
            functions = self.convert_functions(ref, Path(scratch), step, traced_errors)
            if "functions" not in block:  # one function, converted and described as it is saved
                shutil.move(functions["main"], package_dir / MODEL_NAME)
            else:
                step("stateful: save multifunction")
                with working_files_in(package_dir.parent):
                    mlmodel = merge_functions(functions, block["default_function"])
                    describe_model(mlmodel, block, ref, self.description_for(ref),
                                   features=False)
                    save_model(mlmodel, package_dir / MODEL_NAME)
        if ref.precision.compute_precision == "float32":
            step("stateful: measure the fp16-cache error")
            # One loaded program for both functions: a second load would map the weights again.
            prefill = open_package(package_dir / MODEL_NAME, backend="executor",
                                   function_name=role_functions(block)["prefill"])
            checks = self.measure(prefill, ref, block)
        else:
            step("stateful: record the checks of the traced functions")
            checks = {"traced_vs_fp16_cache_graph_max_abs": traced_errors, "tolerance": ref.tolerance,
                      "cache_tolerance": ref.cache_tolerance, **traced_check_record(ref.precision)}
        return finish_package(package_dir, ref, block, checks, time.perf_counter() - start)

    def convert_functions(self, ref: Reference, folder: Path, step: Callable[[str], None],
                          traced_errors: dict | None = None) -> dict[str, Path]:
        """The package's functions (a single-function interface's one, `main`), each converted and
        saved as a single-function package `folder/<name>.mlpackage`; paths by function name, in
        the block's order. Below float32, each traced function is checked first (`check_traced`),
        its errors put in `traced_errors`."""
        block = self.interface(ref)
        paths = {}
        for name, function in block.get("functions", {"main": block}).items():
            step(f"stateful: trace and convert {name}")
            paths[name] = folder / f"{name}.mlpackage"
            # In a function of its own, so the traced graph and converted program are freed
            # before the next function is traced.
            errors = self._save_function(ref, block, name, function, paths[name])
            if traced_errors is not None and errors is not None:
                traced_errors[name] = errors
        return paths

    def _save_function(self, ref: Reference, block: dict, name: str, function: dict, path: Path) -> dict | None:
        from coreml.kinds.export import TRACE_LENGTH, convert_traced, describe_model, example_ids, trace_module
        from coreml.manifest import save_model
        from pipeline.ground.workers import return_freed_memory

        dims = function["dims"]
        length = min(TRACE_LENGTH, dims["T"][1])
        traced = trace_module(self.graph(ref), graph_inputs(ref.interface, example_ids(ref.args.vocab_size, length, 0), 3))
        errors = None
        if ref.precision.compute_precision != "float32":
            checks = self.DECODE_CHECKS if dims["T"][1] == 1 else ref.check_schedules
            errors = self.check_traced(traced, ref, name, checks)
        mlmodel = convert_traced(traced, block, function, ref.precision, path)
        describe_model(mlmodel, block, ref, self.description_for(ref))
        save_model(mlmodel, path)
        del mlmodel, traced
        return_freed_memory()  # this function's program and graph, before the next is traced
        return errors

    def check_traced(self, traced, ref: Reference, name: str, checks: tuple[CheckSchedule, ...]) -> dict[str, float]:
        """Run traced function `name` chunk by chunk beside the eager fp16-cache graph, both in
        torch float32 arithmetic and each chunk starting from the eager graph's caches (noise
        below each schedule's start: `CheckSchedule`).

        Logits must agree within FP32's tolerance and the caches each wrote within FP32's cache
        tolerance once one fp16 step is forgiven (an entry the two summation orders rounded to
        neighbouring fp16 values), else `ScheduleMismatch`. Returns max |Δ logit| per check."""
        import torch

        from coreml.kinds.export import ScheduleMismatch, example_ids, joined, max_abs_delta, unprofiled_runs, worst

        buffers = (ref.interface.key_cache, ref.interface.value_cache)
        errors = {}
        for index, schedule in enumerate(checks):
            schedule = schedule.fit(ref.context)
            ids = example_ids(ref.args.vocab_size, schedule.tokens, seed=300 + index)
            eager = self.graph(ref)
            for buffer, noise in zip(buffers, noise_prefix(schedule, ref.cache_shape, seed=300 + index)):
                getattr(eager, buffer).copy_(noise)
            logit_delta, cache_delta, offset = 0.0, 0.0, 0
            with torch.no_grad():
                for size in schedule.chunks:
                    inputs = graph_inputs(ref.interface, ids[:, offset:offset + size], schedule.start + offset)
                    for buffer in buffers:
                        getattr(traced, buffer).copy_(getattr(eager, buffer))
                    with unprofiled_runs():
                        got = joined(traced(*inputs))
                    want = joined(eager(*inputs))
                    # `worst`, not max: Python's max keeps 0.0 over a NaN that follows it, which
                    # let a traced function that computes NaN pass this check.
                    logit_delta = worst(logit_delta, max_abs_delta(got.reshape(-1, got.shape[-1]),
                                                                   want.reshape(-1, want.shape[-1])))
                    for buffer in buffers:
                        cache_delta = worst(cache_delta, _beyond_one_fp16_step(getattr(traced, buffer).numpy(),
                                                                               getattr(eager, buffer).numpy()))
                    offset += size
            label = f"{name}{schedule.name}"
            errors[label] = logit_delta
            if not (logit_delta <= ref.tolerance and cache_delta <= ref.cache_tolerance):
                raise ScheduleMismatch(
                    f"{ref.bundle_dir}: traced stateful {name} on {label} differs from the fp16-cache torch graph "
                    f"by max |Δ logit| {logit_delta:.3g} and max |Δ cache| beyond one fp16 step {cache_delta:.3g} "
                    f"(tolerances {ref.tolerance:.3g}, {ref.cache_tolerance:.3g}); refusing to export")
        return errors

    def measure(self, prefill, ref: Reference, block: dict, schedules: tuple[CheckSchedule, ...] | None = None) -> dict:
        """Run the saved package through the MIL executor on `schedules` (default: the model's
        check schedules, `CheckSchedule`: noise in the state below each one's start), each chunk with
        the inputs of its interface (`step_inputs`; `block` is its manifest's `package`; `prefill`
        the package's function that runs a chunk, opened on the executor: the package's own, or
        the pieces of a split one, `coreml.package.ChainedPackage`).

        The conversion check runs each chunk through the package and through the same graph
        eagerly in torch with fp16 buffers, both starting from the package's cache: the logits
        must agree within the float32 tolerance, and so must the caches each wrote once one fp16
        step is forgiven, else `ScheduleMismatch`. (Carrying the eager graph's own cache along
        instead lets an entry that float32 summation order rounded the other way grow, chunk
        after chunk, into a logit difference that says nothing about the conversion: 8e-4 on
        SmolLM2-135M.) The package against the float32 reference is the fp16-cache error,
        measured and recorded, not gated.
        """
        import torch

        from coreml.kinds.export import ScheduleMismatch, example_ids, max_abs_delta, max_abs_delta_to_reference, worst
        from pipeline.ground.workers import return_freed_memory

        unit = ref.interface
        buffers = (unit.key_cache, unit.value_cache)
        roles = role_functions(block)
        mlpackage = prefill.path
        functions = {role: prefill if name == roles["prefill"] else prefill.function(name)
                     for role, name in roles.items()}
        conversion, cache, fp16_cache = {}, {}, {}
        tolerance, cache_tolerance = ref.tolerance, ref.cache_tolerance
        for index, schedule in enumerate(ref.check_schedules if schedules is None else schedules):
            schedule = schedule.fit(ref.context)
            ids = example_ids(ref.args.vocab_size, schedule.tokens, seed=200 + index)
            eager = self.graph(ref)
            state = functions["prefill"].make_state()
            prefix = noise_prefix(schedule, ref.cache_shape, seed=200 + index)
            for buffer, noise in zip(buffers, prefix):
                state.write_state(buffer, noise.numpy())
            logit_delta, reference_delta, cache_delta, offset = 0.0, 0.0, 0.0, 0
            with torch.no_grad():
                # Compared chunk by chunk, a block of rows at a time, against the reference's final
                # hidden states (its logits made per block): a 262k vocabulary's logits are 1 GB over
                # 1024 positions, and the whole-array comparisons held 3.7 GB on Gemma 3. The float32
                # reference reads the prefix's fp16 values, so only the schedule's own writes carry
                # the fp16 cache's rounding: a layer at a time (`compute_dtype`), as a float32 copy
                # of the whole prefix, the layers' written caches and their stack were 1.1 GB at
                # SmolLM2's context 8192, the stage's peak.
                full = (ref.model.hidden_with_cache_tensors(ids, torch.tensor([schedule.start]), *prefix,
                                                            compute_dtype=torch.float32)[0][0]
                        if prefix else ref.model.hidden(ids))
                del prefix
                for size in schedule.chunks:
                    chunk = ids[:, offset : offset + size]
                    position = schedule.start + offset
                    function = functions["decode" if size == 1 else "prefill"]
                    for buffer in buffers:
                        getattr(eager, buffer).copy_(torch.from_numpy(state.read_state(buffer)))
                    got = torch.from_numpy(function.predict(step_inputs(unit, chunk.numpy(), position), state)["logits"][0])
                    simulated = eager(*graph_inputs(unit, chunk, position))[0]
                    logit_delta = worst(logit_delta, max_abs_delta(got, simulated))
                    reference_delta = worst(reference_delta, max_abs_delta_to_reference(
                        got, ref.model, full[offset : offset + size]))
                    del got, simulated
                    for buffer in buffers:
                        written = _beyond_one_fp16_step(state.read_state(buffer), getattr(eager, buffer).numpy())
                        cache_delta = worst(cache_delta, written)
                    offset += size
                    return_freed_memory()  # each call's copies of the caches, freed to the heap
            del full
            name = schedule.name
            conversion[name] = logit_delta
            cache[name] = cache_delta
            fp16_cache[name] = reference_delta
            if not (conversion[name] <= tolerance and cache_delta <= cache_tolerance):
                raise ScheduleMismatch(
                    f"{mlpackage}: stateful package on schedule {name} differs from the fp16-cache torch graph "
                    f"by max |Δ logit| {conversion[name]:.3g} and max |Δ cache| beyond one fp16 step "
                    f"{cache_delta:.3g} (tolerances {tolerance:.3g}, {cache_tolerance:.3g}); refusing to export"
                )
        how = ("prefill for chunks > 1 token, decode for 1" if "functions" in block else
               f"its one function, with the {unit.name} interface's causal mask built from each chunk's position")
        return {
            "executor_vs_fp16_cache_graph_max_abs": conversion,
            "tolerance": tolerance,
            "cache_tolerance": cache_tolerance,
            "cache_vs_fp16_cache_graph_max_abs_beyond_one_fp16_step": cache,
            "fp16_cache_error_vs_float32_reference_max_abs": fp16_cache,
            "measured_with": f"coreml.mil executor (numpy), {how}",
        }

    def snippet_model_arguments(self, interface: dict) -> str:
        return ', function_name="prefill"' if "functions" in interface else ""

    def snippet(self, interface: dict) -> list[str]:
        unit = package_interface(interface, "the release's interface")
        state = "state = model.make_state()  # the fp16 K/V cache; the decode function continues from it"
        if unit.mask_input is not None:
            extra = unit.mask_extra_columns
            columns = "len(ids)" + (f" + {extra}" if extra else "")
            return ["state = model.make_state()  # the fp16 K/V cache; later calls continue from it",
                    f"# {unit.mask_input}: additive fp16 [1, 1, T, position + T{f' + {extra}' if extra else ''}], 0 "
                    "where a token may attend, the lowest fp16 where the key is later; its width gives the position",
                    f'inputs["{unit.mask_input}"] = np.triu(np.full((len(ids), {columns}), np.finfo(np.float16).min, '
                    "np.float16), 1)[None, None]",
                    "out = model.predict(inputs, state=state)"]
        lengths = enumerated_lengths(interface, "prefill")
        if lengths is None:
            return [state, 'inputs["position"] = np.array([0], dtype=np.int32)',
                    "out = model.predict(inputs, state=state)"]
        return [state, *chunked_prompt_lines(
            lengths, 'model.predict({"input_ids": chunk, "position": np.array([position], dtype=np.int32)}, state=state)')]


def noise_prefix(schedule: CheckSchedule, cache_shape: tuple[int, ...], seed: int) -> list:
    """The fp16 keys and values a stateful check starts from: standard normal noise in the slots
    below the schedule's start (`CheckSchedule.prefix`); none where it starts at slot 0, whose
    state starts as zeros, as a fresh one does."""
    if not schedule.start:
        return []
    return [c.half() for c in schedule.prefix(*noise_caches(cache_shape, seed))]


def mask_feature(unit: Interface) -> dict:
    """A mask interface's mask input [1, 1, T, K]."""
    extra = unit.mask_extra_columns
    beyond = f" (the loader's last {extra} past the keys, not applied)" if extra else ""
    return feature(unit.mask_input, MASK_DTYPE, [1, 1, "T", "K"],
                   f"additive causal mask over the keys: rows the T queries (or 1 for all of them), columns "
                   f"K = position + T{f' + {extra}' if extra else ''} keys from slot 0{beyond}; the first query's "
                   f"position is K - T{f' - {extra}' if extra else ''}. Added to the package's own causal mask, "
                   "which still holds")


def mask_step(ids, mask, extra: int, slots: int):
    """(position [1], bias [1, 1, T, slots]) of a loader's mask [1, 1, R, K] (R: T, or 1 for all
    queries) for tokens `ids` [1, T]: the first query's position is K - extra - T, and the mask's
    first K - extra columns are the bias of slots 0.. (the slots after them are later than every
    query: the causal mask hides them, their bias is 0). Counted and sliced by shape alone, so
    the traced graph keeps T and K symbolic."""
    import torch

    columns = mask.shape[-1] - extra
    zero_rows = torch.zeros_like(ids[0], dtype=torch.float32)[:, None]  # [T, 1]
    given = mask[:, :, :, :columns] + zero_rows
    # One slot more than the cache before the cut, so the padding is never empty (a zero-sized
    # tensor) when the mask covers every slot.
    room = torch.zeros(slots + 1, dtype=torch.float32)[columns:][None, :] + zero_rows
    bias = torch.cat([given, room[None, None]], dim=-1)[:, :, :, :slots]
    count = torch.ones_like(ids[0], dtype=torch.float32).sum(0, keepdim=True)
    keys = torch.ones_like(mask[0, 0, 0, :], dtype=torch.float32).sum(0, keepdim=True)
    return keys - extra - count, bias


def graph_inputs(unit: Interface, ids, position: int) -> tuple:
    """The stateful graph's inputs for tokens `ids` (a torch tensor [1, T]) at `position`: the
    position, or the interface's mask built from it (float32, as the converted program casts it)."""
    import torch

    from coreml.kinds.export import position_tensor

    if unit.mask_input is None:
        return ids, position_tensor(position)
    return ids, torch.from_numpy(causal_mask(unit, position, ids.shape[1]).astype(np.float32))


def _beyond_one_fp16_step(a: np.ndarray, b: np.ndarray) -> float:
    """Largest |a - b| of two fp16 arrays less one fp16 step at the larger magnitude (>= 0):
    what is left once a value rounded the other way is forgiven. A block of the first axis (a
    cache's layer) at a time: the whole of a context-8192 cache took eight float32 copies, 1.5 GB."""

    def beyond(a: np.ndarray, b: np.ndarray) -> float:
        spacing = np.spacing(np.maximum(np.abs(a), np.abs(b))).astype(np.float32)
        return float(np.maximum(np.abs(a.astype(np.float32) - b.astype(np.float32)) - spacing, 0).max())

    from coreml.kinds.export import worst

    return worst(*(beyond(x, y) for x, y in zip(a, b)))
