"""The catch table: every seeded converter fault (`pipeline.stages.gates.faults`) in a correct
package, FP32 or fp16, gated, and what the gate said: which part failed, the largest |Δ logit| of
the exactness part against its bound, and the worst position's |Δ| against that position's own
bound (what the gate fails on). The correct package's own gate first, as the baseline of the
same run. (A package's quality part measures its intended numerics, the torch reference of its
precision, not the package: a fault never moves it.) A fault the package has nothing to seed into
(`norm_unscaled` where the norms are plain) says so. Printed, never asserted
(tests/test_gate_faults.py asserts the fixture's).

    python benchmarks/fault_bench.py PACKAGE --bundle BUNDLE --fixtures REFERENCE [--items ITEMS] [--work DIR]

PACKAGE is a chunk-KV or stateful package (`cmfdeploy coreml BUNDLE -o OUT --kinds chunk_kv`,
`--precision fp16` with its preflight), or one compressed from it (`cmfdeploy compress`), REFERENCE the model's reference fixtures
(`cmfdeploy reference-fixtures`).
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.stages.gates.faults import FAULTS, FaultNotApplicable, seeded_copy  # noqa: E402
from pipeline.stages.gates.stage import align_package  # noqa: E402


def row(name: str, where: str, report: dict, seconds: float) -> str:
    summary, tolerance = report["summary"], report["tolerance"]
    failed = [i["name"] for i in report["invariants"] if i["passed"] is False]
    failed = ", ".join(failed[:2]) + (f" and {len(failed) - 2} more" if len(failed) > 2 else "")
    parts = [part for part, ok in (("exactness", summary["exact"]), ("quality", report["quality"]["within_budget"]),
                                   (f"invariants ({failed})", summary["invariants_passed"])) if ok is False]
    delta = summary.get("max_abs")
    ratio = "" if delta is None else f"{delta / tolerance['atol']:,.1f}x"
    # What the gate decides on: each position's |Δ| against that position's own bound (the bound
    # follows the reference's noise position by position), the worst of every comparison. The
    # largest |Δ| over the largest bound understates a catch whose Δ sits at a quiet position.
    worst = max((r["max_of_bound"] for r in report["records"] if r.get("max_of_bound") is not None), default=None)
    return (f"| {name} | {where} | {'caught: ' + ', '.join(parts) if parts else 'PASSED'} | "
            f"{'' if delta is None else f'{delta:.3g}'} | {tolerance['atol']:.3g} | {ratio} | "
            f"{'' if worst is None else f'{worst:,.2f}x'} | "
            f"{100 * (report['quality']['ppl_change'] or 0):+.3f}% | {seconds:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--fixtures", type=Path, required=True)
    parser.add_argument("--items", type=Path, default=ROOT / "fixtures" / "scoring" / "cloze.jsonl")
    parser.add_argument("--faults", nargs="*", default=sorted(FAULTS))
    parser.add_argument("--work", type=Path, help="where seeded copies and gates go (default: a temporary folder)")
    parser.add_argument("--all-figures", action="store_true",
                        help="measure every part of every gate (a package over its budget is otherwise failed "
                             "by quality alone, its exactness and invariants not measured)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="fault-bench-"))
    print("| fault | where | verdict | max |Δ logit| | largest bound | max Δ / largest bound "
          "| worst position's Δ / its bound | ppl change | gate |")
    print("|---|---|---|---|---|---|---|---|---|")
    start = time.perf_counter()
    correct = align_package(args.package, args.fixtures, work / "correct", items=args.items, force=True,
                            all_figures=args.all_figures)
    print(row("none (the correct package)", "", correct.report, time.perf_counter() - start), flush=True)
    for name in args.faults:
        folder = work / name
        shutil.rmtree(folder, ignore_errors=True)
        try:
            package, where = seeded_copy(args.package, args.bundle, folder / "coreml" / args.package.name, name)
        except FaultNotApplicable as error:
            print(f"| {name} | not applicable: {error} | | | | | | |", flush=True)
            continue
        start = time.perf_counter()
        gate = align_package(package, args.fixtures, folder / "gate", items=args.items, force=True,
                             all_figures=args.all_figures)
        print(row(name, where, gate.report, time.perf_counter() - start), flush=True)
        shutil.rmtree(folder / "coreml", ignore_errors=True)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
