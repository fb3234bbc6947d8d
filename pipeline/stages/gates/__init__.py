"""Alignment gates: a package judged in three parts, all written to its report.

    result = align_package("out/chunk_kv", "fixtures/reference", "out/align/chunk_kv")
    result.passed, result.report["summary"]

1. Exactness (`exactness`): the package computes what its numerics intend, within FP32's
   summation-order bound of the torch reference of those numerics (`references`).
2. Quality (`quality`): the intended numerics stay within the user's `Budget` (`budget`) of
   FP32 on held-out text and on the scoring set.
3. Invariants (`invariants`): registered checks of the package against itself: padding and
   future tokens never leak backwards, any chunk schedule gives the one-shot answer,
   branching from a snapshot is exact and leaves it untouched, a dirty cache tail changes nothing.

`fixtures` makes and reads the frozen FP32 logits, `lineage` resolves a package's chain once,
`report` writes and verifies what a gate leaves on disk, `stage` runs it all.
"""

from pipeline.stages.gates.budget import DEFAULT_BUDGET, Budget, BudgetError, parse_budget
from pipeline.stages.gates.fixtures import ReferenceFixtures, make_reference_fixtures
from pipeline.stages.gates.lineage import upstream_of
from pipeline.stages.gates.quality import QualityInputs
from pipeline.stages.gates.references import intended_references
from pipeline.stages.gates.report import REPORT_NAME, GateFailed, require_passed, verify_alignment
from pipeline.stages.gates.stage import (DEFAULT_ITEMS, DEFAULT_QUALITY_TEXT, GateResult, align_package, default_budget,
                                         gate_backend)

__all__ = ["DEFAULT_BUDGET", "DEFAULT_ITEMS", "DEFAULT_QUALITY_TEXT", "REPORT_NAME", "Budget", "BudgetError",
           "GateFailed", "GateResult", "default_budget", "QualityInputs", "ReferenceFixtures", "align_package", "gate_backend",
           "intended_references", "make_reference_fixtures", "parse_budget", "require_passed", "upstream_of",
           "verify_alignment"]
