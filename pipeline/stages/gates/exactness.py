"""Part 1, exactness: the package computes what its numerics intend.

The reference of those numerics (`pipeline.stages.gates.references`) is built from the
package itself. The package is held to FP32's summation-order bound (`exact_tolerances`,
derived from its shapes and weights) against it, one shot on every fixture case and, for
packages that run in chunks, chunk by chunk on every chunk pattern: each run of the
reference (a chunk, or a few short ones: `run_checked`) starts from the package's own cache,
and the caches both write must agree too, so by induction the whole schedule is checked
without carrying a rounding flip along.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.ground.backend_protocol import ChunkSchedule, kl_rows_of_logits
from pipeline.ground.scratch import ScratchFile
from pipeline.stages.gates.fixtures import FixtureCase, ReferenceFixtures

# Chunk patterns. A compressed package is the FP32 program with each weight constant
# replaced by constexpr ops the runtime decodes once at load (`coreml.recipes` checks that
# nothing else changed), so the schedule logic its FP32 package's gate ran on every pattern
# is the same graph; what is new is the decoded weights, which one shot (every case) and one
# two-chunk schedule (the K/V projections written to the cache and read back) exercise.
ALL_PATTERNS = ("one_shot", "single_tokens", "split_3", "half_half", "window_edge")
COMPRESSED_PATTERNS = ("one_shot", "split_3")
# The package's caches before each chunk are held until the reference runs those chunks as one
# batch of branches (`TorchBackend.advance_arrays`): at most this many bytes of them at a time, as
# float32. The batch holds about four times that while it runs (the caches stacked, the ones it
# writes, their rounding to the package's cache dtype and the copies handed back): at 256 MB of
# fp16 caches SmolLM2's stateful gate peaked 1.8 GB over its baseline. Single-token chunks over
# an fp16 cache no longer go this way (`TorchBackend.single_steps`: one forward for a run of them,
# 13.7x and 14.4x faster on Gemma 3 and SmolLM2 at 1024 slots than batches of 4 and 3, benchmarks/gate_bench.py).
REFERENCE_BATCH_BYTES = 128 * 2**20
# The most tokens of consecutive chunks the reference checks as one run (`reference_runs`): its
# logits are 64 MB on a 262k vocabulary.
REFERENCE_RUN_TOKENS = 64
# Comparisons go through logits this many bytes of rows at a time: a 262k vocabulary's logits
# over 1024 positions are 1 GB, and a comparison's temporaries are about eight times its block
# (|Δ|, then both log-softmaxes and the KL terms in float64): a 64 MB block held 0.4-0.5 GB of
# each SmolLM2-shaped survey worker's private memory.
COMPARE_BLOCK_BYTES = 16 * 2**20
# The percentile of |Δ| a comparison reports beside its max and mean.
P99 = 99.0


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
    # Where the bound is set from the reference's rounding noise (`noise_tolerances`): the
    # largest noise, and the a-priori bound every atol stays under. None where `atol` is the
    # a-priori bound itself.
    noise: float | None = None
    ceiling: float | None = None
    # The bound of each fixture case where it is set case by case (`noise_tolerances`): logits
    # take one atol per compared position (`rows`, position 0 first), K/V one per case
    # (`cases`). `atol` is then the largest of them, the one a page headlines.
    rows: dict[str, list[float]] | None = None
    cases: dict[str, float] | None = None

    def for_case(self, *names: str) -> "Tolerance":
        """The bound of the comparison of case `names[0]` (or of the first positions the named
        cases share, where one case's rows are compared with another's): atol per position, an
        array of shape (positions, 1), or the case's own."""
        if self.rows is not None:
            rows = [np.asarray(self.rows[name], np.float64) for name in names]
            shared = min(len(r) for r in rows)
            atol = np.max([r[:shared] for r in rows], axis=0)[:, None]
        elif self.cases is not None:
            atol = max(self.cases[name] for name in names)
        else:
            return self
        return Tolerance(atol, self.rtol, self.min_top1, self.max_kl, self.why, self.noise, self.ceiling)


def exact_tolerances(model, context: int, hot_rows_head_norm: float | None = None) -> tuple[Tolerance, Tolerance]:
    """The summation-order bound of the intended numerics for `model` over `context` positions:
    (logits, K/V cache entries).

    FP32: the package and its reference run the same float32 operations on the same float32
    weights; only the order of additions differs (blocked matmuls, fused attention, another
    reduction tree). An fp16 reference (`pipeline.ground.models.fp16.Fp16Reference`): both
    sides round every op's output to fp16, maybe at other places (a fused op rounds once where
    the reference rounds twice) and sum in other orders, so the bound is built on u16 over the
    model's chain of op boundaries (`numerics.fp16_logits_bound`). Either is
    `pipeline.ground.models.numerics`' probable form: set by the model's shapes and weights (a
    deeper or wider model accumulates more roundings), never by a recipe's bit width nor by a
    measured difference. A compressed package's model is the reference with its own decoded
    weights, whose norm and head scales enter as they are; a head summed from a table's code and
    its hot rows' residual enters with `hot_rows_head_norm` (`numerics.model_logits_bound`)."""
    from pipeline.ground.models.fp16 import Fp16Reference
    from pipeline.ground.models.numerics import (PROBABLE_LAMBDA, fp16_cache_bound, fp16_logits_bound,
                                                 model_cache_bound, model_logits_bound)

    if isinstance(model, Fp16Reference):
        why = (f"fp16 arithmetic rounded at other op boundaries and summed in another order: 2·γ̃_n(λ="
               f"{PROBABLE_LAMBDA:g}, u=2^-11) over this model's op boundaries plus FP32's chain at {context} "
               f"positions, times the head's scale (pipeline/ground/models/numerics.py)")
        return (Tolerance(fp16_logits_bound(model.decoder, context, probable=True), 0.0, None, None, why),
                Tolerance(fp16_cache_bound(model.decoder, context, probable=True), 0.0, None, None, why))
    why = (f"the same float32 arithmetic in another summation order: 2·γ̃_N(λ={PROBABLE_LAMBDA:g})·scale over "
           f"this model's accumulation chain at {context} positions (pipeline/ground/models/numerics.py)"
           + (", the head summed from the table's code and its hot rows" if hot_rows_head_norm is not None else ""))
    return (Tolerance(model_logits_bound(model, context, probable=True, hot_rows_head_norm=hot_rows_head_norm),
                      0.0, None, None, why),
            Tolerance(model_cache_bound(model, context, probable=True), 0.0, None, None, why))


# How many times the reference's own rounding noise (`pipeline.ground.models.noise`: at each
# compared position, the largest |float32 − float64| over the vocabulary, or |fp16 − float64| for
# an fp16 reference; for the K/V, the largest over a case's written entries) a package's logits
# or K/V may lie from the reference there. Both are evaluations of one function in the same
# arithmetic, so |package − reference| <= |package − exact| + |reference − exact|, and the second
# term is the measured noise n. The first is another evaluation's error: under the probabilistic
# model of the a-priori bound (`numerics`, Higham & Mary) each rounding is a mean-zero draw
# whatever the summation order, so another order's error has the same distribution, and the
# maximum over a row's 10^4-10^5 logits (a case's 10^5-10^7 K/V entries) concentrates: it moves
# by O(1/sqrt(2 ln N)) of itself between draws. A kernel that computes an op by another formula
# (softmax through exp(x − max) or a log-sum-exp, a mean as a sum times 1/n, a fused
# multiply-add) adds a few roundings per op to the dozens a value already carries along 30
# layers: allowing the package up to 4n gives 5n, and 8n leaves 1.6x above that for a row whose
# largest errors sit in a few logits (a fatter tail than the model's draws). The bound follows
# the noise position by position because the noise itself does: a position whose residual
# stream carries a massive activation (the first tokens, an attention sink) rounds 10-20x more
# than its neighbours, and one bound for the whole case would be that position's. The package
# never enters: n is the reference's alone. An fp16 package rounds at its own op boundaries (a
# fused op once where the reference rounds twice), which is the same draw of fp16 roundings in
# other places. A row's largest errors share one cause, the error of that position's hidden
# state, so the maximum over its logits concentrates less than N independent draws would: one
# draw at a position can be lucky (a small hidden-state error) where another evaluation's is
# not. So no position's n is taken below the median n of its case (`noise_floor`), the size of
# a typical draw there; a position whose residual stream rounds more keeps its larger n. Found
# by a correct fp16 SmolLM2 chunk-KV package that the per-position bound alone failed: 0.434 at
# a right_pad position whose reference erred 0.050 (8.6n), where the case's median n was 0.069.
# Measured (benchmarks/noise_bench.py): a correct FP32 package on SmolLM2-135M lies
# 1.0-1.3n from the reference at the median position and 2.7n at the worst of 320; one matrix of
# one layer scaled by 1 + 1e-3 moves the logits by 73-122n at the median position.
NOISE_FACTOR = 8.0


def noise_floor(rows: np.ndarray) -> np.ndarray:
    """A case's per-position noise, no position below the case's median (`NOISE_FACTOR`'s note)."""
    return np.maximum(rows, np.median(rows)) if len(rows) else rows


def noise_tolerances(ceilings: tuple[Tolerance, Tolerance], intended, fixtures: ReferenceFixtures,
                     ) -> tuple[Tolerance, Tolerance]:
    """(logits, K/V) bounds of `NOISE_FACTOR` x the intended reference's rounding noise measured
    on each fixture case, the logits' position by position and the K/V's case by case
    (`Tolerance.for_case`), each under its a-priori ceiling (`exact_tolerances`), which stays
    the bound where the noise is not measured: a head summed from a table's code and its hot
    rows (the package rounds two products where the reference rounds one). An fp16 reference's
    noise is its fp16 arithmetic against the same mitigated function in float64: the package is
    another fp16 evaluation of that function, rounded at its own op boundaries."""
    import torch

    from pipeline.ground.models.base import Decoder
    from pipeline.ground.models.fp16 import Fp16Reference
    from pipeline.ground.models.noise import rounding_noise
    from pipeline.ground.models.numerics import U16, U32

    model = intended.model
    fp16 = isinstance(model, Fp16Reference)
    if intended.hot_rows_head_norm is not None or not (fp16 or isinstance(model, Decoder)) or (
            not fp16 and any(p.dtype != torch.float32 for p in model.parameters())):
        return ceilings
    noises = {name: rounding_noise(model, case.input_ids, case.valid_prefix) for name, case in fixtures.cases.items()}
    # A reference exact to the bit at a position (no rounding left a trace) still allows one step
    # of its arithmetic at that position's largest logit.
    unit = U16 if fp16 else U32
    logit_rows = {name: noise_floor(np.maximum(n.logit_rows, unit * n.largest_rows)) for name, n in noises.items()}
    cache_cases = {name: n.cache for name, n in noises.items()}
    logits_ceiling, cache_ceiling = ceilings
    rows = {name: np.minimum(NOISE_FACTOR * r, logits_ceiling.atol).tolist() for name, r in logit_rows.items()}
    cases = {name: min(NOISE_FACTOR * n, cache_ceiling.atol) for name, n in cache_cases.items()}
    arithmetic = "fp16" if fp16 else "float32"
    every = np.concatenate(list(logit_rows.values()))
    measured = f"{len(noises)} fixture cases, pipeline/ground/models/noise.py"
    logits = Tolerance(
        max(max(r) for r in rows.values()), 0.0, None, None,
        f"{NOISE_FACTOR:g} x the {arithmetic} reference's own rounding noise at each position, none below its "
        f"case's median (max |{arithmetic} − float64| over the vocabulary: median {np.median(every):.3g}, largest {every.max():.3g} over "
        f"{len(every)} positions of {measured}), under the a-priori bound {logits_ceiling.atol:.3g}",
        noise=float(every.max()), ceiling=logits_ceiling.atol, rows=rows)
    cache = Tolerance(
        max(cases.values()), 0.0, None, None,
        f"{NOISE_FACTOR:g} x the {arithmetic} reference's own rounding noise in each case's written K/V (max "
        f"|{arithmetic} − float64| {max(cache_cases.values()):.3g}, {measured}), under the a-priori bound "
        f"{cache_ceiling.atol:.3g}",
        noise=max(cache_cases.values()), ceiling=cache_ceiling.atol, cases=cases)
    return logits, cache


# ---------------------------------------------------------------- comparisons

def compare(got: np.ndarray, want: np.ndarray, tol: Tolerance) -> dict:
    """The error record of one comparison (positions x vocab); passed iff nothing lies outside.
    Rows go through in blocks (`COMPARE_BLOCK_BYTES`) and nothing of the arrays' size is made:
    |Δ|'s 99th percentile comes from its largest values, kept as the blocks go (as many as the
    percentile's rank can reach: 1 % of them). Each figure is the one the whole arrays give,
    up to the float64 summation order of the mean."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if got.shape != want.shape:
        return {"passed": False, "error": f"shape {list(got.shape)} != reference {list(want.shape)}"}
    rows = len(got) if got.ndim < 2 else max(1, COMPARE_BLOCK_BYTES // (got[0].nbytes or 1))
    blocks = [slice(None)] if got.ndim < 2 else [slice(i, i + rows) for i in range(0, len(got), rows)]
    keep = _largest_needed(got.size, P99)
    # A per-position atol (`Tolerance.for_case`) goes with the rows, which start at position 0.
    atol = np.asarray(tol.atol)
    outside, finite, top1, kl = 0, [], [], []
    largest, delta_max, delta_sum, counted, worst = np.empty(0, np.float32), 0.0, 0.0, 0, 0.0
    for block in blocks:
        g, w = got[block], want[block]
        d = np.abs(np.subtract(g, w))
        bound = (atol if atol.ndim == 0 else atol[:len(got)][block]) + tol.rtol * np.abs(w)
        outside += int(np.count_nonzero(d > bound) + np.count_nonzero(~np.isfinite(g)))
        # An inf or NaN is outside any bound (counted above); the figures are over the finite
        # rows, so a report holds numbers only (JSON has no NaN).
        ok = np.atleast_1d(np.isfinite(g).all(-1) & np.isfinite(w).all(-1))
        finite.append(ok)
        if ok.any():
            bound = np.broadcast_to(bound, d.shape)
            g, w, d, bound = (g[ok], w[ok], d[ok], bound[ok]) if g.ndim > 1 else (g, w, d, bound)
            # How close the worst value came to its own bound: a margin a page can show, 1 at the bound.
            worst = max(worst, float(np.max(d / np.maximum(bound, np.finfo(np.float32).tiny))))
            top1.append(np.atleast_1d(g.argmax(-1) == w.argmax(-1)))
            kl.append(np.atleast_1d(kl_rows_of_logits(w, g)[0]))
            delta_max = max(delta_max, float(d.max()))
            delta_sum += float(np.sum(d, dtype=np.float64))
            counted += d.size
            values = d.reshape(-1)
            if len(largest) == keep:
                # Once `keep` values are held, one no larger than the least of them cannot change
                # which values are the `keep` largest (a tie leaves their multiset as it is), so
                # only the few above it are partitioned in: a 262k vocabulary's 1024 rows were 64
                # partitions of 7 M values a comparison, 9 % of Gemma 3's chunk-KV gate. (The
                # least, not the first: a block of exactly `keep` values was never partitioned.)
                values = values[values > largest.min()]
            largest = np.concatenate([largest, values])
            if len(largest) > keep:
                largest = np.partition(largest, len(largest) - keep)[len(largest) - keep:]
    finite = np.concatenate(finite)
    record = {"positions": int(got.shape[0]), "outside": outside, "nonfinite_rows": int(np.count_nonzero(~finite))}
    if not finite.any():
        return {**record, "error": "every position has a non-finite logit", "passed": False}
    top1, kl = np.concatenate(top1), np.concatenate(kl)
    return {
        **record,
        "max_abs": delta_max,
        "max_of_bound": worst,
        "p99_abs": _percentile_of_largest(largest, counted, P99),
        "mean_abs": delta_sum / counted,
        "top1_agreement": float(top1.mean()),
        "kl_mean": float(np.mean(kl)),
        "passed": outside == 0,
    }


def _largest_needed(count: int, q: float) -> int:
    """How many of the largest of `count` values hold their q-th percentile (linear
    interpolation, numpy's default) and the value after it; enough for fewer values too."""
    return count - int(np.floor(q / 100 * (count - 1)))


def _percentile_of_largest(largest: np.ndarray, count: int, q: float) -> float:
    """`np.percentile(values, q)` of `count` values of which `largest` holds at least the
    `_largest_needed(count, q)` largest: the two order statistics around the rank, interpolated."""
    rank = q / 100 * (count - 1)
    below = int(np.floor(rank))
    descending = np.sort(largest)[::-1]
    low, high = float(descending[count - 1 - below]), float(descending[count - 1 - min(below + 1, count - 1)])
    return low + (high - low) * (rank - below)


def cache_outside(got: np.ndarray, want: np.ndarray, tol: Tolerance) -> int:
    """Cache entries beyond the bound once one step of the cache dtype is forgiven: the
    package rounds its own value to fp16, and a value summation order left a hair to the
    other side of a rounding boundary lands one fp16 step away (exactly 0 for float32 steps
    below the bound). Every entry within `atol` passes whatever its step and scale, so the
    full rule runs on the others alone: a single-token chunk rewrites one slot of a cache the
    whole of which is compared (Gemma 3's 38 MB a step, 1024 steps a long case). Entries of
    the same bits differ by exactly 0, so only the others, and any non-finite entry, are looked
    at as floats: the slots a chunk left alone are compared at the cost of reading them."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype == want.dtype and got.dtype.itemsize in (2, 4) and got.shape == want.shape:
        bits = np.dtype(f"u{got.itemsize}")
        suspect = np.not_equal(got.view(bits), want.view(bits))
        suspect |= ~np.isfinite(got)
        got, want = got[suspect], want[suspect]
    got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    delta = np.subtract(got32, want32)
    # Not `delta > atol`: a NaN (an inf or NaN written) must go on to be counted.
    near_miss = ~(np.abs(delta, out=delta) <= tol.atol)
    if not near_miss.any():
        return 0
    got, want = got[near_miss], want[near_miss]
    got32, want32 = got.astype(np.float32), want.astype(np.float32)
    step = np.spacing(np.maximum(np.abs(got), np.abs(want))).astype(np.float32)
    allowed = tol.atol + tol.rtol * np.abs(want32) + step
    return int(np.count_nonzero(np.abs(got32 - want32) > allowed) + np.count_nonzero(~np.isfinite(got32)))


def bitwise(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def delta_histogram(got: np.ndarray, want: np.ndarray, samples: int = 20000) -> np.ndarray:
    """log10 |Δ| at `samples` positions drawn without replacement (every one where there are
    fewer), for the report's plot: drawn before anything is subtracted, so no array of the
    logits' size is made (1 GB for a 262k vocabulary at 1024 positions)."""
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    at = slice(None) if got.size <= samples else np.sort(np.random.default_rng(0).choice(got.size, samples, replace=False))
    delta = np.abs(got[at].astype(np.float32) - want[at].astype(np.float32))
    return np.log10(np.maximum(delta, 1e-12))


# ---------------------------------------------------------------- one shot

def _one_shot_want(intended, case: FixtureCase, frozen: bool) -> np.ndarray:
    """FP32 weights: the frozen fixtures are the FP32 reference's logits; otherwise compute."""
    return case.logits if frozen else intended.logits(case.input_ids)


def exactness_one_shot(one_shot: dict, intended, fixtures: ReferenceFixtures, frozen: bool, samples: dict,
                       tolerance: Tolerance) -> list[dict]:
    records = []
    for case in fixtures.cases.values():
        got = one_shot[case.name][:case.valid_prefix]
        want = _one_shot_want(intended, case, frozen)[:case.valid_prefix]
        records.append({"check": "one_shot", "case": case.name, "pattern": "one_shot",
                        **compare(got, want, tolerance.for_case(case.name))})
        samples.setdefault("one_shot", []).append(delta_histogram(got, want))
    return records


# ---------------------------------------------------------------- chunk patterns

def sliding_window(args) -> int | None:
    """The model's sliding window where any layer is SlidingAttention (None for `args` None)."""
    return args.sliding_window if args is not None and "SlidingAttention" in args.layer_types else None


def chunk_patterns(n: int, window: int | None = None) -> dict[str, list[int]]:
    """The chunk patterns over `n` tokens, one_shot first. With a sliding `window` shorter than
    `n`, window_edge decodes single tokens on each side of its edge (positions window-1 and
    window, where the first key leaves the window); the other patterns cross it in chunks."""
    patterns = {
        "one_shot": [n],
        "single_tokens": [1] * n,
        "split_3": [3, n - 3],
        "half_half": [n // 2, n - n // 2],
    }
    if window is not None and window < n:
        patterns["window_edge"] = [size for size in (window - 1, 1, 1, n - window - 1) if size > 0]
    return patterns


def reference_runs(schedule: list[int], cache_dtype) -> list[list[int]]:
    """The chunks of `schedule` grouped into the runs the reference checks them by, in order:
    consecutive chunks of up to REFERENCE_RUN_TOKENS tokens in all are one run (a longer chunk
    is a run of its own); with a cache of another dtype than float32, only single-token ones
    (`single_token_run`), every longer chunk being a run of its own."""
    float32 = np.dtype(cache_dtype) == np.float32
    runs: list[list[int]] = []
    for size in schedule:
        if (runs and sum(runs[-1]) + size <= REFERENCE_RUN_TOKENS
                and (float32 or single_token_run(runs[-1] + [size], cache_dtype))):
            runs[-1].append(size)
        else:
            runs.append([size])
    return runs


def single_token_run(run: list[int], cache_dtype) -> bool:
    """Whether the reference checks `run` token by token in one forward (`TorchBackend.single_steps`):
    its chunks are single tokens over a cache that rounds what it keeps, so one chunk of the
    reference would attend its earlier tokens' K/V unrounded where the package's later calls
    read them rounded."""
    return np.dtype(cache_dtype) != np.float32 and set(run) == {1}


def run_checked(chunks: ChunkSchedule, intended, ids: np.ndarray, schedule: list[int],
                cache_tolerance: Tolerance) -> dict:
    """`ids` through the package in chunks of `schedule`, checked by the reference `intended`
    (a TorchBackend) in runs (`reference_runs`), each from the package's own cache before it:
    logits of both and the written-cache check.

    With a float32 cache, a run of several chunks is one chunk of the reference: where the
    package's later chunk reads the K/V its earlier one wrote, the reference computes them
    itself. Both are the same float32 function of the same tokens and cache in another
    summation order, which the bound is for (`exact_tolerances`: the one-shot pattern holds the
    package's whole chain of `context` positions to it, and a run is a shorter chain), and each
    chunk's logits are still compared with the reference's row by row. The caches are compared
    where the run ends: every slot its chunks wrote is there (slot = position, none written
    twice), so each written entry is checked once, as before. A single-token pattern then costs
    the reference a forward of 64 tokens per 64 steps instead of one per step. Over an fp16
    cache a run of chunks is not one reference chunk: the package's later chunk reads the
    earlier one's K/V rounded to fp16, which one reference chunk would attend unrounded, a
    difference of fp16's unit roundoff rather than of summation order. There consecutive
    single-token chunks are one run checked token by token in one forward
    (`TorchBackend.single_steps`): each token attends to the package's cache before it and to
    its own K/V, as its call did, and the cache the run leaves is compared with the one before
    it with each token's K/V written; longer chunks are a run each. The reference's other runs
    depend on the package's caches only, so they go in batches of branches; a batched run is
    again the same arithmetic in another summation order."""
    snapshot, outside, start, pending, held = chunks.empty(), 0, 0, [], 0
    # Both sides' logits are written, as each chunk (or batch) is made, into their rows of one
    # array per side in a scratch file: a long case's are 1 GB a side on a 262k vocabulary,
    # neither side's stays memory of the process while the other computes
    # (pipeline.ground.scratch), and no copy joins them afterwards.
    scratch = ScratchFile()
    sides = {}

    def write(side: str, at: int, logits: np.ndarray) -> None:
        if side not in sides:
            sides[side] = scratch.empty((len(ids), *logits.shape[1:]), logits.dtype)
        sides[side][at:at + len(logits)] = logits

    def want_rows() -> np.ndarray:
        if "want" not in sides:
            sides["want"] = scratch.empty((len(ids), intended.args.vocab_size), np.float32)
        return sides["want"]

    def written_outside(after, ref) -> int:
        return sum(cache_outside(new, want, cache_tolerance) for new, want in zip(after, ref[:2]))

    def check() -> int:
        # Runs of one length per batch: unpadded, so the reference writes exactly the slots
        # the run covers and the whole written cache is compared. Runs that follow each other
        # have their logits written by the reference's head straight into their rows.
        want_rows()
        refs = [None] * len(pending)
        for size in {len(part) for _, part, _, _ in pending}:
            alike = [i for i, (_, part, _, _) in enumerate(pending) if len(part) == size]
            first, last = pending[alike[0]][3], pending[alike[-1]][3] + size
            rows = sides["want"][first:last] if last - first == size * len(alike) else None
            for i, ref in zip(alike, intended.advance_arrays([pending[i][:2] for i in alike], logits_out=rows)):
                refs[i] = ref
            if rows is None:
                for i in alike:
                    write("want", pending[i][3], refs[i][0])
        return sum(written_outside(after, ref) for (_, ref), (_, _, after, _) in zip(refs, pending))

    for run in reference_runs(schedule, intended.cache_dtype):
        before, run_start = chunks.cache_arrays(snapshot), start
        # A run of single tokens is decode steps, whose logits the package may make all at once
        # after the last (`run_tokens`); the caches are checked where the run ends either way.
        decode = set(run) == {1}
        for size in [len(run)] if decode else run:
            logits, snapshot = (chunks.run_tokens if decode else chunks.run)(snapshot, ids[start:start + size])
            write("got", start, logits)
            del logits  # the scratch rows are the ones kept; this copy would outlive the reference's batch
            start += size
        if single_token_run(run, intended.cache_dtype):
            after = chunks.cache_arrays(snapshot)
            _, ref = intended.single_steps(before, after, ids[run_start:start], logits_out=want_rows()[run_start:start])
            outside += written_outside(after[:2], ref)
            continue
        pending.append((before, ids[run_start:start], chunks.cache_arrays(snapshot)[:2], run_start))
        held += 4 * (before[0].size + before[1].size)  # as the reference holds them: float32
        if held >= REFERENCE_BATCH_BYTES:
            outside += check()
            pending, held = [], 0
    if pending:
        outside += check()
    return {"got": sides["got"], "want": sides["want"], "cache_outside": outside}


def exactness_chunks(chunks: ChunkSchedule, intended, fixtures: ReferenceFixtures, patterns, samples: dict,
                     check: str, tolerances: tuple[Tolerance, Tolerance],
                     reduce_run: Callable[[dict, dict, str], dict] | None = None) -> tuple[list[dict], dict]:
    """Every case on every pattern, held to `tolerances` (logits, caches); also returns the runs
    for the pattern and prefix invariants. The one_shot pattern feeds the whole case (padding
    included: the prefix invariants read it); logits are compared over the valid prefix,
    caches everywhere. `reduce_run(one_shot_run, run, case)`, where given, replaces each other
    pattern's run as soon as it is checked, so no two patterns' logits are held at once (a
    262k vocabulary's over 1024 positions are 1 GB a side)."""
    tolerance, cache_tolerance = tolerances
    window = sliding_window(intended.args)
    records, runs = [], {}
    for case in fixtures.cases.values():
        n = case.valid_prefix
        for pattern, schedule in chunk_patterns(n, window).items():
            if pattern not in patterns:
                continue
            ids = case.input_ids if pattern == "one_shot" else case.input_ids[:n]
            run = run_checked(chunks, intended, ids, [len(ids)] if pattern == "one_shot" else schedule,
                              cache_tolerance.for_case(case.name))
            record = compare(run["got"][:n], run["want"][:n], tolerance.for_case(case.name))
            record.update(cache_outside=run["cache_outside"], passed=record["passed"] and run["cache_outside"] == 0)
            records.append({"check": check, "case": case.name, "pattern": pattern, **record})
            samples.setdefault(check, []).append(delta_histogram(run["got"][:n], run["want"][:n]))
            if pattern != "one_shot" and reduce_run is not None:
                run = reduce_run(runs[case.name, "one_shot"], run, case.name)
            runs[case.name, pattern] = run
    return records, runs
