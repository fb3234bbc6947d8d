"""What the kinds' exporters share: the bundle's reference model, tracing, the checks of a
traced graph against the reference, the conversion of a traced graph with its interface,
the model's metadata and the package manifest.

Every kind is traced from the same reference model (`pipeline.ground.models`), never from a
second implementation, and a graph that fails its check is refused, never shipped.
"""

import importlib
import time
from contextlib import contextmanager
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import coremltools as ct
import numpy as np
import torch
from torch import nn

from coreml import crosscheck
from coreml import manifest as package_manifest
from coreml.ane import HW_LIMIT
from coreml.interfaces import DEFAULT_INTERFACE, INTERFACES, Interface
from coreml.layout import HEAD_SPLIT_REASON, head_rows
from coreml.mil import blob_const_digests
from coreml.precisions import FP32, POSITIONAL_REASON, Precision, precision
from coreml.split import MB, Piece
from coreml.kinds.schedules import CheckSchedule, check_schedules, noise_caches
from manifests.identity import Manifest, artifact_source, load_manifest, relative_path, sha256_bytes, sha256_file
from pipeline.ground.errors import CmfdeployError, UnsupportedModel
from pipeline.ground.models import KVCache, ModelArgs, build_model
from pipeline.ground.models.numerics import model_cache_bound, model_logits_bound
from pipeline.ground.reference import load_reference
from pipeline.ground.workers import return_freed_memory

# The layer types a package's graph runs: the reference's cached step holds a SlidingAttention
# layer's window in its mask.
EXPORTED_LAYER_TYPES = ("FullAttention", "SlidingAttention")
# Why every layer's cache is full-length, in the manifest of a model with SlidingAttention layers.
SLIDING_CACHE_DESIGN = (
    "every layer, SlidingAttention included, keeps a full-length cache (slot s = position s) and "
    "the window is the attention mask alone; a ring buffer of the window for the sliding layers "
    "would save cache memory but needs its own slot rule (position mod window) and mask, while "
    "the full-length cache keeps one cache shape and slot rule for every layer type"
)
TRACE_LENGTH = 5


class ScheduleMismatch(CmfdeployError):
    """A traced graph disagrees with the reference model on a chunk schedule or a length."""


class BadConversion(CmfdeployError):
    """A conversion parameter (`Conversion`) out of its range."""


@dataclass(frozen=True)
class Conversion:
    """What a conversion builds beyond the bundle, as JSON (it travels to conversion workers).

    `precision` names a unit of coreml.precisions. `transform` is a "module:function" called as
    `function(model, args, mitigations) -> nn.Module`: the model every kind traces instead of the
    reference itself (the fp16 preflight's mitigations, keeping the FP32 function); None traces
    the reference. `mitigations` is the record handed to it and written to each manifest;
    `preflight` the report that chose them, bound by sha256. `head_part_width`: at a precision
    of the Neural Engine's layout, a head wider than this many rows is split into parts of at
    most this many (`HeadParts`; the default is the Neural Engine's H/W limit). `interface` names a
    unit of coreml.interfaces: the kinds it shapes take its names (`coreml.convert`), the others
    cmfdeploy's. `max_package_mb`: the stateful package is cut into pieces of at most this many
    MB of weights (`coreml.split`; None: one package whatever its size).
    """

    precision: str = "fp32"
    transform: str | None = None
    mitigations: dict | None = None
    preflight: str | None = None
    head_part_width: int = HW_LIMIT
    interface: str = DEFAULT_INTERFACE
    max_package_mb: float | None = None

    def record(self, package_dir: Path) -> dict:
        """The manifest's `numerics` record for a package whose final folder is `package_dir`
        (empty for a plain FP32 conversion)."""
        record = {}
        if self.transform is not None:
            record["mitigations"] = {"transform": self.transform, "record": self.mitigations}
        if self.preflight is not None:
            report = Path(self.preflight)
            record["preflight"] = {"path": relative_path(report, package_dir), "sha256": sha256_file(report)}
        return record


@dataclass(frozen=True)
class Reference:
    """The bundle's reference model and what a package must record about it.

    `model` is what every kind traces: the bundle's reference decoder, or the conversion's
    transform of it (`Conversion.transform`); the checks before conversion compare a trace with it.
    """

    bundle_dir: Path
    args: ModelArgs
    model: nn.Module
    context: int
    bundle_manifest: dict
    source: dict  # the manifest's `source` record: the bundle, by manifest sha256
    precision: Precision = FP32
    numerics: dict = field(default_factory=dict)  # the manifest's `numerics` record (Conversion.record)
    head_rows: tuple[tuple[int, int], ...] | None = None  # the head's parts (coreml.layout.head_rows)
    interface: Interface = INTERFACES[DEFAULT_INTERFACE]  # the loader interface of the kind being exported
    max_package_bytes: int | None = None  # the per-package limit a stateful package is split under

    @property
    def check_schedules(self) -> tuple[CheckSchedule, ...]:
        return check_schedules(self.args, self.context)

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
        """A K/V cache entry, float32 graph vs float32 reference: FP32's bound of one entry for
        this model over the context (the same probable form)."""
        return model_cache_bound(self.model, self.context, probable=True)


def reference_for_export(bundle_dir: Path, context: int | None = None,
                         conversion: Conversion = Conversion()) -> Reference:
    """Verify the bundle (hashes included) and build its reference model (transformed as
    `conversion` says).

    Core ML packages here are dense decoders of full- and sliding-attention layers: anything
    else is refused by name before tracing.
    """
    bundle_dir = Path(bundle_dir)
    model, args, _ = load_reference(bundle_dir)  # verifies the bundle first
    where = bundle_dir / "config.json"
    if args.moe is not None or not set(args.layer_types) <= set(EXPORTED_LAYER_TYPES):
        raise UnsupportedModel(
            f"{where}: Core ML conversion supports dense full- and sliding-attention decoders; "
            f"got layer_types {sorted(set(args.layer_types))}, moe {args.moe is not None}"
        )
    context = args.deployed_context if context is None else context
    if not 1 <= context <= args.max_position_embeddings:
        raise UnsupportedModel(
            f"{where}: context {context} is outside 1..arch.max_position_embeddings {args.max_position_embeddings}"
        )
    unit = precision(conversion.precision)
    width = conversion.head_part_width
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise BadConversion(f"{bundle_dir}: conversion field 'head_part_width' (--head-part-width) is {width!r}, "
                            "not a positive number of rows")
    limit = conversion.max_package_mb
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
        raise BadConversion(f"{bundle_dir}: conversion field 'max_package_mb' (--max-package-mb) is {limit!r}, "
                            "not a positive number of MB")
    if conversion.transform is not None:
        module, _, name = conversion.transform.partition(":")
        model = getattr(importlib.import_module(module), name)(model, args, conversion.mitigations)
    return Reference(bundle_dir, args, model.eval(), context, load_manifest(bundle_dir), artifact_source(bundle_dir),
                     unit, head_rows=head_rows(args.vocab_size, width) if unit.neural_engine_layout else None,
                     max_package_bytes=None if limit is None else int(limit * MB))


# --- the head in parts -----------------------------------------------------------------


class HeadParts(nn.Module):
    """The head as one linear per part over its own rows of the head weight (a parameter, so a
    constant of its own in the program: no linear reads a weight wider than a part). A part is a
    view of the weight's rows, not a copy: the converter makes each part's constant anyway, and a
    copy here was one more head (113 MB on SmolLM2, 671 MB on Gemma 3) per traced function."""

    def __init__(self, model: nn.Module, rows: tuple[tuple[int, int], ...]):
        super().__init__()
        weight = model.head.weight.detach()
        self.rows = rows
        self.parts = nn.ParameterList([nn.Parameter(weight[start:stop], requires_grad=False)
                                       for start, stop in rows])

    def forward(self, hidden) -> tuple:
        return tuple(torch.nn.functional.linear(hidden, part) for part in self.parts)

    def token_rows(self, ids):
        """The token lookup of a tied table from the parts (`Decoder.token_rows`), so the program
        stores the table once: each part gathers the ids that fall in its rows (others read its
        row 0), and each token keeps its own part's gather. A select, not a sum of masked parts,
        so every row keeps its bits; the indices are integer values of the ids alone, which the
        Neural Engine check reads as the lookup's (`coreml.ane`)."""
        out = None
        for (start, stop), part in zip(self.rows, self.parts):
            inside = (ids >= start) & (ids < stop)
            rows = torch.nn.functional.embedding(torch.where(inside, ids - start, torch.zeros_like(ids)), part)
            out = rows if out is None else torch.where(inside.unsqueeze(-1), rows, out)
        return out


class SplitHeadModel(nn.Module):
    """The model with its head in parts, behind the two entries the kinds trace: the cached step
    (`forward_with_cache_tensors`: the parts as a tuple, then the caches) and the plain forward
    from position 0 (`forward`: the parts). A tied table is looked up from the parts
    (`HeadParts.token_rows`): one copy of it in the program, not the table and its parts."""

    def __init__(self, model: nn.Module, rows: tuple[tuple[int, int], ...]):
        super().__init__()
        self.model, self.head = model, HeadParts(model, rows)

    def forward_with_cache_tensors(self, ids, position, key_cache, value_cache, attention_bias=None,
                                   compute_dtype=None):
        token_rows = self.head.token_rows if self.model.lm_head is None else None
        hidden, keys, values = self.model.hidden_with_cache_tensors(ids, position, key_cache, value_cache,
                                                                    attention_bias=attention_bias,
                                                                    token_rows=token_rows,
                                                                    compute_dtype=compute_dtype)
        return self.head(hidden), torch.stack(keys), torch.stack(values)

    def forward(self, ids):
        ids = ids.reshape(1, -1)
        cache = KVCache.empty(self.model.args, ids.shape[1])
        position = torch.zeros(1, dtype=torch.int64)
        return self.forward_with_cache_tensors(ids, position, cache.keys, cache.values)[0]


class SplitHeadStep(SplitHeadModel):
    """`CachedStep` with the head in parts: `(ids, position, k, v) -> (logits_0, .., k', v')`
    (the model under the same attribute as CachedStep's, so its constants keep their names)."""

    def forward(self, ids, position, key_cache, value_cache):
        parts, keys, values = self.forward_with_cache_tensors(ids, position, key_cache, value_cache)
        return (*parts, keys, values)


def traced_model(ref: Reference) -> nn.Module:
    """What a kind's graph runs: the reference model, or it with its head in parts."""
    return ref.model if ref.head_rows is None else SplitHeadModel(ref.model, ref.head_rows)


def joined(logits) -> torch.Tensor:
    """A graph's logits: the tensor, or its head's parts concatenated in vocabulary order."""
    return torch.cat(logits, -1) if isinstance(logits, (tuple, list)) else logits


# --- tracing ---------------------------------------------------------------------------


def example_ids(vocab: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=generator, dtype=torch.int32)


def position_tensor(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32)


@contextmanager
def unprofiled_runs():
    """Traced graphs run by TorchScript's legacy executor inside: the profiling executor holds
    what it records of a graph's first runs, 1.5 GB more than later calls in the first chunk-KV
    call at SmolLM2's context of 8192. The same ops run either way; the setting is put back after."""
    profiling = torch._C._jit_set_profiling_executor(False)
    try:
        yield
    finally:
        torch._C._jit_set_profiling_executor(profiling)


def trace_module(module: nn.Module, example: tuple) -> torch.jit.ScriptModule:
    with torch.no_grad():
        return torch.jit.trace(module.eval(), example, check_trace=False)


# --- checks against the reference ------------------------------------------------------


def stateless_check_lengths(args: ModelArgs, context: int) -> tuple[int, ...]:
    """Lengths at which the stateless trace is replayed against the reference: a baked-in T
    shows up at 1, 7 and 128 tokens; a model whose sliding window is shorter than the
    context is also replayed over the whole context, past the window."""
    window = args.sliding_window if "SlidingAttention" in args.layer_types else None
    lengths = {1, 7, 128} | ({context} if window is not None and window < context else set())
    return tuple(sorted({min(n, context) for n in lengths}))


# Bytes of |got - want| a comparison of logits rows makes at a time.
COMPARE_BLOCK_BYTES = 64 << 20


def max_abs_delta(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over rows [T, vocab], a block of rows at a time (logits of a 262k
    vocabulary over 1024 positions are 1 GB); NaN where either holds one."""
    return max_abs_delta_rows(got, lambda start, stop: want[start:stop])


def max_abs_delta_rows(got: torch.Tensor, want_rows: Callable[[int, int], torch.Tensor]) -> float:
    """`max_abs_delta` against rows made on demand, `want_rows(start, stop)` a block at a time."""
    rows = max(1, COMPARE_BLOCK_BYTES // (got.shape[-1] * got.element_size()))
    return worst(*(float(torch.sub(got[i:i + rows], want_rows(i, min(i + rows, len(got)))).abs_().max())
                   for i in range(0, len(got), rows)))


def max_abs_delta_to_reference(got: torch.Tensor, model, hidden: torch.Tensor) -> float:
    """max |got - the reference's logits| where the reference gave final hidden states [T, hidden]:
    its head runs a block of rows at a time, never over all T (1 GB at 1024 positions of a 262k
    vocabulary). A row's logits are the same dot products in any block; the GEMM may sum them in
    another order, which the float32 tolerance is derived for (`pipeline.ground.models.numerics`)."""
    return max_abs_delta_rows(got, lambda start, stop: model.logits_of(hidden[start:stop]))


def worst(*deltas: float) -> float:
    """The largest of `deltas`, NaN where any is (Python's max drops a NaN after the first)."""
    return float("nan") if any(d != d for d in deltas) else max(deltas)


def check_chunk_schedules(
    graph: Callable,
    ref: Reference,
    schedules: Iterable[CheckSchedule] | None = None,
    tolerance: float | None = None,
) -> dict[str, float]:
    """Run `graph(ids, position, k, v)` chunk by chunk and compare with the reference.

    The caches start as noise, so a graph that reads a slot at or after position+T (or
    writes the wrong slots) shows up as a logit error; the reference's cache holds the same
    noise below the schedule's start and zeros from it. Each schedule (default: the model's
    `check_schedules`) is compared with one forward over all its tokens (the plain forward from
    slot 0) and with `forward_cached` fed the same chunks, chunk by chunk (the hidden states of
    both held, and their logits made for a block of rows at a time). Returns max |Δ| per
    schedule; raises `ScheduleMismatch` naming the first that fails.

    The reference's side runs first and keeps its hidden states only; the graph's caches are
    drawn again from the same seed after the reference's are let go, so the two sides' caches
    (and the copies each call makes) are never held at once: at SmolLM2's context of 8192 a
    cache pair is 378 MB, and both sides at once peaked at 3.4 GB anonymous.
    """
    tolerance = ref.tolerance if tolerance is None else tolerance
    schedules = ref.check_schedules if schedules is None else schedules
    errors = {}
    for index, schedule in enumerate(schedules):
        schedule = schedule.fit(ref.context)
        ids = example_ids(ref.args.vocab_size, schedule.tokens, seed=index + 2)
        ends = np.cumsum((0,) + schedule.chunks)
        chunks = [ids[:, start:stop] for start, stop in zip(ends, ends[1:])]
        with torch.no_grad():
            cache = KVCache(*schedule.prefix(*noise_caches(ref.cache_shape, 1000 + index)), schedule.start)
            # Short of the head: [T, hidden].
            full = ref.model.hidden_cached(ids, cache.snapshot()) if schedule.start else ref.model.hidden(ids)
            cached = [ref.model.hidden_cached(chunk, cache) for chunk in chunks]
            del cache
            return_freed_memory()  # the reference's caches, before the graph's are drawn
            key_cache, value_cache = noise_caches(ref.cache_shape, 1000 + index)
            delta = 0.0
            for chunk, start, want in zip(chunks, ends, cached):
                with unprofiled_runs():
                    *logits, key_cache, value_cache = graph(chunk, position_tensor(schedule.start + int(start)),
                                                            key_cache, value_cache)
                logits = joined(logits).reshape(-1, ref.args.vocab_size)
                delta = worst(delta, max_abs_delta_to_reference(logits, ref.model, full[start : start + len(want)]),
                              max_abs_delta_to_reference(logits, ref.model, want))
                del logits
                return_freed_memory()  # each call's per-layer copies, freed to the heap
            del key_cache, value_cache
        name = schedule.name
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
    for length in stateless_check_lengths(ref.args, ref.context):
        ids = example_ids(ref.args.vocab_size, length, seed=100 + length)
        with torch.no_grad():
            delta = max_abs_delta_to_reference(joined(graph(ids)).reshape(length, -1), ref.model, ref.model.hidden(ids))
        errors[f"T={length}"] = delta
        if not delta <= tolerance:
            raise ScheduleMismatch(
                f"{ref.bundle_dir}: stateless graph at T={length} differs from the reference "
                f"by max |Δ| {delta:.3g} > {tolerance:g}; refusing to export"
            )
    return errors


# --- conversion, metadata and manifest -------------------------------------------------


def _ct_inputs(block: dict, function: dict) -> list:
    """The inputs of a function (`function`: its `dims`, and `enumerated` lengths where it has them):
    a symbol with enumerated lengths becomes Core ML's enumerated shapes, one with a range a RangeDim."""
    dims, enumerated = function["dims"], function.get("enumerated", {})

    def dim(d):
        if isinstance(d, int):
            return d
        low, high = dims[d]
        return low if low == high else ct.RangeDim(lower_bound=low, upper_bound=high, default=low)

    def shape(f):
        symbols = [d for d in f["shape"] if d in enumerated]
        if not symbols:
            return tuple(dim(d) for d in f["shape"])
        (symbol,) = symbols  # one enumerated symbol per input (T)
        shapes = [tuple(n if d == symbol else dim(d) for d in f["shape"]) for n in enumerated[symbol]]
        return ct.EnumeratedShapes(shapes=shapes, default=shapes[0])

    return [ct.TensorType(name=f["name"], shape=shape(f), dtype=np.dtype(f["dtype"]).type) for f in block["inputs"]]


def _ct_output(feature: dict):
    # An fp16 output is declared (iOS16+ takes float16 multi-arrays); float32 ones are left to the
    # converter as they always were, so an FP32 package's bytes do not change.
    if feature["dtype"] == "float16":
        return ct.TensorType(name=feature["name"], dtype=np.float16)
    return ct.TensorType(name=feature["name"])


def convert_traced(traced, block: dict, function: dict, unit: Precision, mlpackage: Path):
    """`traced` as an ML Program, to be saved at `mlpackage` (`save_model`); coremltools' working
    files go in the stage's staging folder, the one that holds the package's folder."""
    states = [ct.StateType(wrapped_type=ct.TensorType(shape=tuple(f["shape"]), dtype=np.float16), name=f["name"])
              for f in block.get("states", [])]
    with package_manifest.working_files_in(mlpackage.parent.parent):
        return ct.convert(
            traced,
            inputs=_ct_inputs(block, function),
            outputs=[_ct_output(f) for f in block["outputs"]],
            states=states or None,
            convert_to="mlprogram",
            minimum_deployment_target=ct.target.iOS18,
            **unit.ct_convert_options(),
        )


def describe_model(mlmodel, block: dict, ref: Reference, description: str, features: bool = True) -> None:
    """Model-level metadata (the loader's name keys among it, `Interface.name_metadata`), and
    per-feature descriptions (single-function models only: coremltools cannot address a
    multifunction model's features by name)."""
    # The loader's name keys hold the source CMF's stem, as a release names the model.
    names = {key: Path(ref.bundle_manifest["source"]["file"]).stem for key in ref.interface.name_metadata}
    package_manifest.set_model_metadata(
        mlmodel,
        description=description,
        license_=ref.bundle_manifest.get("license") or "unspecified; see the source CMF's provenance",
        version=f"{package_manifest.COREML_FORMAT} {block['kind']}",
        user={crosscheck.BUNDLE_SHA_KEY: ref.source["manifest_sha256"], crosscheck.KIND_KEY: block["kind"],
              crosscheck.INTERFACE_KEY: block["interface"], **names,
              **({crosscheck.PIECE_KEY: crosscheck.piece_metadata(Piece.from_record(block["piece"]))}
                 if "piece" in block else {})},
    )
    if features:
        for f in block["inputs"]:
            mlmodel.input_description[f["name"]] = f["meaning"]
        for f in block["outputs"]:
            mlmodel.output_description[f["name"]] = f["meaning"]


def _source_files() -> list[Path]:
    """The code a package's bytes depend on, for the manifest's digest: the conversion, the
    precisions, the kinds (this module's folder) and the reference model (the preflight's
    mitigations among its modules)."""
    models_dir = Path(build_model.__code__.co_filename).parent
    kinds_dir = Path(__file__).parent
    return [kinds_dir.parent / "convert.py", kinds_dir.parent / "precisions.py", Path(package_manifest.__file__),
            *sorted(kinds_dir.glob("*.py")),
            *sorted(models_dir.glob("*.py"))]


def weight_names(mlpackage: Path, model: nn.Module, dtype: np.dtype = np.dtype(np.float32)) -> dict[str, list[str]]:
    """Program constant name -> the HF tensor names whose bytes, in the package's float `dtype`
    (float32, or float16 rounded to nearest as the converter rounds them), it holds exactly.

    Compression recipes select by these names, and reports and tests map decompressed
    constants back onto the reference model through them.
    """
    by_bytes: dict[str, list[str]] = {}
    for name, tensor in model.state_dict().items():
        # Hashed in place (a contiguous array is a buffer): a float32 model's tensors are the bundle's map.
        by_bytes.setdefault(sha256_bytes(np.ascontiguousarray(tensor.float().numpy(), dtype)), []).append(name)
    names = {name: sorted(found) for name, const in blob_const_digests(mlpackage).items()
             if const.dtype == dtype and const.shape and (found := by_bytes.get(const.sha256))}
    return dict(sorted(names.items()))


def sliding_window_record(args: ModelArgs) -> dict:
    """The manifest's account (under `checks`) of a model's SlidingAttention layers and their cache."""
    return {"size": args.sliding_window,
            "layers": [i for i, layer_type in enumerate(args.layer_types) if layer_type == "SlidingAttention"],
            "cache": "full-length", "why": SLIDING_CACHE_DESIGN}


def finish_package(package_dir: Path, ref: Reference, block: dict, checks: dict, seconds: float,
                   histogram: dict | None = None, size: int | None = None) -> Manifest:
    """Write the package's manifest. A split package (`coreml.kinds.stateful_split`) gives the op
    `histogram` and `size` of its pieces together, its block the weights of each."""
    mlpackage, block = package_dir / package_manifest.MODEL_NAME, dict(block)
    if histogram is None:
        block = {**block, "weights": weight_names(mlpackage, ref.model, ref.precision.numpy_dtype),
                 "fp32_ops": kept_fp32_record(mlpackage)}
    if ref.head_rows is not None:  # a tied table is looked up from the parts where one program has both
        block["head_split"] = head_split_record(ref, token_lookup=histogram is None and ref.model.lm_head is None)
    if "SlidingAttention" in ref.args.layer_types:
        checks = {**checks, "sliding_window": sliding_window_record(ref.args)}
    numerics = ref.numerics
    return package_manifest.write_package_manifest(
        package_dir,
        {
            **({"numerics": numerics} if numerics else {}),
            "format": package_manifest.COREML_FORMAT,
            "source": ref.source,
            "architecture": ref.bundle_manifest["architecture"],
            "special_tokens": ref.bundle_manifest["special_tokens"],
            "tokenizer": package_manifest.carry_tokenizer(ref.bundle_dir, package_dir),
            "package": block,
            "checks": checks,
            "package_bytes": package_manifest.package_bytes(mlpackage) if size is None else size,
            "conversion": {"seconds": round(seconds, 2), "code": package_manifest.source_digest(_source_files())},
        },
        histogram,
    )


def head_split_record(ref: Reference, token_lookup: bool) -> dict:
    """The manifest's `package.head_split`: the part width, each part's output and rows of the head
    weight, the bytes the parts store, whether the token lookup reads the parts (`token_lookup`: a
    tied table in a program that looks tokens up, `HeadParts.token_rows`) or a table of its own,
    and why (`coreml.crosscheck` checks each part's linear, weight shape and readers against the program)."""
    hidden, itemsize = ref.args.hidden_size, ref.precision.numpy_dtype.itemsize
    return {"part_width": max(stop - start for start, stop in ref.head_rows),
            "weight": ref.model.head_name,
            "parts": [{"output": f"logits_{i}", "rows": [start, stop]} for i, (start, stop) in enumerate(ref.head_rows)],
            "bytes": ref.args.vocab_size * hidden * itemsize,
            "token_lookup": token_lookup,
            "why": HEAD_SPLIT_REASON}


def traced_check_record(unit: Precision) -> dict:
    """What the checks before conversion compared, for the manifest's `checks` of a package that
    does not compute in float32 (nothing is added at FP32, whose checks say it by their name)."""
    if unit.compute_precision == "float32":
        return {}
    return {"checked_against": (
        "the traced graph, run in torch float32, against the model it traces (the reference, or its "
        "transform: Conversion.transform) within FP32's bound: a tracing fault (a baked-in length, "
        "a wrong slot) shows there; the converted program's " + unit.name + " numerics are not checked "
        "here but by the gates, on the executor against the " + unit.name + " reference")}


def kept_fp32_record(mlpackage: Path) -> dict:
    """The manifest's `package.fp32_ops`: the float32 arithmetic ops of a program that computes
    in fp16, per function and op type, all of them positional (`coreml.crosscheck.kept_fp32_ops`),
    with the reason; empty for a float32 program."""
    kept = crosscheck.kept_fp32_ops(crosscheck.read_program(mlpackage))
    if not any(kept.values()):
        return {}
    return {"ops": kept, "reason": POSITIONAL_REASON}


def save_single(ref: Reference, package_dir: Path, step: Callable[[str], None], traced, block: dict,
                 description: str, checks: dict, start: float) -> Manifest:
    """A single-function package: `traced` converted with interface `block`, described and
    saved with its manifest (`start`: when its export began, by time.perf_counter)."""
    step(f"{block['kind']}: convert")
    mlmodel = convert_traced(traced, block, block, ref.precision, package_dir / package_manifest.MODEL_NAME)
    describe_model(mlmodel, block, ref, description)
    step(f"{block['kind']}: save")
    package_dir.mkdir(parents=True)
    package_manifest.save_model(mlmodel, package_dir / package_manifest.MODEL_NAME)
    # The converted program holds every weight constant (fp16 copies in an fp16 conversion), in
    # reference cycles; the manifest reads them back from the saved weight file, so they go first.
    del mlmodel
    return_freed_memory()
    return finish_package(package_dir, ref, block, checks, time.perf_counter() - start)
