"""CLI: `cmfdeploy align` (exit 1 when the gate fails) and `cmfdeploy reference-fixtures`."""

from pathlib import Path

from coreml.precisions import PRECISIONS
from pipeline.stages.gates.budget import COMPRESSED_BUDGET
from pipeline.stages.gates import (
    DEFAULT_ITEMS,
    DEFAULT_QUALITY_TEXT,
    GateFailed,
    align_package,
    make_reference_fixtures,
)


def _align(args) -> int:
    gate = align_package(args.package, args.fixtures, args.out, budget=args.budget, quality_text=args.quality_text,
                         items=args.items, backend=args.backend, force=args.force, all_figures=args.all_figures,
                         scores_out=args.scores_out, fp32_scores=args.fp32_scores,
                         quality_from=args.quality_from)
    if not gate.passed:
        raise GateFailed(gate.failure())  # `main` prints it as one line and exits 1
    report = gate.report
    summary, quality = report["summary"], report["quality"]
    print(f"gate passed ({report['package']['kind']}, {report['candidate_backend']}, {report['numerics']}): "
          f"exact ({summary['comparisons']} comparisons, max |Δ| {summary['max_abs']:.3g}), "
          f"quality within {quality['budget']['spec']} (ppl {quality['ppl_change']:+.2%}, "
          f"top-1 {quality['top1_agreement']:.3f}), invariants hold; report {args.out}/alignment.md")
    return 0


def _reference_fixtures(args) -> int:
    lines = Path(args.text).read_text(encoding="utf-8").splitlines()
    out = make_reference_fixtures(args.cmf, args.out, lines, context=args.context,
                                  step_logits=args.step_logits, force=args.force)
    print(f"wrote {out}")
    return 0


def add_quality_arguments(p) -> None:
    """--budget, --quality-text, --items and --all-figures: shared by align and survey."""
    p.add_argument("--budget",
                   help="quality budget against FP32: ppl=<max increase>, top1=<min agreement>, optionally "
                        "kl=<max mean KL>, items=<max fraction of scoring items whose top-1 changed> "
                        "(default: a compressed package's " + COMPRESSED_BUDGET.replace('%', '%%') +
                        "; an uncompressed one's precision's, " + "; ".join(
                            f"{unit.name} {unit.default_budget}" for unit in PRECISIONS.values()).replace('%', '%%') + ")")
    p.add_argument("--quality-text", type=Path, default=DEFAULT_QUALITY_TEXT,
                   help="text whose held-out 'quality' lines the quality part reads and whose 'calibration' lines "
                        "calibration-aware recipes see (pipeline.ground.text_roles)")
    p.add_argument("--items", type=Path, default=DEFAULT_ITEMS, help="scoring set (JSON lines) of the quality part")
    p.add_argument("--all-figures", action="store_true",
                   help="score the scoring set even for a package already over budget on the held-out text "
                        "(by default its figure is measured only where it can still change the verdict)")


def register(subparsers) -> None:
    p = subparsers.add_parser("align", help="gate a Core ML package: exactness, quality within a budget, invariants")
    p.add_argument("package", help="package directory (model.mlpackage + manifest.json)")
    p.add_argument("--fixtures", required=True, help="reference fixtures directory (index.json + logits.npz)")
    p.add_argument("-o", "--out", required=True, help="report directory to create")
    add_quality_arguments(p)
    p.add_argument("--backend", default="auto", help="auto, coreml-executor or coreml-macos")
    p.add_argument("--scores-out", metavar="RUN",
                   help="write the quality part's scoring run here (for an FP32 package: FP32's own scores, "
                        "the baseline later gates and surveys of the same bundle read with --fp32-scores)")
    p.add_argument("--fp32-scores", metavar="RUN",
                   help="FP32's scoring run of the same scoring set and bundle: read, not scored again")
    p.add_argument("--quality-from", metavar="GATE",
                   help="a gate of a package with the same intended numerics (the fp16 stateless, chunk-KV and "
                        "stateful packages of one conversion): its quality record is taken, not measured again, "
                        "where its identity (numerics, text, items, budget, versions) is this gate's; refused "
                        "by field where not")
    p.add_argument("--force", action="store_true", help="replace an existing report directory")
    p.set_defaults(func=_align)

    p = subparsers.add_parser("reference-fixtures", help="compute a model's PyTorch FP32 gate fixtures")
    p.add_argument("cmf", help="the CMF the packages were made from")
    p.add_argument("-o", "--out", required=True, help="fixtures directory to create")
    p.add_argument("--text", required=True, help="plain text; cases start at lines 0, 100 and 200")
    p.add_argument("--context", type=int,
                   help="tokens of the long case, the packages' context (default: the model's limit, at most 2048)")
    p.add_argument("--step-logits", action="store_true",
                   help="also long_kv_step_logits: the long case fed one token at a time through the cached path "
                        "(no gate reads them; a forward per position)")
    p.add_argument("--force", action="store_true", help="replace an existing directory")
    p.set_defaults(func=_reference_fixtures)
