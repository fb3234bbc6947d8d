"""Convert a bundle's reference model into Core ML packages.

Three kinds, all traced from the same reference model (`pipeline.ground.models`), never from a
second implementation:

- `stateless`: `input_ids [1,T]` -> `logits [1,T,vocab]`, one full forward.
- `chunk_kv`: the KV cache passed in and out as float32 tensors with an absolute
  `position`, so a host can prefill and decode in chunks of any size.
- `stateful`: the KV cache kept as Core ML state (fp16, as Core ML requires), with a
  `prefill` (flexible T) and a `decode` (T=1) function in one multifunction package.

The chunk-KV graph is checked against the reference on fixed chunk schedules before
anything is converted; a graph that fails is refused, never shipped.
"""

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import coremltools as ct
import numpy as np
import torch
from torch import nn

from coreml import manifest as package_manifest
from coreml.mil import load_program
from coreml.package import open_package
from coreml.multifunction import merge_functions
from manifests.identity import Manifest, artifact_source, load_manifest, sha256_bytes
from manifests.output import refuse_existing, staged_output
from pipeline.ground.errors import CmfdeployError, UnsupportedModel
from pipeline.ground.models import CachedStep, KVCache, ModelArgs, build_model
from pipeline.ground.models.numerics import model_cache_bound, model_logits_bound
from pipeline.ground.reference import load_reference
from pipeline.ground.workers import thread_share_env

KINDS = ("stateless", "chunk_kv", "stateful")
# Chunk schedules (token counts per call) that together exercise a first call longer than
# one token, single-token decode between long chunks, and a chunk ending at the last slot.
CHECK_SCHEDULES = ((1, 3, 124), (128,), (3, 1, 124), (124, 3, 1), (127, 1))
# Lengths at which the stateless trace is replayed against the reference.
STATELESS_CHECK_LENGTHS = (1, 7, 128)
TRACE_LENGTH = 5


class ScheduleMismatch(CmfdeployError):
    """A traced graph disagrees with the reference model on a chunk schedule or a length."""


class UnknownKind(CmfdeployError):
    """A requested package kind is not one this converter builds."""


class ConversionFailed(CmfdeployError):
    """A worker process converting one package kind (`export_coreml(jobs=...)`) failed."""


@dataclass(frozen=True)
class Reference:
    """The bundle's reference model and what a package must record about it."""

    bundle_dir: Path
    args: ModelArgs
    model: nn.Module
    context: int
    bundle_manifest: dict
    source: dict  # the manifest's `source` record: the bundle, by manifest sha256

    @property
    def cache_shape(self) -> tuple[int, ...]:
        a = self.args
        return (a.num_layers, 1, a.num_kv_heads, self.context, a.head_dim)

    @cached_property
    def tolerance(self) -> float:
        """float32 graph vs float32 reference: only summation order differs. FP32's bound for
        this model over the context (pipeline.ground.models.numerics, the probable form the gates use)."""
        return model_logits_bound(self.model, self.context, probable=True)

    @cached_property
    def cache_tolerance(self) -> float:
        return model_cache_bound(self.model, self.context, probable=True)


def reference_for_export(bundle_dir: Path, context: int | None = None) -> Reference:
    """Verify the bundle (hashes included) and build its reference model.

    Core ML packages here are dense full-attention decoders: anything else is refused by
    name before tracing.
    """
    bundle_dir = Path(bundle_dir)
    model, args, _ = load_reference(bundle_dir)  # verifies the bundle first
    where = bundle_dir / "config.json"
    if args.moe is not None or set(args.layer_types) != {"FullAttention"}:
        raise UnsupportedModel(
            f"{where}: Core ML conversion supports dense full-attention decoders; "
            f"got layer_types {sorted(set(args.layer_types))}, moe {args.moe is not None}"
        )
    context = args.max_position_embeddings if context is None else context
    if not 1 <= context <= args.max_position_embeddings:
        raise UnsupportedModel(
            f"{where}: context {context} is outside 1..arch.max_position_embeddings {args.max_position_embeddings}"
        )
    return Reference(
        bundle_dir, args, model.eval(), context, load_manifest(bundle_dir), artifact_source(bundle_dir)
    )


# --- traced graphs ---------------------------------------------------------------------


class StatelessGraph(nn.Module):
    """`input_ids [1,T]` -> `logits [1,T,vocab]` through the reference model's plain forward."""

    def __init__(self, model: nn.Module, vocab: int):
        super().__init__()
        self.model, self.vocab = model, vocab

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids).reshape(1, -1, self.vocab)


class StatefulGraph(nn.Module):
    """The chunk-KV graph over fp16 buffers that the converter turns into Core ML states.

    The whole cache is written back each call: the reference contract returns full caches,
    and a full `[:]` write is the in-place form coremltools maps to `coreml_update_state`.
    """

    def __init__(self, model: nn.Module, cache_shape: tuple[int, ...]):
        super().__init__()
        self.model = model
        self.register_buffer("key_cache", torch.zeros(cache_shape, dtype=torch.float16))
        self.register_buffer("value_cache", torch.zeros(cache_shape, dtype=torch.float16))

    def forward(self, input_ids, position):
        logits, new_k, new_v = self.model.forward_with_cache_tensors(
            input_ids, position, self.key_cache.float(), self.value_cache.float()
        )
        self.key_cache[:] = new_k.half()
        self.value_cache[:] = new_v.half()
        return logits


def _example_ids(vocab: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=generator, dtype=torch.int32)


def _position(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32)


def _trace(module: nn.Module, example: tuple) -> torch.jit.ScriptModule:
    with torch.no_grad():
        return torch.jit.trace(module.eval(), example, check_trace=False)


# --- checks against the reference ------------------------------------------------------


def _clip_schedule(schedule: Iterable[int], context: int) -> tuple[int, ...]:
    """The schedule's chunks cut to fit `context` slots (the full schedules need 128)."""
    ends = np.minimum(np.cumsum(schedule), context)
    sizes = np.diff(ends, prepend=0)
    return tuple(int(s) for s in sizes if s > 0)


def check_chunk_schedules(
    graph: Callable,
    ref: Reference,
    schedules: Iterable[tuple[int, ...]] = CHECK_SCHEDULES,
    tolerance: float | None = None,
) -> dict[str, float]:
    """Run `graph(ids, position, k, v)` chunk by chunk and compare with the reference.

    The caches start as noise, so a graph that reads a slot at or after position+T (or
    writes the wrong slots) shows up as a logit error. Each schedule is compared with the
    plain forward over all tokens and with `forward_cached` fed the same chunks.
    Returns max |Δ| per schedule; raises `ScheduleMismatch` naming the first that fails.
    """
    tolerance = ref.tolerance if tolerance is None else tolerance
    errors = {}
    generator = torch.Generator().manual_seed(1)
    for schedule in schedules:
        schedule = _clip_schedule(schedule, ref.context)
        ids = _example_ids(ref.args.vocab_size, sum(schedule), seed=len(errors) + 2)
        key_cache = torch.randn(ref.cache_shape, generator=generator)
        value_cache = torch.randn(ref.cache_shape, generator=generator)
        cache = KVCache.empty(ref.args, ref.context)
        graph_logits, cached_logits = [], []
        position = 0
        with torch.no_grad():
            full = ref.model(ids).reshape(-1, ref.args.vocab_size)
            for size in schedule:
                chunk = ids[:, position : position + size]
                logits, key_cache, value_cache = graph(chunk, _position(position), key_cache, value_cache)
                graph_logits.append(logits.reshape(-1, ref.args.vocab_size))
                cached_logits.append(ref.model.forward_cached(chunk, cache).reshape(-1, ref.args.vocab_size))
                position += size
        graph_logits = torch.cat(graph_logits)
        delta = max(
            float((graph_logits - full).abs().max()),
            float((graph_logits - torch.cat(cached_logits)).abs().max()),
        )
        name = "[" + ",".join(map(str, schedule)) + "]"
        errors[name] = delta
        if not delta <= tolerance:  # also catches NaN
            raise ScheduleMismatch(
                f"{ref.bundle_dir}: chunk-KV graph on schedule {name} differs from the reference "
                f"by max |Δ| {delta:.3g} > {tolerance:g}; refusing to export"
            )
    return errors


def check_stateless(graph: Callable, ref: Reference) -> dict[str, float]:
    """Replay a traced stateless graph at several lengths: a baked-in T shows up here."""
    tolerance, errors = ref.tolerance, {}
    for length in sorted({min(n, ref.context) for n in STATELESS_CHECK_LENGTHS}):
        ids = _example_ids(ref.args.vocab_size, length, seed=100 + length)
        with torch.no_grad():
            delta = float((graph(ids).reshape(length, -1) - ref.model(ids).reshape(length, -1)).abs().max())
        errors[f"T={length}"] = delta
        if not delta <= tolerance:
            raise ScheduleMismatch(
                f"{ref.bundle_dir}: stateless graph at T={length} differs from the reference "
                f"by max |Δ| {delta:.3g} > {tolerance:g}; refusing to export"
            )
    return errors


def measure_stateful(mlpackage: Path, ref: Reference, schedules=CHECK_SCHEDULES) -> dict:
    """Run the saved stateful package through the MIL executor on the check schedules.

    The conversion check runs each chunk through the package and through the same graph
    eagerly in torch with fp16 buffers, both starting from the package's cache: the logits
    must agree within the float32 tolerance, and so must the caches each wrote once one fp16
    step is forgiven, else `ScheduleMismatch`. (Carrying the eager graph's own cache along
    instead lets an entry that float32 summation order rounded the other way grow, chunk
    after chunk, into a logit difference that says nothing about the conversion: 8e-4 on
    SmolLM2-135M.) The package against the float32 reference is the fp16-cache error,
    measured and recorded, not gated.
    """
    # One loaded program for both functions: a second load would map the weights again.
    prefill = open_package(mlpackage, backend="executor", function_name="prefill")
    functions = {"prefill": prefill, "decode": prefill.function("decode")}
    conversion, cache, fp16_cache = {}, {}, {}
    tolerance, cache_tolerance = ref.tolerance, ref.cache_tolerance
    for index, schedule in enumerate(schedules):
        schedule = _clip_schedule(schedule, ref.context)
        ids = _example_ids(ref.args.vocab_size, sum(schedule), seed=200 + index)
        eager = StatefulGraph(ref.model, ref.cache_shape)
        state = functions["prefill"].make_state()
        got, simulated, cache_delta, position = [], [], 0.0, 0
        with torch.no_grad():
            reference = ref.model(ids).numpy()
            for size in schedule:
                chunk = ids[:, position : position + size]
                inputs = {"input_ids": chunk.numpy(), "position": np.array([position], dtype=np.int32)}
                function = functions["decode" if size == 1 else "prefill"]
                for buffer in ("key_cache", "value_cache"):
                    getattr(eager, buffer).copy_(torch.from_numpy(state.read_state(buffer)))
                got.append(function.predict(inputs, state)["logits"][0])
                simulated.append(eager(chunk, _position(position))[0].numpy())
                for buffer in ("key_cache", "value_cache"):
                    written = _beyond_one_fp16_step(state.read_state(buffer), getattr(eager, buffer).numpy())
                    cache_delta = max(cache_delta, written)
                position += size
        got = np.concatenate(got)
        name = "[" + ",".join(map(str, schedule)) + "]"
        conversion[name] = float(np.abs(got - np.concatenate(simulated)).max())
        cache[name] = cache_delta
        fp16_cache[name] = float(np.abs(got - reference).max())
        if not (conversion[name] <= tolerance and cache_delta <= cache_tolerance):
            raise ScheduleMismatch(
                f"{mlpackage}: stateful package on schedule {name} differs from the fp16-cache torch graph "
                f"by max |Δ logit| {conversion[name]:.3g} and max |Δ cache| beyond one fp16 step "
                f"{cache_delta:.3g} (tolerances {tolerance:.3g}, {cache_tolerance:.3g}); refusing to export"
            )
    return {
        "executor_vs_fp16_cache_graph_max_abs": conversion,
        "tolerance": tolerance,
        "cache_tolerance": cache_tolerance,
        "cache_vs_fp16_cache_graph_max_abs_beyond_one_fp16_step": cache,
        "fp16_cache_error_vs_float32_reference_max_abs": fp16_cache,
        "measured_with": "coreml.mil executor (numpy), prefill for chunks > 1 token, decode for 1",
    }


def _beyond_one_fp16_step(a: np.ndarray, b: np.ndarray) -> float:
    """Largest |a - b| of two fp16 arrays less one fp16 step at the larger magnitude (>= 0):
    what is left once a value rounded the other way is forgiven."""
    spacing = np.spacing(np.maximum(np.abs(a), np.abs(b))).astype(np.float32)
    return float(np.maximum(np.abs(a.astype(np.float32) - b.astype(np.float32)) - spacing, 0).max())


# --- interfaces -------------------------------------------------------------------------


def _feature(name: str, dtype: str, shape: list, meaning: str) -> dict:
    return {"name": name, "dtype": dtype, "shape": shape, "meaning": meaning}


def package_interface(kind: str, ref: Reference) -> dict:
    """The manifest's `package` block: features by name, dtype, shape and meaning.

    `"T"` in a shape is the flexible token count, with its range under `dims` (and per
    function for the stateful package, whose `decode` fixes T = 1).
    """
    cache = list(ref.cache_shape)
    cache_meaning = "(layer, batch, kv_head, slot, head_dim); slot s holds the token at absolute position s"
    ids = _feature("input_ids", "int32", [1, "T"], "token ids")
    logits = _feature("logits", "float32", [1, "T", ref.args.vocab_size], "next-token logits at each input position")
    position = _feature(
        "position", "int32", [1],
        "absolute position of input_ids[0, 0]; cache slots position..position+T-1 are written, later slots are ignored",
    )
    block = {
        "name": package_manifest.MODEL_NAME,
        "kind": kind,
        "context": ref.context,
        "chunk": None,
        "compute_precision": "float32",
        "minimum_deployment_target": "iOS18",
        "dims": {"T": [1, ref.context]},
        "inputs": [ids],
        "outputs": [logits],
    }
    if kind == "chunk_kv":
        block["inputs"] += [position, _feature("key_cache", "float32", cache, f"keys {cache_meaning}"),
                            _feature("value_cache", "float32", cache, f"values {cache_meaning}")]
        block["outputs"] += [
            _feature("new_key_cache", "float32", cache, "key_cache with slots position..position+T-1 written"),
            _feature("new_value_cache", "float32", cache, "value_cache with slots position..position+T-1 written"),
        ]
    if kind == "stateful":
        block["inputs"] += [position]
        block["states"] = [_feature("key_cache", "float16", cache, f"keys {cache_meaning}"),
                           _feature("value_cache", "float16", cache, f"values {cache_meaning}")]
        block["functions"] = {"prefill": {"dims": {"T": [1, ref.context]}}, "decode": {"dims": {"T": [1, 1]}}}
        block["default_function"] = "decode"
    return block


def _ct_inputs(block: dict, dims: dict) -> list:
    def dim(d):
        if isinstance(d, int):
            return d
        low, high = dims[d]
        return low if low == high else ct.RangeDim(lower_bound=low, upper_bound=high, default=low)

    return [ct.TensorType(name=f["name"], shape=tuple(dim(d) for d in f["shape"]), dtype=np.dtype(f["dtype"]).type)
            for f in block["inputs"]]


def _convert(traced, block: dict, dims: dict):
    states = [ct.StateType(wrapped_type=ct.TensorType(shape=tuple(f["shape"]), dtype=np.float16), name=f["name"])
              for f in block.get("states", [])]
    return ct.convert(
        traced,
        inputs=_ct_inputs(block, dims),
        outputs=[ct.TensorType(name=f["name"]) for f in block["outputs"]],
        states=states or None,
        convert_to="mlprogram",
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT32,
    )


def _describe(mlmodel, block: dict, ref: Reference, description: str, features: bool = True) -> None:
    """Model-level metadata, and per-feature descriptions (single-function models only:
    coremltools cannot address a multifunction model's features by name)."""
    package_manifest.set_model_metadata(
        mlmodel,
        description=description,
        license_=ref.bundle_manifest.get("license") or "unspecified; see the source CMF's provenance",
        version=f"{package_manifest.COREML_FORMAT} {block['kind']}",
        user={package_manifest.BUNDLE_SHA_KEY: ref.source["manifest_sha256"], "cmfdeploy.kind": block["kind"]},
    )
    if features:
        for f in block["inputs"]:
            mlmodel.input_description[f["name"]] = f["meaning"]
        for f in block["outputs"]:
            mlmodel.output_description[f["name"]] = f["meaning"]


def _source_files() -> list[Path]:
    models_dir = Path(build_model.__code__.co_filename).parent
    return [Path(__file__), Path(package_manifest.__file__), *sorted(models_dir.glob("*.py"))]


def weight_names(mlpackage: Path, model: nn.Module) -> dict[str, list[str]]:
    """Program constant name -> the HF tensor names whose float32 bytes it holds exactly.

    Compression recipes select by these names, and reports and tests map decompressed
    constants back onto the reference model through them.
    """
    by_bytes: dict[str, list[str]] = {}
    for name, tensor in model.state_dict().items():
        by_bytes.setdefault(sha256_bytes(tensor.numpy().astype(np.float32).tobytes()), []).append(name)
    names = {}
    for function in load_program(mlpackage).functions.values():
        for op in function.block.operations:
            value = op.attributes.get("val") if op.type == "const" else None
            if isinstance(value, np.ndarray) and value.dtype == np.float32 and value.ndim:
                if found := by_bytes.get(sha256_bytes(np.ascontiguousarray(value).tobytes())):
                    names[op.outputs[0][0]] = sorted(found)
    return dict(sorted(names.items()))


def _finish(package_dir: Path, ref: Reference, block: dict, checks: dict, seconds: float) -> Manifest:
    mlpackage = package_dir / package_manifest.MODEL_NAME
    block = {**block, "weights": weight_names(mlpackage, ref.model)}
    return package_manifest.write_package_manifest(
        package_dir,
        {
            "format": package_manifest.COREML_FORMAT,
            "source": ref.source,
            "architecture": ref.bundle_manifest["architecture"],
            "special_tokens": ref.bundle_manifest["special_tokens"],
            "tokenizer": package_manifest.carry_tokenizer(ref.bundle_dir, package_dir),
            "package": block,
            "checks": checks,
            "package_bytes": package_manifest.package_bytes(mlpackage),
            "conversion": {"seconds": round(seconds, 2), "code": package_manifest.source_digest(_source_files())},
        },
    )


# --- the three package kinds -------------------------------------------------------------

DESCRIPTIONS = {
    "stateless": "Stateless decoder: input_ids -> logits over the whole sequence",
    "chunk_kv": "Chunk-KV decoder: tokens at an absolute position, KV cache passed in and out as float32",
    "stateful": "Stateful decoder: fp16 KV cache as Core ML state; prefill (1..context tokens) and decode (1 token)",
}


def _export_stateless(ref: Reference, package_dir: Path, step: Callable[[str], None]) -> Manifest:
    start = time.perf_counter()
    step("stateless: trace and check")
    graph = StatelessGraph(ref.model, ref.args.vocab_size)
    traced = _trace(graph, (_example_ids(ref.args.vocab_size, TRACE_LENGTH, 0),))
    checks = {"traced_vs_reference_max_abs": check_stateless(traced, ref), "tolerance": ref.tolerance}
    return _save_single(ref, package_dir, step, traced, "stateless", checks, start)


def _export_chunk_kv(ref: Reference, package_dir: Path, step: Callable[[str], None]) -> Manifest:
    start = time.perf_counter()
    step("chunk_kv: trace and check schedules")
    zeros = torch.zeros(ref.cache_shape)
    example = (_example_ids(ref.args.vocab_size, TRACE_LENGTH, 0), _position(3), zeros, zeros)
    traced = _trace(CachedStep(ref.model), example)
    checks = {"schedules_vs_reference_max_abs": check_chunk_schedules(traced, ref), "tolerance": ref.tolerance}
    return _save_single(ref, package_dir, step, traced, "chunk_kv", checks, start)


def _save_single(ref, package_dir, step, traced, kind, checks, start) -> Manifest:
    step(f"{kind}: convert")
    block = package_interface(kind, ref)
    mlmodel = _convert(traced, block, block["dims"])
    _describe(mlmodel, block, ref, DESCRIPTIONS[kind])
    step(f"{kind}: save")
    package_dir.mkdir(parents=True)
    mlmodel.save(str(package_dir / package_manifest.MODEL_NAME))
    return _finish(package_dir, ref, block, checks, time.perf_counter() - start)


def convert_stateful_functions(ref: Reference, folder: Path, step: Callable[[str], None]) -> dict[str, Path]:
    """The stateful package's functions, each converted and saved as a single-function
    package `folder/<name>.mlpackage`; paths by function name, in the block's order."""
    block = package_interface("stateful", ref)
    paths = {}
    for name, function in block["functions"].items():
        step(f"stateful: trace and convert {name}")
        paths[name] = folder / f"{name}.mlpackage"
        # In a function of its own, so the traced graph and converted program are freed
        # before the next function is traced.
        _save_stateful_function(ref, block, function["dims"], paths[name])
    return paths


def _save_stateful_function(ref: Reference, block: dict, dims: dict, path: Path) -> None:
    length = min(TRACE_LENGTH, dims["T"][1])
    traced = _trace(StatefulGraph(ref.model, ref.cache_shape), (_example_ids(ref.args.vocab_size, length, 0), _position(3)))
    mlmodel = _convert(traced, block, dims)
    _describe(mlmodel, block, ref, DESCRIPTIONS["stateful"])
    mlmodel.save(str(path))


def _export_stateful(ref: Reference, package_dir: Path, step: Callable[[str], None]) -> Manifest:
    start = time.perf_counter()
    block = package_interface("stateful", ref)
    package_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=package_dir.parent) as scratch:
        functions = convert_stateful_functions(ref, Path(scratch), step)
        step("stateful: save multifunction")
        mlmodel = merge_functions(functions, block["default_function"])
        _describe(mlmodel, block, ref, DESCRIPTIONS["stateful"], features=False)
        mlmodel.save(str(package_dir / package_manifest.MODEL_NAME))
    step("stateful: measure the fp16-cache error")
    checks = measure_stateful(package_dir / package_manifest.MODEL_NAME, ref)
    return _finish(package_dir, ref, block, checks, time.perf_counter() - start)


EXPORTERS = {"stateless": _export_stateless, "chunk_kv": _export_chunk_kv, "stateful": _export_stateful}
STEPS_PER_KIND = {"stateless": 3, "chunk_kv": 3, "stateful": 4}


def export_steps(kinds: Iterable[str], jobs: int = 1) -> int:
    """How many times `export_coreml` calls `progress` for these kinds (for a progress bar)."""
    kinds = tuple(kinds)
    if jobs > 1 and len(kinds) > 1:
        return 1 + len(kinds)  # one step as each worker's kind is done
    return 1 + sum(STEPS_PER_KIND.get(k, 0) for k in kinds)  # an unknown kind is export_coreml's to refuse


def export_coreml(
    bundle_dir: str | Path,
    out_dir: str | Path,
    kinds: Iterable[str] = KINDS,
    force: bool = False,
    context: int | None = None,
    progress: Callable[[str], None] | None = None,
    jobs: int = 1,
) -> dict[str, Manifest]:
    """Convert the bundle at `bundle_dir` into `out_dir/<kind>/` packages; manifests by kind.

    The bundle is verified (hashes included) before anything is built from it; the whole
    output appears at once (temp sibling + rename) or not at all. `context` caps the
    package context below the model's max_position_embeddings. `jobs` > 1 converts that
    many kinds at a time, each in a worker process (`_kinds_in_workers`).
    """
    kinds, out_dir = tuple(kinds), Path(out_dir)
    unknown = [k for k in kinds if k not in EXPORTERS]
    if unknown or not kinds:
        raise UnknownKind(f"{out_dir}: package kinds {unknown or '(none)'} are not among {KINDS}")
    step = progress or (lambda stage: None)
    refuse_existing(out_dir, force)
    step("verify the bundle and build the reference model")
    ref = reference_for_export(Path(bundle_dir), context)
    with staged_output(out_dir, force) as staging:
        if jobs > 1 and len(kinds) > 1:
            del ref  # each worker builds its own; this one's weights need not sit here meanwhile
            _kinds_in_workers(kinds, Path(bundle_dir), staging, out_dir, context, jobs, step)
        else:
            for kind in kinds:
                # A package's source record takes its relative path from its final folder, not the staging one.
                EXPORTERS[kind](replace(ref, source=artifact_source(ref.bundle_dir, relative_to=out_dir / kind)),
                                staging / kind, step)
    return {kind: Manifest(out_dir / kind, load_manifest(out_dir / kind)) for kind in kinds}


def _kinds_in_workers(kinds: tuple[str, ...], bundle_dir: Path, staging: Path, out_dir: Path, context: int | None,
                      jobs: int, step: Callable[[str], None]) -> None:
    """Each kind converted by a worker process (`python -m coreml.convert ORDER`) with a 1/jobs
    share of the cores, at most `jobs` at a time, the longest (stateful: half the total on
    SmolLM2) first. Tracing, coremltools' MIL passes and saving run mostly on one core, so
    two workers take about the longest kind's time instead of the sum. Each verifies the
    bundle and builds its reference model itself: JSON in, a package folder out."""
    env = thread_share_env(jobs)

    def convert(kind: str) -> str:
        order = json.dumps({"kind": kind, "bundle": str(bundle_dir), "context": context,
                            "package_dir": str(staging / kind), "final_dir": str(out_dir / kind)})
        done = subprocess.run([sys.executable, "-m", "coreml.convert", order], env=env, capture_output=True, text=True)
        if done.returncode:
            raise ConversionFailed(f"{out_dir / kind}: its worker process exited {done.returncode}:\n"
                                   f"{done.stderr[-4000:]}")
        return kind

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for finished in as_completed([pool.submit(convert, kind) for kind in sorted(kinds, key=lambda k: k != "stateful")]):
            step(f"{finished.result()}: converted")


def _worker(order: dict) -> None:
    """One kind of `_kinds_in_workers`, its package's source record relative to its final folder."""
    ref = reference_for_export(Path(order["bundle"]), order["context"])
    ref = replace(ref, source=artifact_source(ref.bundle_dir, relative_to=Path(order["final_dir"])))
    EXPORTERS[order["kind"]](ref, Path(order["package_dir"]), lambda stage: None)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))

