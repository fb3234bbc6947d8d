"""CLI: `cmfdeploy align` (exit 1 when the gate fails) and `cmfdeploy reference-fixtures`."""

from pathlib import Path

from pipeline.align import RECIPES, align_package


def _align(args) -> int:
    report = align_package(args.package, args.fixtures, args.out, recipe=args.recipe,
                           backend=args.backend, force=args.force)
    summary = report["summary"]
    print(f"gate passed ({report['package']['kind']}, {report['candidate_backend']}, policy {report['policy']}): "
          f"{summary['comparisons']} comparisons, "
          f"max |Δ| {summary['max_abs']:.3g}, top-1 >= {summary['top1_agreement_min']:.3f}; "
          f"report {args.out}/alignment.md")
    return 0


def _reference_fixtures(args) -> int:
    from pipeline.reference_fixtures import make_reference_fixtures

    lines = Path(args.text).read_text(encoding="utf-8").splitlines()
    out = make_reference_fixtures(args.cmf, args.out, lines, context=args.context, force=args.force)
    print(f"wrote {out}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("align", help="gate a Core ML package against the PyTorch FP32 fixtures")
    p.add_argument("package", help="package directory (model.mlpackage + manifest.json)")
    p.add_argument("--fixtures", required=True, help="reference fixtures directory (index.json + logits.npz)")
    p.add_argument("-o", "--out", required=True, help="report directory to create")
    p.add_argument("--recipe", default="fp32", choices=sorted(RECIPES),
                   help="the package's recipe; with its kind it picks the tolerance policy (stateful: fp32 only)")
    p.add_argument("--backend", default="auto", help="auto, coreml-executor or coreml-macos")
    p.add_argument("--force", action="store_true", help="replace an existing report directory")
    p.set_defaults(func=_align)

    p = subparsers.add_parser("reference-fixtures", help="compute a model's PyTorch FP32 gate fixtures")
    p.add_argument("cmf", help="the CMF the packages were made from")
    p.add_argument("-o", "--out", required=True, help="fixtures directory to create")
    p.add_argument("--text", required=True, help="plain text; cases start at lines 0, 100 and 200")
    p.add_argument("--context", type=int, default=128, help="tokens of the long case (the packages' context)")
    p.add_argument("--force", action="store_true", help="replace an existing directory")
    p.set_defaults(func=_reference_fixtures)
