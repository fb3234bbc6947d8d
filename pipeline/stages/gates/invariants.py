"""Part 3, invariants: properties a package must have whatever its numerics, each checked
against the package itself. One registered unit per invariant, with its run and its rows on
the report's page:

    @register_invariant
    class PrefixUnchanged(Invariant):
        name = "prefix"
        def run(self, gate: GateRun) -> list[dict]: ...

The gate runs every registered invariant its candidate offers what for (`offered`), in the
order registered, and the page renders each one's records; adding an invariant is adding
one class here.
"""

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pipeline.stages.gates.exactness import Tolerance, bitwise, compare, sliding_window
from pipeline.stages.gates.fixtures import ReferenceFixtures

# The branching checks' prefix: 7 tokens, or past a sliding window shorter than the long case
# (`branch_prefix`), so the branches run where the window drops keys.
BRANCH_PREFIX = 7
BRANCH_A = (9,)
BRANCH_B = (47, 81, 102)
DIRTY_FILL = 999.0
INVARIANT_PREFIX = 16


@dataclass(frozen=True)
class GateRun:
    """What the invariants read of a gate run: the candidate, its one-shot logits per case,
    its chunk-pattern runs (`exactness_chunks`, each pattern but one_shot reduced by
    `PatternsEqualOneShot.reduce`; None where it has no `chunks`), FP32's bound, whether the
    intended cache is fp16, the model's arch (`ModelArgs`: its sliding window), and the weights
    the intended reference computes with."""
    candidate: object
    fixtures: ReferenceFixtures
    one_shot: dict[str, np.ndarray]
    runs: dict | None
    tolerance: Tolerance
    fp16_cache: bool
    args: object
    weights: Mapping[str, object]  # the intended reference's tensors (`named_weights`)


class Invariant(ABC):
    """One invariant: `run` gives its records ({"name", "passed", ...}; "passed" None with a
    "not_offered" reason where the candidate cannot be asked), `owns` tells its records
    apart on the page, `row` renders one."""

    name: str

    def offered(self, gate: GateRun) -> bool:
        return True

    @abstractmethod
    def run(self, gate: GateRun) -> list[dict]:
        """This invariant's records for the gate's candidate."""

    @abstractmethod
    def owns(self, record: dict) -> bool:
        """Whether `record` is one of this invariant's."""

    def row(self, record: dict) -> list:
        return [record["name"], record.get("max_abs"), record["passed"] if record["passed"] is not None
                else record["not_offered"]]


INVARIANTS: list[Invariant] = []


def register_invariant(cls: type[Invariant]) -> type[Invariant]:
    """Class decorator: one instance of `cls` joins INVARIANTS, run and rendered in this order."""
    if any(check.name == cls.name for check in INVARIANTS):
        raise ValueError(f"invariant {cls.name!r} is registered twice")
    INVARIANTS.append(cls())
    return cls


def run_invariants(gate: GateRun) -> list[dict]:
    """The records of every registered invariant the candidate offers."""
    return [record for check in INVARIANTS if check.offered(gate) for record in check.run(gate)]


def invariant_rows(records: list[dict]) -> list[list]:
    """The page's rows of a report's invariant records, each rendered by its own invariant."""
    return [check.row(record) for check in INVARIANTS for record in records if check.owns(record)]


@register_invariant
class WeightsAsIntended(Invariant):
    """Every bundle tensor a package stores holds the intended reference's values bit for bit,
    in every function and piece, and every matrix of the reference is stored. A plain constant
    is compared with the reference's tensor rounded once to the package's float dtype (a
    correctly rounded cast, as `coreml.kinds.export.weight_names` records it), the same on every
    CPU: no bound. A recipe's code is decoded for the reference from the package itself
    (`references`), by coremltools; it is held to the sha256 of the decoding the recipe computed
    itself as it wrote the code (`coreml.recipes.emit.decoded_sha256`), so a code written or read
    otherwise than the recipe made it shows here.

    Why the logits cannot do this alone: a weight one fp16 step off moves an fp16 package's
    logits less than the fp16 reference's own rounding noise (tests/test_gate_faults.py:
    down_proj x (1 + 1e-3)), and a compressed package's reference decodes the package's own
    codes, so it moves with them. Vectors may be held folded with a constant of their op (Gemma's
    RMSNorm gain as 1 + w), so only matrices must be found."""

    name = "weights_as_intended"

    def offered(self, gate: GateRun) -> bool:
        return hasattr(gate.candidate, "package")

    def run(self, gate: GateRun) -> list[dict]:
        from coreml.crosscheck import stored_weights

        package = gate.candidate.package
        stored = stored_weights(package.path, package.manifest)
        differing, held = [], set()

        def where(entry) -> dict:
            return {"tensor": entry.tensor, "rows": entry.rows, "program": entry.program}

        def wanted(entry, dtype) -> np.ndarray | None:
            """The reference's tensor (or rows) `entry` holds, as its own array (an fp16 reference
            holds fp16 halves) cast only where `dtype` differs; None, recorded, where it has none."""
            want = gate.weights.get(entry.tensor)
            if want is None:
                differing.append({**where(entry), "why": "the intended reference has no such tensor"})
                return None
            return np.ascontiguousarray((want if entry.rows is None else want[slice(*entry.rows)]).numpy(), dtype)

        for entry in stored.plain:
            want = wanted(entry, entry.const.dtype.numpy)
            if want is None:
                continue
            digest = entry.const.digest()
            if digest.shape == want.shape and digest.sha256 == hashlib.sha256(want).hexdigest():
                held.add(entry.tensor)
            else:
                differing.append({**where(entry), "function": entry.const.function, "const": entry.const.name,
                                  **_differences(entry.const.values(), want)})
        for entry in stored.coded:
            want = wanted(entry, entry.dtype)
            if want is None:
                continue
            # No record of the recipe's to hold it to, or its decoding's.
            if entry.decoded_sha256 is None or entry.decoded_sha256 == hashlib.sha256(want).hexdigest():
                held.add(entry.tensor)
            else:
                differing.append({**where(entry), "why": "the package decodes it otherwise than its recipe's "
                                                         "record (selection.weights[].decoded_sha256)"})
        not_held = sorted(name for name, tensor in gate.weights.items() if tensor.dim() >= 2 and name not in held)
        measured = [d["max_abs"] for d in differing if "max_abs" in d]  # a code's digest gives no |Δ|
        return [{"name": self.name, "passed": not differing and not not_held,
                 "max_abs": max(measured) if measured else None if differing else 0.0,
                 "plain": len(stored.plain), "coded": len(stored.coded),
                 "coded_unrecorded": sorted({c.tensor for c in stored.coded if c.decoded_sha256 is None}),
                 "differing": differing, "not_held": not_held}]

    def owns(self, record: dict) -> bool:
        return record["name"] == self.name

    def row(self, record: dict) -> list:
        held = f"{record['plain']} constants, {record['coded']} codes" + (
            f" ({len(record['coded_unrecorded'])} tensors' codes with no recipe record to hold them to)"
            if record["coded_unrecorded"] else "")
        wrong = [f"{d['tensor']} differs (" + (f"{d['const']}: {d['elements']} elements)" if "elements" in d
                                               else f"{d['why']})") for d in record["differing"][:3]]
        wrong += [f"{name} not held" for name in record["not_held"][:3]]
        return [f"{record['name']}: {held}" + ("; " + "; ".join(wrong) if wrong else ""), record["max_abs"],
                record["passed"]]


def _differences(got: np.ndarray, want: np.ndarray) -> dict:
    if got.shape != want.shape:
        return {"why": f"shape {list(got.shape)}, not {list(want.shape)}"}
    delta = np.abs(got.astype(np.float32) - want.astype(np.float32))
    return {"elements": int(np.count_nonzero(delta)), "max_abs": float(delta.max())}


@register_invariant
class PrefixUnchanged(Invariant):
    """Padding and future tokens must not change the first 16 positions' logits: two float32
    evaluations of one model, within FP32's summation-order bound."""

    name = "prefix"
    cases = ("right_pad", "changed_future")

    def run(self, gate: GateRun) -> list[dict]:
        short = gate.one_shot["short"][:INVARIANT_PREFIX]
        return [{"name": f"{case}_prefix_equals_short", **compare(gate.one_shot[case][:INVARIANT_PREFIX], short,
                                                                   gate.tolerance.for_case(case, "short"))}
                for case in self.cases]

    def owns(self, record: dict) -> bool:
        return record["name"] in {f"{case}_prefix_equals_short" for case in self.cases}


@register_invariant
class PatternsEqualOneShot(Invariant):
    """Every chunk pattern against the one-shot run of the same package.

    With a float32 cache the patterns differ by summation order only: FP32's bound. An fp16
    cache rounds what later chunks read, so patterns differ by construction; there the
    package's pattern-minus-one-shot difference must be the reference's (run along the
    package's own caches), each side within the bound of its reference: twice the bound.
    """

    name = "patterns"

    def offered(self, gate: GateRun) -> bool:
        return gate.runs is not None

    @staticmethod
    def reduce(one_shot_run: dict, run: dict, tolerance: Tolerance, fp16_cache: bool) -> dict:
        """`run`'s record against its case's one-shot run, made as soon as the pattern has run
        (`exactness_chunks`' reduce_run): the run keeps the record, not its logits."""
        n = len(run["got"])  # the one-shot run also fed the case's padding
        one_shot = {key: one_shot_run[key][:n] for key in ("got", "want")}
        if fp16_cache:
            want = one_shot["got"] + (run["want"] - one_shot["want"])
            tol = Tolerance(2 * tolerance.atol, 2 * tolerance.rtol, None, None,
                            "fp16 cache: the reference's own pattern difference, each run within FP32's bound")
        else:
            want, tol = one_shot["got"], tolerance
        return {"equals_one_shot": compare(run["got"], want, tol)}

    def run(self, gate: GateRun) -> list[dict]:
        return [{"name": f"{case}_{pattern}_equals_one_shot", **run["equals_one_shot"]}
                for (case, pattern), run in gate.runs.items() if pattern != "one_shot"]

    def owns(self, record: dict) -> bool:
        return record["name"].endswith("_equals_one_shot")


@register_invariant
class Branching(Invariant):
    """Rollback and branching: A, B, A from one snapshot; then, where the backend lets its
    snapshots be read and edited (`chunks`), the snapshot unchanged and a dirty tail."""

    name = "branching"
    records = ("branch_A_B_A_bitwise", "snapshot_unchanged", "dirty_tail_bitwise")

    def run(self, gate: GateRun) -> list[dict]:
        long = gate.fixtures.cases["long"].input_ids
        return branching_invariants(gate.candidate, long[:branch_prefix(gate.args, len(long))], gate.args)

    def owns(self, record: dict) -> bool:
        return record["name"] in self.records


def branch_prefix(args, tokens: int) -> int:
    """The branching checks' prefix length within `tokens`: BRANCH_PREFIX, or past a sliding
    window shorter than that, so every branch token's window has dropped keys."""
    window = sliding_window(args)
    longest = max(len(BRANCH_A), len(BRANCH_B))
    if window is not None and window + BRANCH_PREFIX + longest <= tokens:
        return window + BRANCH_PREFIX
    return BRANCH_PREFIX


def branching_invariants(candidate, prefix_ids: np.ndarray, args=None) -> list[dict]:
    """`Branching`'s records for `candidate` (any Backend) after `prefix_ids`. The dirty
    snapshot fills every slot at and after the position and, where `args` has a sliding
    window, the SlidingAttention layers' slots every branch token's window has left."""
    _, snapshot = candidate.prefill(prefix_ids)
    chunks = getattr(candidate, "chunks", None)
    before = chunks and [np.array(a, copy=True) for a in chunks.cache_arrays(snapshot)[:2]]
    a1 = candidate.extend(snapshot, np.array(BRANCH_A))
    candidate.extend(snapshot, np.array(BRANCH_B))
    a2 = candidate.extend(snapshot, np.array(BRANCH_A))
    out = [{"name": "branch_A_B_A_bitwise", "passed": bitwise(a1, a2), "max_abs": float(np.abs(a1 - a2).max())}]
    if chunks is None:
        return out + [{"name": name, "passed": None, "not_offered": f"backend {candidate.name} does not expose its "
                       "snapshots' caches (Backend.chunks)"} for name in ("snapshot_unchanged", "dirty_tail_bitwise")]
    keys, values, position = chunks.cache_arrays(snapshot)
    unchanged = bitwise(keys, before[0]) and bitwise(values, before[1])
    dirty = chunks.with_cache_arrays(snapshot, *(_dirty_tail(c, position, args) for c in (keys, values)))
    a_dirty = candidate.extend(dirty, np.array(BRANCH_A))
    b_clean = candidate.extend(snapshot, np.array(BRANCH_B))
    b_dirty = candidate.extend(dirty, np.array(BRANCH_B))
    return out + [
        {"name": "snapshot_unchanged", "passed": unchanged},
        {"name": "dirty_tail_bitwise", "passed": bitwise(a1, a_dirty) and bitwise(b_clean, b_dirty),
         "max_abs": float(max(np.abs(a1 - a_dirty).max(), np.abs(b_clean - b_dirty).max()))},
    ]


def _dirty_tail(cache: np.ndarray, position: int, args=None) -> np.ndarray:
    """`cache` (layers first) with DIRTY_FILL in every slot no branch token from `position` on
    may read: those at and after it and, in a SlidingAttention layer, those before the first
    branch token's window (query p sees key j iff p - window < j)."""
    dirty = np.array(cache, copy=True)
    dirty[..., position:, :] = DIRTY_FILL
    window = sliding_window(args)
    if window is not None and position - window + 1 > 0:
        for layer, layer_type in enumerate(args.layer_types):
            if layer_type == "SlidingAttention":
                dirty[layer, ..., :position - window + 1, :] = DIRTY_FILL
    return dirty
