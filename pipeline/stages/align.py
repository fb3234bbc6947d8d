"""Alignment gates: a package judged in three parts, all written to its report.

1. Exactness: the package computes what its numerics intend. A PyTorch reference of those
   numerics (`Intended`) is built from the package itself: the FP32 reference model for FP32
   packages; that model loaded with the package's own weights, decoded from its constexpr
   ops by coremltools (`coreml.decoded`), for compressed ones; K/V kept in the package's
   cache dtype (fp16 for the stateful kind). The package is held to FP32's summation-order
   bound (`exact_tolerances`, derived from its shapes and weights) against it, one shot on every fixture case and, for packages that run in
   chunks, chunk by chunk on every chunk pattern: each chunk of the reference starts from
   the package's own cache, and the caches both write must agree too, so by induction the
   whole schedule is checked without carrying a rounding flip along.
2. Quality: the intended numerics stay within the user's `Budget` of FP32 on held-out text
   (`pipeline.ground.text_roles` "quality" lines: not the calibration text, not the gate fixtures)
   and on the scoring set: perplexity change, mean KL(FP32 || package), pooled top-1
   agreement, the fraction of items whose top-1 candidate changed.
3. Invariants: padding and future tokens never leak backwards, any chunk schedule gives the
   one-shot answer, branching from a snapshot is exact and leaves the snapshot untouched,
   garbage in unused cache slots changes nothing. They compare a package with itself.

No bound here is set from a measurement of the artifact it gates. A gate speaks only the
Backend protocol (`pipeline.ground.backend_protocol`), so an MLX artifact is gated by the same code
(`gate_backend`); `align_package` is the stage over a Core ML package.
"""

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from manifests.identity import file_identity, portable_name, read_json, sha256_file
from pipeline.ground.backend_protocol import ChunkSchedule, kl_rows, log_softmax, validate_ids
from pipeline.ground.errors import CmfdeployError

FORMAT = "cmfdeploy.alignment/1"
REPORT_NAME = "alignment.json"
BRANCH_PREFIX = 7
BRANCH_A = (9,)
BRANCH_B = (47, 81, 102)
DIRTY_FILL = 999.0
INVARIANT_PREFIX = 16
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_QUALITY_TEXT = ROOT / "fixtures" / "botchan.txt"
DEFAULT_ITEMS = ROOT / "fixtures" / "scoring" / "cloze.jsonl"


class GateFailed(CmfdeployError):
    """The gate ran and the package failed a part of it; the report is on disk."""


class BudgetError(CmfdeployError):
    """A `--budget` that does not parse."""


@dataclass(frozen=True)
class Tolerance:
    """Elementwise: |got - want| <= atol + rtol * |want| at every compared value.

    `min_top1` and `max_kl` are None for exactness: within the elementwise bound b a top-1
    can only swap where the reference's top two logits lie within 2b (a tie the bound
    allows), and KL(p || q) <= (max Δ - min Δ)^2 / 8 <= b^2 / 2 (Hoeffding's lemma on the
    log-partition), so neither adds a check of its own.
    """
    atol: float
    rtol: float
    min_top1: float | None
    max_kl: float | None
    why: str


def exact_tolerances(model, context: int) -> tuple[Tolerance, Tolerance]:
    """FP32's summation-order bound for `model` over `context` positions: (logits, K/V cache
    entries). The package and its reference run the same float32 operations on the same
    float32 weights; only the order of additions differs (blocked matmuls, fused attention,
    another reduction tree). The bound is `pipeline.ground.models.numerics`' probable form: set by
    the model's shapes and weights (a deeper or wider model accumulates more roundings), never
    by a recipe's bit width nor by a measured difference. A compressed package's model is the
    reference with its own decoded weights, whose norm and head scales enter as they are."""
    from pipeline.ground.models.numerics import PROBABLE_LAMBDA, model_cache_bound, model_logits_bound

    why = (f"the same float32 arithmetic in another summation order: 2·γ̃_N(λ={PROBABLE_LAMBDA:g})·scale over "
           f"this model's accumulation chain at {context} positions (pipeline/ground/models/numerics.py)")
    return (Tolerance(model_logits_bound(model, context, probable=True), 0.0, None, None, why),
            Tolerance(model_cache_bound(model, context, probable=True), 0.0, None, None, why))


GATED_KINDS = ("stateless", "chunk_kv", "stateful")
# Cache kinds: the K/V dtype the package's numerics keep (the reference rounds likewise).
CACHE_DTYPES = {"chunk_kv": np.float32, "stateful": np.float16}
# Chunk patterns. A compressed package is the FP32 program with each weight constant
# replaced by constexpr ops the runtime decodes once at load (`coreml.recipes` checks that
# nothing else changed), so the schedule logic its FP32 package's gate ran on every pattern
# is the same graph; what is new is the decoded weights, which one shot (every case) and one
# two-chunk schedule (the K/V projections written to the cache and read back) exercise.
ALL_PATTERNS = ("one_shot", "single_tokens", "split_3", "half_half")
COMPRESSED_PATTERNS = ("one_shot", "split_3")


# ---------------------------------------------------------------- the budget

@dataclass(frozen=True)
class Budget:
    """How far from FP32 a user lets the package's intended numerics go (`--budget`)."""
    ppl: float = 0.02  # relative perplexity increase on the quality text
    top1: float = 0.95  # pooled top-1 agreement with FP32, at least
    kl: float | None = None  # mean KL(FP32 || package) in nats, at most
    items: float | None = None  # fraction of scoring items whose top-1 candidate changed, at most

    def spec(self) -> str:
        optional = [f"{key}={value:g}" for key, value in (("kl", self.kl), ("items", self.items)) if value is not None]
        return ",".join([f"ppl={self.ppl * 100:g}%", f"top1={self.top1:g}", *optional])


DEFAULT_BUDGET = "ppl=2%,top1=0.95"


def parse_budget(text: str) -> Budget:
    """`ppl=2%,top1=0.95[,kl=0.01][,items=0.05]`; a percentage or a fraction where it is a fraction."""
    values = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in Budget.__dataclass_fields__ or not value:
            raise BudgetError(f"--budget {text!r}: item {part!r} is not one of ppl=, top1=, kl=, items=")
        try:
            values[key] = float(value[:-1]) / 100 if value.endswith("%") else float(value)
        except ValueError:
            raise BudgetError(f"--budget {text!r}: {key} value {value!r} is not a number") from None
    return Budget(**values)


# ---------------------------------------------------------------- fixtures

@dataclass(frozen=True)
class FixtureCase:
    name: str
    input_ids: np.ndarray
    logits: np.ndarray
    valid_prefix: int


class ReferenceFixtures:
    """The frozen reference: `index.json` (identity, format, cases) plus `logits.npz`."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.index = read_json(self.directory / "index.json")
        self.npz_path = self.directory / "logits.npz"
        with np.load(self.npz_path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
        self.cases = {
            name: FixtureCase(name, arrays[f"{name}.input_ids"], arrays[f"{name}.logits"], int(arrays[f"{name}.valid_prefix"]))
            for name, meta in self.index["cases"].items()
        }

    @property
    def checkpoint_sha256(self) -> str:
        return self.index["checkpoint"]["sha256"]

    def identity(self, relative_to: str | Path | None = None) -> dict:
        """`path` as `relative_to` may name it when given (reports that travel name no build path)."""
        path = str(self.directory) if relative_to is None else portable_name(self.directory, relative_to)
        return {"name": "reference-fixtures", "path": path,
                "sha256": sha256_file(self.directory / "index.json"),
                "logits": file_identity(self.npz_path),
                "checkpoint_sha256": self.checkpoint_sha256}


# ---------------------------------------------------------------- comparisons

def compare(got: np.ndarray, want: np.ndarray, tol: Tolerance) -> dict:
    """The error record of one comparison (positions x vocab); passed iff nothing lies outside."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if got.shape != want.shape:
        return {"passed": False, "error": f"shape {list(got.shape)} != reference {list(want.shape)}"}
    delta = np.abs(got - want)
    outside = int(np.count_nonzero(delta > tol.atol + tol.rtol * np.abs(want)) + np.count_nonzero(~np.isfinite(got)))
    top1 = got.argmax(-1) == want.argmax(-1)
    return {
        "positions": int(got.shape[0]),
        "max_abs": float(delta.max()),
        "p99_abs": float(np.percentile(delta, 99)),
        "mean_abs": float(delta.mean()),
        "outside": outside,
        "top1_agreement": float(top1.mean()),
        "kl_mean": float(np.mean(kl_rows(log_softmax(want), log_softmax(got)))),
        "passed": outside == 0,
    }


def cache_outside(got: np.ndarray, want: np.ndarray, tol: Tolerance) -> int:
    """Cache entries beyond the bound once one step of the cache dtype is forgiven: the
    package rounds its own value to fp16, and a value summation order left a hair to the
    other side of a rounding boundary lands one fp16 step away (exactly 0 for float32 steps
    below the bound)."""
    got32, want32 = got.astype(np.float32), want.astype(np.float32)
    step = np.spacing(np.maximum(np.abs(got), np.abs(want))).astype(np.float32)
    allowed = tol.atol + tol.rtol * np.abs(want32) + step
    return int(np.count_nonzero(np.abs(got32 - want32) > allowed) + np.count_nonzero(~np.isfinite(got32)))


def _bitwise(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def _delta_histogram(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """log10 |Δ| samples (capped) for the report's plot."""
    delta = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).ravel()
    rng = np.random.default_rng(0)
    sample = delta if delta.size <= 20000 else rng.choice(delta, 20000, replace=False)
    return np.log10(np.maximum(sample, 1e-12))


# ---------------------------------------------------------------- the intended numerics

class Intended:
    """The PyTorch reference of a package's intended numerics, behind the Backend protocol.

    `model` carries the weights the package intends (FP32, or its own decoded ones);
    `cache_dtype` is the dtype its K/V cache keeps: a chunk attends over its own float32
    K/V and writes them to the cache rounded to that dtype, as the package does.
    Snapshots are (keys, values, position) with numpy caches in `cache_dtype`.
    """

    def __init__(self, model, args, context: int, cache_dtype=np.float32, numerics: str = "fp32"):
        self.model, self.args, self.context = model, args, context
        self.cache_dtype, self.numerics = np.dtype(cache_dtype), numerics
        self.name = "torch-fp32" if numerics == "fp32" else f"torch-intended ({numerics})"
        self.cache_shape = (args.num_layers, 1, args.num_kv_heads, context, args.head_dim)
        self.tolerance, self.cache_tolerance = exact_tolerances(model, context)

    def chunk(self, ids, position: int, keys: np.ndarray, values: np.ndarray):
        """Logits of `ids` at `position` over the given caches, and the caches it writes."""
        import torch

        with torch.no_grad():
            logits, new_k, new_v = self.model.forward_with_cache_tensors(
                torch.as_tensor(np.asarray(ids, np.int64)).reshape(1, -1), torch.tensor([position]),
                torch.tensor(np.asarray(keys, np.float32)), torch.tensor(np.asarray(values, np.float32)))
        return logits[0].numpy(), new_k.numpy().astype(self.cache_dtype), new_v.numpy().astype(self.cache_dtype)

    def logits(self, ids) -> np.ndarray:
        import torch

        with torch.no_grad():
            return self.model(torch.from_numpy(validate_ids(ids, self.name, self.args.vocab_size, self.context))).numpy()

    def prefill_batch(self, prefixes) -> list:
        empty = np.zeros(self.cache_shape, self.cache_dtype)
        return self.extend_branches([((empty, empty, 0), ids) for ids in prefixes], last_only=True)

    def extend_batch(self, branches) -> list[np.ndarray]:
        return [logits for logits, _ in self.extend_branches(branches)]

    def extend_branches(self, branches, last_only: bool = False) -> list:
        """`chunk` of each (snapshot, ids) as one batch (`Decoder.forward_branches`), with the
        snapshots after them."""
        import torch

        tokens = [torch.from_numpy(validate_ids(ids, self.name, self.args.vocab_size, self.context, position))
                  for (_, _, position), ids in branches]
        with torch.no_grad():
            logits, keys, values = self.model.forward_branches(
                tokens, [position for (_, _, position), _ in branches],
                *(torch.from_numpy(np.stack([snapshot[part] for snapshot, _ in branches]).astype(np.float32, copy=False))
                  for part in (0, 1)), last_only=last_only)
        keys, values = keys.numpy().astype(self.cache_dtype), values.numpy().astype(self.cache_dtype)
        return [(rows.numpy(), (keys[i], values[i], position + len(ids)))
                for i, (rows, ((_, _, position), ids)) in enumerate(zip(logits, branches))]

    def prefill(self, ids):
        empty = np.zeros(self.cache_shape, self.cache_dtype)
        return self.extend((empty, empty, 0), ids, with_snapshot=True)

    def extend(self, snapshot, ids, with_snapshot: bool = False):
        keys, values, position = snapshot
        ids = validate_ids(ids, self.name, self.args.vocab_size, self.context, position)
        logits, keys, values = self.chunk(ids, position, keys, values)
        return (logits, (keys, values, position + len(ids))) if with_snapshot else logits


def _upstream_fp32(package_dir: Path, manifest: dict) -> tuple[Path, dict]:
    """The FP32 package a compressed one was made from (itself for an FP32 package)."""
    from coreml.manifest import COMPRESSED_FORMAT
    from manifests.chain import upstream_path
    from manifests.identity import load_manifest

    if manifest["format"] != COMPRESSED_FORMAT:
        return package_dir, manifest
    fp32_dir = upstream_path(package_dir, manifest["source"])
    return fp32_dir, load_manifest(fp32_dir)


def package_bundle(package_dir: Path, manifest: dict) -> Path:
    """The bundle a package was converted from (through its FP32 package, if compressed)."""
    from manifests.chain import upstream_path

    fp32_dir, fp32_manifest = _upstream_fp32(package_dir, manifest)
    return upstream_path(fp32_dir, fp32_manifest["source"])


def intended_for_package(package_dir: Path, manifest: dict) -> tuple[Intended, Intended]:
    """(the package's intended numerics, FP32's), both on the reference model of its bundle;
    one and the same object for an FP32 package with a float32 cache."""
    import torch

    from coreml.decoded import decoded_weights
    from pipeline.ground.reference import load_reference

    fp32_dir, fp32_manifest = _upstream_fp32(package_dir, manifest)
    bundle = package_bundle(fp32_dir, fp32_manifest)  # an FP32 package is its own upstream: no second read
    fp32_model, args, _ = load_reference(bundle)
    kind, context = manifest["package"]["kind"], manifest["package"]["context"]
    fp32 = Intended(fp32_model, args, context, np.float32, "fp32")
    cache_dtype = CACHE_DTYPES.get(kind, np.float32)
    if fp32_dir != package_dir:
        model, _, _ = load_reference(bundle)
        model.load_state_dict({name: torch.from_numpy(w) for name, w in decoded_weights(package_dir).items()},
                              strict=False)
        return Intended(model.eval(), args, context, cache_dtype, f"recipe {manifest['recipe']['name']}, decoded weights"), fp32
    if cache_dtype == np.float16:
        return Intended(fp32_model, args, context, cache_dtype, "fp32, fp16 K/V cache"), fp32
    return fp32, fp32


# ---------------------------------------------------------------- part 1: exactness

def _one_shot_want(intended: Intended, case: FixtureCase, frozen: bool) -> np.ndarray:
    """FP32 weights: the frozen fixtures are the FP32 reference's logits; otherwise compute."""
    return case.logits if frozen else intended.logits(case.input_ids)


def exactness_one_shot(one_shot: dict, intended: Intended, fixtures: ReferenceFixtures, frozen: bool,
                       samples: dict) -> list[dict]:
    records = []
    for case in fixtures.cases.values():
        got = one_shot[case.name][:case.valid_prefix]
        want = _one_shot_want(intended, case, frozen)[:case.valid_prefix]
        records.append({"check": "one_shot", "case": case.name, "pattern": "one_shot", **compare(got, want, intended.tolerance)})
        samples.setdefault("one_shot", []).append(_delta_histogram(got, want))
    return records


def chunk_patterns(n: int) -> dict[str, list[int]]:
    return {
        "one_shot": [n],
        "single_tokens": [1] * n,
        "split_3": [3, n - 3],
        "half_half": [n // 2, n - n // 2],
    }


# The package's caches before each chunk are held until the reference runs those chunks as one
# batch of branches (`Intended.extend_branches`): at most this many bytes of them at a time.
REFERENCE_BATCH_BYTES = 256 * 2**20


def run_checked(chunks: ChunkSchedule, intended: Intended, ids: np.ndarray, schedule: list[int]) -> dict:
    """`ids` through the package in chunks of `schedule`, each chunk also through the reference
    from the package's own cache before it: logits of both and the written-cache check. The
    reference's chunks depend on the package's caches only, so they run in batches of branches
    (one weight read for many single-token chunks: SmolLM2's single_tokens pattern 3x faster).
    A batched chunk is the same float32 arithmetic in another summation order, which the
    tolerances already allow for (`exact_tolerances`: FP32's summation-order bound),
    so the bounds are the chunk-by-chunk ones, unchanged."""
    snapshot, got, want, outside, start, pending, held = chunks.empty(), [], [], 0, 0, [], 0

    def check() -> int:
        # Chunks of one length per batch: unpadded, so the reference writes exactly the slots
        # the chunk covers and the whole written cache is compared, as it was chunk by chunk.
        refs = [None] * len(pending)
        for size in {len(part) for _, part, _ in pending}:
            alike = [i for i, (_, part, _) in enumerate(pending) if len(part) == size]
            for i, ref in zip(alike, intended.extend_branches([pending[i][:2] for i in alike])):
                refs[i] = ref
        want.extend(logits for logits, _ in refs)
        return sum(cache_outside(new, ref, intended.cache_tolerance)
                   for (_, (ref_keys, ref_values, _)), (_, _, after) in zip(refs, pending)
                   for new, ref in zip(after, (ref_keys, ref_values)))

    for size in schedule:
        part = ids[start:start + size]
        before = chunks.cache_arrays(snapshot)
        logits, snapshot = chunks.run(snapshot, part)
        got.append(logits)
        pending.append((before, part, chunks.cache_arrays(snapshot)[:2]))
        held += before[0].nbytes + before[1].nbytes
        if held >= REFERENCE_BATCH_BYTES:
            outside += check()
            pending, held = [], 0
        start += size
    if pending:
        outside += check()
    return {"got": np.concatenate(got), "want": np.concatenate(want), "cache_outside": outside}


def exactness_chunks(chunks: ChunkSchedule, intended: Intended, fixtures: ReferenceFixtures, patterns,
                     samples: dict, check: str) -> tuple[list[dict], dict]:
    """Every case on every pattern; also returns the runs for the pattern and prefix invariants.
    The one_shot pattern feeds the whole case (padding included: the prefix invariants read
    it); logits are compared over the valid prefix, caches everywhere."""
    records, runs = [], {}
    for case in fixtures.cases.values():
        n = case.valid_prefix
        for pattern, schedule in chunk_patterns(n).items():
            if pattern not in patterns:
                continue
            ids = case.input_ids if pattern == "one_shot" else case.input_ids[:n]
            run = runs[case.name, pattern] = run_checked(chunks, intended, ids, [len(ids)] if pattern == "one_shot"
                                                         else schedule)
            record = compare(run["got"][:n], run["want"][:n], intended.tolerance)
            record.update(cache_outside=run["cache_outside"], passed=record["passed"] and run["cache_outside"] == 0)
            records.append({"check": check, "case": case.name, "pattern": pattern, **record})
            samples.setdefault(check, []).append(_delta_histogram(run["got"][:n], run["want"][:n]))
    return records, runs


# ---------------------------------------------------------------- part 3: invariants

def _prefix_invariants(one_shot: dict, tol: Tolerance) -> list[dict]:
    """Padding and future tokens must not change the first 16 positions' logits: two float32
    evaluations of one model, within `tol` (FP32's summation-order bound)."""
    short = one_shot["short"][:INVARIANT_PREFIX]
    out = []
    for name in ("right_pad", "changed_future"):
        got = one_shot[name][:INVARIANT_PREFIX]
        out.append({"name": f"{name}_prefix_equals_short", **compare(got, short, tol)})
    return out


def pattern_invariants(runs: dict, fp16_cache: bool, bound: Tolerance) -> list[dict]:
    """Every chunk pattern against the one-shot run of the same package.

    With a float32 cache the patterns differ by summation order only: FP32's bound. An fp16
    cache rounds what later chunks read, so patterns differ by construction; there the
    package's pattern-minus-one-shot difference must be the reference's (run along the
    package's own caches), each side within the bound of its reference: twice the bound.
    """
    out = []
    for (case, pattern), run in runs.items():
        if pattern == "one_shot":
            continue
        n = len(run["got"])  # the one-shot run also fed the case's padding
        one_shot = {key: runs[case, "one_shot"][key][:n] for key in ("got", "want")}
        if fp16_cache:
            want = one_shot["got"] + (run["want"] - one_shot["want"])
            tol = Tolerance(2 * bound.atol, 2 * bound.rtol, None, None,
                            "fp16 cache: the reference's own pattern difference, each run within FP32's bound")
        else:
            want, tol = one_shot["got"], bound
        out.append({"name": f"{case}_{pattern}_equals_one_shot", **compare(run["got"], want, tol)})
    return out


def branching_invariants(candidate, prefix_ids: np.ndarray) -> list[dict]:
    """Rollback and branching: A, B, A from one snapshot; then, where the backend lets its
    snapshots be read and edited (`chunks`), the snapshot unchanged and a dirty tail."""
    _, snapshot = candidate.prefill(prefix_ids)
    chunks = getattr(candidate, "chunks", None)
    before = chunks and [np.array(a, copy=True) for a in chunks.cache_arrays(snapshot)[:2]]
    a1 = candidate.extend(snapshot, np.array(BRANCH_A))
    candidate.extend(snapshot, np.array(BRANCH_B))
    a2 = candidate.extend(snapshot, np.array(BRANCH_A))
    out = [{"name": "branch_A_B_A_bitwise", "passed": _bitwise(a1, a2), "max_abs": float(np.abs(a1 - a2).max())}]
    if chunks is None:
        return out + [{"name": name, "passed": None, "not_offered": f"backend {candidate.name} does not expose its "
                       "snapshots' caches (Backend.chunks)"} for name in ("snapshot_unchanged", "dirty_tail_bitwise")]
    keys, values, position = chunks.cache_arrays(snapshot)
    unchanged = _bitwise(keys, before[0]) and _bitwise(values, before[1])
    dirty = chunks.with_cache_arrays(snapshot, *(_dirty_tail(c, position) for c in (keys, values)))
    a_dirty = candidate.extend(dirty, np.array(BRANCH_A))
    b_clean = candidate.extend(snapshot, np.array(BRANCH_B))
    b_dirty = candidate.extend(dirty, np.array(BRANCH_B))
    return out + [
        {"name": "snapshot_unchanged", "passed": unchanged},
        {"name": "dirty_tail_bitwise", "passed": _bitwise(a1, a_dirty) and _bitwise(b_clean, b_dirty),
         "max_abs": float(max(np.abs(a1 - a_dirty).max(), np.abs(b_clean - b_dirty).max()))},
    ]


def _dirty_tail(cache: np.ndarray, position: int) -> np.ndarray:
    dirty = np.array(cache, copy=True)
    dirty[..., position:, :] = DIRTY_FILL
    return dirty


# ---------------------------------------------------------------- part 2: quality

class QualityInputs:
    """The held-out text and scoring set a quality part is measured on, with FP32's side
    computed once (a survey measures every recipe against the same FP32 figures). `bundle`:
    the bundle (or CMF) whose tokenizer reads them and whose reference `fp32` is."""

    def __init__(self, fp32, bundle: Path, text_path: Path, items_path: Path, window: int):
        from pipeline.stages.evaluate import windows
        from pipeline.stages.scoring import load_items
        from pipeline.ground.text_roles import text_roles
        from pipeline.ground.tokenizer import tokenizer_from_artifact

        self.fp32, self.bundle, self.tokenizer = fp32, Path(bundle), tokenizer_from_artifact(bundle)
        self.text_path, self.items_path = Path(text_path), Path(items_path)
        lines = self.text_path.read_text(encoding="utf-8").splitlines()
        ids = self.tokenizer.encode(" ".join(text_roles(lines, str(self.text_path))["quality"]))
        self.windows = windows(np.asarray(ids, np.int64), window, self.tokenizer.bos_id)
        self.items = load_items(self.items_path)
        self._fp32_scores = self._fp32_logits = None

    @property
    def fp32_logits(self) -> list[np.ndarray]:
        """FP32's logits per window, as the model returned them (float32)."""
        if self._fp32_logits is None:
            self._fp32_logits = [self.fp32.logits(w) for w in self.windows]
        return self._fp32_logits

    def use_fp32_scores(self, run_dir: Path) -> None:
        """Take FP32's item scores from a finished scoring run of this scoring set by the FP32
        reference of this bundle (the FP32 gate's `--scores-out`, or a survey's scores/fp32
        shared by its worker processes) instead of scoring them again. The run is verified;
        one of another scoring set, backend or bundle is refused, naming the field."""
        from manifests.chain import upstream_path
        from manifests.identity import load_manifest
        from pipeline.stages.scoring import read_run, verify_scores

        run_dir = Path(run_dir)
        manifest = verify_scores(run_dir).data
        scored = upstream_path(run_dir, manifest["source"])
        expected = {"scoring_set.sha256": (manifest["scoring_set"]["sha256"], sha256_file(self.items_path)),
                    "backend": (manifest["backend"], self.fp32.name),
                    "source (its bundle's manifest sha256)": (
                        sha256_file(package_bundle(scored, load_manifest(scored)) / "manifest.json"),
                        sha256_file(self.bundle / "manifest.json"))}
        for field, (got, want) in expected.items():
            if got != want:
                raise GateFailed(f"{run_dir / 'manifest.json'}: field {field!r} is {got!r}, not {want!r}: not the "
                                 f"FP32 baseline of {self.items_path} on the bundle {self.bundle}")
        self._fp32_scores = read_run(run_dir)

    @property
    def fp32_scores(self) -> list:
        from pipeline.stages.scoring import score_items

        if self._fp32_scores is None:
            self._fp32_scores = score_items(self.fp32, self.tokenizer, self.items)
        return self._fp32_scores

    def identity(self, relative_to: str | Path) -> dict:
        """Inputs named as `portable_name` names them from `relative_to` (reports travel in releases)."""
        return {"text": file_identity(self.text_path) | {"path": portable_name(self.text_path, relative_to),
                                                         "role": "quality lines"},
                "items": file_identity(self.items_path) | {"path": portable_name(self.items_path, relative_to)},
                "windows": len(self.windows), "tokens": int(sum(len(w) - 1 for w in self.windows))}


def measure_quality(intended, inputs: QualityInputs, budget: Budget, all_figures: bool = False) -> tuple[dict, list]:
    """The quality record of `intended` (any Backend) against FP32, and its item scores.

    The held-out text comes first. The scoring set costs ten times its tokens (320 items on
    SmolLM2: 100 s, against 5 s for the text), so it is measured only where its figure can
    still matter: a package within budget on the text, or every package with `all_figures`.
    Over budget on the text is over budget whatever the items say; the record says the
    figure was not measured and why. Intended numerics that are FP32's own (the same
    object) have nothing to compare: no item can change, and no scores are returned.
    """
    from pipeline.stages.scoring import rank_differences, score_items

    same = intended is inputs.fp32
    nll = {"fp32": 0.0, "package": 0.0}
    kl_sum = agree = count = 0
    for tokens, logits in zip(inputs.windows, inputs.fp32_logits):
        log_p = log_softmax(logits)[:-1]
        log_q = log_p if same else log_softmax(intended.logits(tokens))[:-1]
        rows, targets = np.arange(len(tokens) - 1), tokens[1:]
        nll["fp32"] -= log_p[rows, targets].sum()
        nll["package"] -= log_q[rows, targets].sum()
        kl_sum += kl_rows(log_p, log_q).sum()
        agree += int(np.count_nonzero(log_p.argmax(-1) == log_q.argmax(-1)))
        count += len(tokens) - 1
    ppl = {k: float(np.exp(v / count)) for k, v in nll.items()}
    figures = {"ppl_change": ppl["package"] / ppl["fp32"] - 1, "top1_agreement": agree / count,
               "kl_mean": float(kl_sum / count)}
    limits = {"ppl_change": ("<=", budget.ppl), "top1_agreement": (">=", budget.top1),
              "kl_mean": ("<=", budget.kl), "items_top1_changed": ("<=", budget.items)}

    def over(names):
        return [k for k in names if limits[k][1] is not None and not (
            figures[k] <= limits[k][1] if limits[k][0] == "<=" else figures[k] >= limits[k][1])]

    over_text, skipped = over(("ppl_change", "top1_agreement", "kl_mean")), None
    scores = None
    if same:
        figures["items_top1_changed"] = 0.0
    elif over_text and not all_figures:
        figures["items_top1_changed"] = None
        skipped = (f"over budget on {', '.join(over_text)} from the held-out text already, so the scoring set "
                   "cannot change the verdict (--all-figures measures it anyway)")
    else:
        scores = score_items(intended, inputs.tokenizer, inputs.items)
        figures["items_top1_changed"] = len(rank_differences(inputs.fp32_scores, scores).top1_changed) / len(inputs.items)
    over_budget = over_text + ([] if figures["items_top1_changed"] is None else over(("items_top1_changed",)))
    return {"perplexity": ppl, **figures, "tokens": count, "items": len(inputs.items),
            **({"items_not_measured": skipped} if skipped else {}),
            "budget": {**asdict(budget), "spec": budget.spec()}, "over_budget": over_budget,
            "within_budget": not over_budget, "measured_on": intended.name}, scores


# ---------------------------------------------------------------- the gate over any backend

class _Clock:
    """Wall seconds per step of a gate, recorded in its report (benchmarks/pipeline_bench.py reads them)."""

    def __init__(self):
        self.laps, self._last = {}, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._last, 3)
        self._last = now


def summarize(records: list[dict]) -> dict:
    compared = [r for r in records if "max_abs" in r]
    if not compared:
        return {"comparisons": len(records), "passed": all(r["passed"] for r in records)}
    return {
        "comparisons": len(records),
        "max_abs": max(r["max_abs"] for r in compared),
        "p99_abs_max": max(r["p99_abs"] for r in compared),
        "mean_abs": float(np.mean([r["mean_abs"] for r in compared])),
        "outside": sum(r["outside"] + r.get("cache_outside", 0) for r in compared),
        "top1_agreement_min": min(r["top1_agreement"] for r in compared),
        "kl_mean_max": max(r["kl_mean"] for r in compared),
        "passed": all(r["passed"] for r in records),
    }


def gate_backend(candidate, intended: Intended, fixtures: ReferenceFixtures, quality: QualityInputs,
                 budget: Budget, *, frozen: bool, patterns=ALL_PATTERNS, check: str = "chunked",
                 all_figures: bool = False) -> dict:
    """All three parts on `candidate` (any Backend; its `chunks`, where it has them, for the
    chunk patterns and the snapshot checks). `frozen`: the fixtures' logits are the intended
    one-shot logits (FP32 weights). Returns the report body and, under "_scores", the item
    scores of the quality part (None where they were not measured; `measure_quality`)."""
    samples, clock = {}, _Clock()
    chunks = getattr(candidate, "chunks", None)
    records, invariants = [], []
    if chunks is not None:
        records, runs = exactness_chunks(chunks, intended, fixtures, patterns, samples, check)
        invariants += pattern_invariants(runs, intended.cache_dtype == np.float16, intended.tolerance)
        one_shot = {name: runs[name, "one_shot"]["got"] for name in fixtures.cases}
        clock.lap("chunk_patterns")
    else:
        one_shot = {name: candidate.logits(case.input_ids) for name, case in fixtures.cases.items()}
    # FP32 weights: the same one-shot logits against the frozen fixtures as well.
    if frozen or chunks is None:
        records = exactness_one_shot(one_shot, intended, fixtures, frozen, samples) + records
    invariants = _prefix_invariants(one_shot, intended.tolerance) + invariants
    clock.lap("one_shot")
    invariants += branching_invariants(candidate, fixtures.cases["long"].input_ids[:BRANCH_PREFIX])
    clock.lap("branching")
    quality_record, scores = measure_quality(intended, quality, budget, all_figures)
    clock.lap("quality")
    exact = all(r["passed"] for r in records)
    invariants_passed = all(i["passed"] is not False for i in invariants)
    return {
        "passed": exact and quality_record["within_budget"] and invariants_passed,
        "numerics": intended.numerics,
        "candidate_backend": candidate.name,
        "exactness": {"passed": exact, "reference": intended.name,
                      "patterns": list(patterns) if chunks is not None else ["one_shot"]},
        "quality": quality_record,
        "tolerance": asdict(intended.tolerance),
        "cache_tolerance": asdict(intended.cache_tolerance),
        "summary": {**summarize(records), "exact": exact, "within_budget": quality_record["within_budget"],
                    "invariants_passed": invariants_passed},
        "records": records,
        "invariants": invariants,
        "seconds": clock.laps,
        "_samples": samples,
        "_scores": scores,
    }


# ---------------------------------------------------------------- the human forms

def _gate_samples_plot(path: Path, samples: dict, bound: float) -> Path:
    from pipeline.stages.report import histogram_plot

    return histogram_plot(path, samples, title="log10 |Δ logit| against the intended-numerics reference",
                          xlabel="log10 |Δ|  (exact matches drawn at -12)", marker=float(np.log10(bound)))


def _verdict(ok: bool | None, bad: str = "FAILED") -> str:
    return "passed" if ok else f'<span style="color:red">**{bad}**</span>' if ok is False else "not run"


def _markdown(report: dict) -> str:
    from pipeline.stages.report import md_table

    q, s = report["quality"], report["summary"]
    budget = q["budget"]
    lines = [
        f"# Alignment gate: {'PASSED' if report['passed'] else 'FAILED'}",
        "",
        f"- package: `{report['package']['path']}` ({report['package']['kind']}, recipe `{report['recipe']}`)",
        f"- candidate backend: **{report['candidate_backend']}**; intended numerics: {report['numerics']}",
        "",
        "| part | verdict |",
        "|---|---|",
        f"| 1. exactness against `{report['exactness']['reference']}` | "
        f"{_verdict(s['exact'], 'NOT EXACT: a conversion or runtime bug')} |",
        f"| 2. quality within the budget `{budget['spec']}` | {_verdict(s['within_budget'], 'OVER BUDGET')} |",
        f"| 3. invariants | {_verdict(s['invariants_passed'])} |",
        "",
        "## 1. Exactness",
        "",
        f"Bound: |Δ| <= {report['tolerance']['atol']:.3g} on every logit and {report['cache_tolerance']['atol']:.3g} "
        f"on every cache entry ({report['tolerance']['why']}); "
        f"patterns {', '.join(report['exactness']['patterns'])}.",
        "",
        md_table(["check", "case", "pattern", "max |Δ|", "p99 |Δ|", "outside", "cache outside", "top-1", "KL", "passed"],
                 [[r["check"], r["case"], r["pattern"], r.get("max_abs"), r.get("p99_abs"), r.get("outside"),
                   r.get("cache_outside", ""), r.get("top1_agreement"), r.get("kl_mean"), r["passed"]]
                  for r in report["records"]]),
        "## 2. Quality against FP32",
        "",
        f"{q['tokens']} held-out tokens of quality text, {q['items']} scoring items; measured on `{q['measured_on']}`.",
        "",
        md_table(["figure", "value", "budget", "within"],
                 [["perplexity change", f"{q['ppl_change']:+.2%} ({q['perplexity']['fp32']:.4g} -> "
                   f"{q['perplexity']['package']:.4g})", f"<= +{budget['ppl']:.2%}", "ppl_change" not in q["over_budget"]],
                  ["pooled top-1 agreement", q["top1_agreement"], f">= {budget['top1']}",
                   "top1_agreement" not in q["over_budget"]],
                  ["mean KL(FP32 ‖ package)", q["kl_mean"], budget["kl"] if budget["kl"] is not None else "-",
                   "kl_mean" not in q["over_budget"]],
                  ["items whose top-1 changed",
                   q["items_top1_changed"] if q["items_top1_changed"] is not None else
                   "not measured: " + q["items_not_measured"],
                   budget["items"] if budget["items"] is not None else "-",
                   "items_top1_changed" not in q["over_budget"]]]),
        "## 3. Invariants",
        "",
        md_table(["invariant", "max |Δ|", "passed"],
                 [[i["name"], i.get("max_abs"), i["passed"] if i["passed"] is not None else i["not_offered"]]
                  for i in report["invariants"]]),
        "![error distribution](alignment.png)",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- the stage

def source_cmf_sha256(package_dir: Path) -> str:
    """The sha256 of the CMF at the start of the package's identity chain."""
    from manifests.chain import upstream_path
    from manifests.identity import load_manifest

    current = Path(package_dir)
    while True:
        source = load_manifest(current)["source"]
        if source["kind"] == "cmf":
            return source["sha256"]
        current = upstream_path(current, source)


def package_recipe(manifest: dict) -> str:
    return manifest.get("recipe", {}).get("name", "fp32")


def quality_inputs_for(package_dir: Path, manifest: dict, fp32: Intended, quality_text, items) -> QualityInputs:
    """The quality text and scoring set, tokenized by the package's bundle."""
    return QualityInputs(fp32, package_bundle(package_dir, manifest), quality_text, items, fp32.context)


def align_package(package_dir, fixtures_dir, out_dir, *, budget: Budget | str = DEFAULT_BUDGET,
                  quality_text=DEFAULT_QUALITY_TEXT, items=DEFAULT_ITEMS, backend: str = "auto",
                  force: bool = False, quality: QualityInputs | None = None, scores_out=None,
                  all_figures: bool = False, fp32_scores=None) -> dict:
    """Gate the package at `package_dir`; write `out_dir/{alignment.json,.md,.png}` and a manifest.

    The report is written whatever the outcome; a failed gate then raises GateFailed.
    `quality` shares one FP32 side across calls (the survey); `scores_out` writes the
    quality part's scoring run there (`pipeline.stages.scoring.write_run`) where the scoring set
    was measured; `all_figures` measures it even over budget (`measure_quality`);
    `fp32_scores` reads FP32's side of it from that run (`QualityInputs.use_fp32_scores`).
    """
    from coreml.runner import open_package_backend
    from manifests.chain import verify_chain
    from manifests.identity import MANIFEST_NAME, artifact_source, environment, inventory, load_manifest, write_json
    from manifests.output import refuse_existing, staged_output
    from pipeline.stages.scoring import write_run

    package_dir, out_dir = Path(package_dir), Path(out_dir)
    refuse_existing(out_dir, force)  # before minutes of gating, not after
    if scores_out is not None:
        refuse_existing(Path(scores_out), force)
    budget = parse_budget(budget) if isinstance(budget, str) else budget
    chain = verify_chain(package_dir)
    manifest = load_manifest(package_dir)
    kind = manifest["package"]["kind"]
    if kind not in GATED_KINDS:
        raise GateFailed(f"{package_dir}: package kind {kind!r} has no alignment gate; gated: {list(GATED_KINDS)}")
    fixtures = ReferenceFixtures(fixtures_dir)
    source_sha = source_cmf_sha256(package_dir)
    if source_sha != fixtures.checkpoint_sha256:
        raise GateFailed(f"{fixtures.directory / 'index.json'}: fixtures were made from CMF sha256 "
                         f"{fixtures.checkpoint_sha256}, but {package_dir} comes from {source_sha}")
    candidate = open_package_backend(package_dir, backend=backend)
    intended, fp32 = intended_for_package(package_dir, manifest)
    quality = quality or quality_inputs_for(package_dir, manifest, fp32, quality_text, items)
    if fp32_scores is not None:
        quality.use_fp32_scores(fp32_scores)
    recipe = package_recipe(manifest)
    body = gate_backend(candidate, intended, fixtures, quality, budget, frozen=recipe == "fp32",
                        patterns=ALL_PATTERNS if recipe == "fp32" else COMPRESSED_PATTERNS, check=kind,
                        all_figures=all_figures)
    samples, scores = body.pop("_samples"), body.pop("_scores")
    # Every path the gate records is relative to its own folder: gates ship in releases.
    fixtures_identity = fixtures.identity(relative_to=out_dir)
    report = {
        "format": FORMAT,
        "recipe": recipe,
        **body,
        "reference": {"backend": intended.name, "fixtures": {
            "kind": "artifact", "format": "cmfdeploy.fixtures/1", "path": fixtures_identity["path"],
            "manifest_sha256": fixtures_identity["sha256"]}},
        "package": {"path": portable_name(package_dir, out_dir), "kind": kind,
                    "manifest_sha256": sha256_file(package_dir / MANIFEST_NAME)},
        "fixtures": fixtures_identity,
        "quality_inputs": quality.identity(relative_to=out_dir),
        "chain": [str(link.relative_to(out_dir)) for link in chain],
    }
    with staged_output(out_dir, force) as staging:
        write_json(staging / REPORT_NAME, report)
        (staging / "alignment.md").write_text(_markdown(report))
        _gate_samples_plot(staging / "alignment.png", samples, report["tolerance"]["atol"])
        write_json(staging / MANIFEST_NAME, {
            "format": FORMAT, "status": "complete", "passed": report["passed"], "recipe": recipe,
            "candidate_backend": candidate.name, "budget": budget.spec(),
            "source": artifact_source(package_dir, relative_to=out_dir),
            "fixtures": fixtures_identity,
            "summary": report["summary"],
            "files": inventory(staging),
            "environment": environment(),
        })
    if scores_out is not None and intended is quality.fp32:
        scores = quality.fp32_scores  # FP32 is its own quality baseline: its scores are the baseline's
    if scores_out is not None and scores is not None:
        write_run(scores, scores_out, artifact=package_dir, backend_name=intended.name, items_path=quality.items_path,
                  force=force)
    if not report["passed"]:
        raise GateFailed(f"{package_dir}: {_failure(report)}; report at {out_dir / REPORT_NAME}")
    return report


def _failure(report: dict) -> str:
    s, parts = report["summary"], []
    if not s["exact"]:
        failing = [r for r in report["records"] if not r["passed"]]
        parts.append(f"not exact ({len(failing)} comparisons outside FP32's bound, first "
                     f"{failing[0]['case']}/{failing[0]['pattern']}, max |Δ| {failing[0].get('max_abs')})")
    if not s["within_budget"]:
        parts.append(f"over the budget {report['quality']['budget']['spec']} on {report['quality']['over_budget']}")
    if not s["invariants_passed"]:
        parts.append("invariants failed: " + ", ".join(i["name"] for i in report["invariants"] if i["passed"] is False))
    return "gate failed: " + "; ".join(parts)


def verify_alignment(path, hashes: bool = True):
    """Verifier for `cmfdeploy verify-artifact`: files intact and the gate passed."""
    from manifests.copied import check_copied
    from manifests.identity import MANIFEST_NAME, Manifest, check_files, load_manifest, read_json

    path = Path(path)
    manifest = load_manifest(path, FORMAT)
    check_files(path, manifest["files"], hashes=hashes)
    check_copied(path / MANIFEST_NAME, "", manifest, read_json(path / REPORT_NAME), path / REPORT_NAME,
                 keys=("passed", "recipe", "candidate_backend", "fixtures", "summary"))
    return Manifest(path, manifest)


def require_passed(alignment_dir) -> dict:
    """The manifest of a passed gate, for stages that take a gated package as input."""
    manifest = verify_alignment(alignment_dir).data
    if not manifest["passed"]:
        raise GateFailed(f"{alignment_dir}: the alignment gate of its package did not pass; "
                         "downstream stages refuse this package")
    return manifest
