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

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from pipeline.stages.gates.exactness import Tolerance, bitwise, compare
from pipeline.stages.gates.fixtures import ReferenceFixtures

BRANCH_PREFIX = 7
BRANCH_A = (9,)
BRANCH_B = (47, 81, 102)
DIRTY_FILL = 999.0
INVARIANT_PREFIX = 16


@dataclass(frozen=True)
class GateRun:
    """What the invariants read of a gate run: the candidate, its one-shot logits per case,
    its chunk-pattern runs (`exactness_chunks`; None where it has no `chunks`), FP32's bound
    and whether the intended cache is fp16."""
    candidate: object
    fixtures: ReferenceFixtures
    one_shot: dict[str, np.ndarray]
    runs: dict | None
    tolerance: Tolerance
    fp16_cache: bool


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
class PrefixUnchanged(Invariant):
    """Padding and future tokens must not change the first 16 positions' logits: two float32
    evaluations of one model, within FP32's summation-order bound."""

    name = "prefix"
    cases = ("right_pad", "changed_future")

    def run(self, gate: GateRun) -> list[dict]:
        short = gate.one_shot["short"][:INVARIANT_PREFIX]
        return [{"name": f"{case}_prefix_equals_short", **compare(gate.one_shot[case][:INVARIANT_PREFIX], short,
                                                                   gate.tolerance)} for case in self.cases]

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

    def run(self, gate: GateRun) -> list[dict]:
        out, bound = [], gate.tolerance
        for (case, pattern), run in gate.runs.items():
            if pattern == "one_shot":
                continue
            n = len(run["got"])  # the one-shot run also fed the case's padding
            one_shot = {key: gate.runs[case, "one_shot"][key][:n] for key in ("got", "want")}
            if gate.fp16_cache:
                want = one_shot["got"] + (run["want"] - one_shot["want"])
                tol = Tolerance(2 * bound.atol, 2 * bound.rtol, None, None,
                                "fp16 cache: the reference's own pattern difference, each run within FP32's bound")
            else:
                want, tol = one_shot["got"], bound
            out.append({"name": f"{case}_{pattern}_equals_one_shot", **compare(run["got"], want, tol)})
        return out

    def owns(self, record: dict) -> bool:
        return record["name"].endswith("_equals_one_shot")


@register_invariant
class Branching(Invariant):
    """Rollback and branching: A, B, A from one snapshot; then, where the backend lets its
    snapshots be read and edited (`chunks`), the snapshot unchanged and a dirty tail."""

    name = "branching"
    records = ("branch_A_B_A_bitwise", "snapshot_unchanged", "dirty_tail_bitwise")

    def run(self, gate: GateRun) -> list[dict]:
        return branching_invariants(gate.candidate, gate.fixtures.cases["long"].input_ids[:BRANCH_PREFIX])

    def owns(self, record: dict) -> bool:
        return record["name"] in self.records


def branching_invariants(candidate, prefix_ids: np.ndarray) -> list[dict]:
    """`Branching`'s records for `candidate` (any Backend) after `prefix_ids`."""
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
    dirty = chunks.with_cache_arrays(snapshot, *(_dirty_tail(c, position) for c in (keys, values)))
    a_dirty = candidate.extend(dirty, np.array(BRANCH_A))
    b_clean = candidate.extend(snapshot, np.array(BRANCH_B))
    b_dirty = candidate.extend(dirty, np.array(BRANCH_B))
    return out + [
        {"name": "snapshot_unchanged", "passed": unchanged},
        {"name": "dirty_tail_bitwise", "passed": bitwise(a1, a_dirty) and bitwise(b_clean, b_dirty),
         "max_abs": float(max(np.abs(a1 - a_dirty).max(), np.abs(b_clean - b_dirty).max()))},
    ]


def _dirty_tail(cache: np.ndarray, position: int) -> np.ndarray:
    dirty = np.array(cache, copy=True)
    dirty[..., position:, :] = DIRTY_FILL
    return dirty
