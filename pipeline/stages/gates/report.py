"""A gate's report: its summary, the page and plot people read, and its verifier.

The report (`alignment.json`, format `cmfdeploy.alignment/1`) is written whatever the
outcome; `require_passed` is how later stages refuse a package whose gate did not pass.
"""

from pathlib import Path

import numpy as np

from pipeline.ground.errors import CmfdeployError
from pipeline.stages.gates.invariants import invariant_rows

FORMAT = "cmfdeploy.alignment/1"
REPORT_NAME = "alignment.json"


class GateFailed(CmfdeployError):
    """The package failed a part of its gate (the report is on disk), or the gate cannot run on
    the inputs given."""


def summarize(records: list[dict]) -> dict:
    compared = [r for r in records if "max_abs" in r]
    if not compared:  # none at all where the gate did not measure exactness (`gate_backend`)
        return {"comparisons": len(records), "passed": all(r["passed"] for r in records) if records else None}
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


def failure(report: dict) -> str:
    """What failed, in one line (the CLI's message for a failed gate)."""
    s, parts = report["summary"], []
    if s["exact"] is False:
        failing = [r for r in report["records"] if not r["passed"]]
        parts.append(f"not exact ({len(failing)} comparisons outside FP32's bound, first "
                     f"{failing[0]['case']}/{failing[0]['pattern']}, max |Δ| {failing[0].get('max_abs')})")
    if not s["within_budget"]:
        parts.append(f"over the budget {report['quality']['budget']['spec']} on {report['quality']['over_budget']}")
    if s["invariants_passed"] is False:
        parts.append("invariants failed: " + ", ".join(i["name"] for i in report["invariants"] if i["passed"] is False))
    return "gate failed: " + "; ".join(parts)


# ---------------------------------------------------------------- the human forms

def samples_plot(path: Path, samples: dict, bound: float) -> Path:
    from pipeline.stages.report import histogram_plot

    return histogram_plot(path, samples, title="log10 |Δ logit| against the intended-numerics reference",
                          xlabel="log10 |Δ|  (exact matches drawn at -12)", marker=float(np.log10(bound)))


def _bound_phrase(tolerance: dict, entry: str, unit: str) -> str:
    """"0.002 on every logit", or, for a bound set case by case, its range over the cases' units."""
    per = tolerance.get("rows") or tolerance.get("cases")
    if not per:
        return f"{tolerance['atol']:.3g} on every {entry}"
    values = [v for rows in per.values() for v in (rows if isinstance(rows, list) else [rows])]
    return f"{min(values):.3g}..{max(values):.3g} on every {entry}, set {unit} by {unit}"


def _verdict(ok: bool | None, bad: str = "FAILED") -> str:
    return "passed" if ok else f'<span style="color:red">**{bad}**</span>' if ok is False else "not run"


def markdown(report: dict) -> str:
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
        f"Bound: |Δ| <= {_bound_phrase(report['tolerance'], 'logit', 'position')} and "
        f"{_bound_phrase(report['cache_tolerance'], 'cache entry', 'case')} ({report['tolerance']['why']}); "
        f"patterns {', '.join(report['exactness']['patterns'])}." if "not_measured" not in report["exactness"] else
        f"Parts 1 and 3 not measured: {report['exactness']['not_measured']}.",
        "",
        md_table(["check", "case", "pattern", "max |Δ|", "max |Δ| / bound", "p99 |Δ|", "outside", "cache outside",
                  "top-1", "KL", "passed"],
                 [[r["check"], r["case"], r["pattern"], r.get("max_abs"), r.get("max_of_bound"), r.get("p99_abs"),
                   r.get("outside"),
                   r.get("cache_outside", ""), r.get("top1_agreement"), r.get("kl_mean"), r["passed"]]
                  for r in report["records"]]) if report["records"] else "",
        "## 2. Quality against FP32",
        "",
        f"{q['tokens']} held-out tokens of quality text, {q['items']} scoring items; measured on `{q['measured_on']}`"
        + (f", by the gate at `{q['reused_from']['path']}`: the same intended numerics, text, items and budget "
           "(`quality.identity`), so the same record." if "reused_from" in q else "."),
        "",
        md_table(["figure", "value", "budget", "within"],
                 [["perplexity change", f"{q['ppl_change']:+.2%} ({q['perplexity']['fp32']:.4g} -> "
                   f"{q['perplexity']['package']:.4g})" if q["ppl_change"] is not None else "no finite row to measure",
                   f"<= +{budget['ppl']:.2%}", "ppl_change" not in q["over_budget"]],
                  ["pooled top-1 agreement", q["top1_agreement"], f">= {budget['top1']}",
                   "top1_agreement" not in q["over_budget"]],
                  ["mean KL(FP32 ‖ package)", q["kl_mean"], budget["kl"] if budget["kl"] is not None else "-",
                   "kl_mean" not in q["over_budget"]],
                  ["items whose top-1 changed",
                   q["items_top1_changed"] if q["items_top1_changed"] is not None else
                   "not measured: " + q["items_not_measured"],
                   budget["items"] if budget["items"] is not None else "-",
                   "items_top1_changed" not in q["over_budget"]],
                  ["non-finite logits", q.get("nonfinite_logits", 0), "0, always", q.get("nonfinite_logits", 0) == 0]]),
        "## 3. Invariants",
        "",
        md_table(["invariant", "max |Δ|", "passed"], invariant_rows(report["invariants"])) if report["invariants"] else
        "Not measured (part 1 says why).\n",
        "![error distribution](alignment.png)",
        "",
        "## Cost",
        "",
        "Wall seconds per step: " + ", ".join(f"{step.replace('_', ' ')} {seconds:.1f}"
                                              for step, seconds in report["seconds"].items()) + ".",
        "",
        *compute_units_section(report["compute_units"]),
    ]
    return "\n".join(lines)


def compute_units_section(record: dict) -> list[str]:
    """The static check against the Neural Engine's limits (`coreml.ane`): what the package can claim."""
    from coreml.ane import ane_markdown

    return ["## Compute units", "",
            f"Intended: **{record['intended']}** (the package's manifest); can claim: **{', '.join(record['claimable'])}** "
            "(a static check of the saved program against the Neural Engine's published limits; not a gate part).", "",
            *ane_markdown(record["ane"]), ""]


# ---------------------------------------------------------------- the verifier

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
