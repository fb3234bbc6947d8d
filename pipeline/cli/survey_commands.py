"""CLI: `cmfdeploy survey PACKAGE ...` (every recipe, gated in three parts), `cmfdeploy deploy SURVEY PACKAGE ...`
(the deployed recipe on the package an app runs, gated; exit 1 when its gate fails), `cmfdeploy release SURVEY` and
`cmfdeploy app-release RELEASE`."""

import argparse
from pathlib import Path

from pipeline.cli.align_commands import add_quality_arguments
from pipeline.cli.worker_arguments import add_worker_engine_arguments, worker_engine_of
from pipeline.stages.gates import DEFAULT_ITEMS, DEFAULT_QUALITY_TEXT


def register(subparsers) -> None:
    survey = subparsers.add_parser("survey", help="compress a gated FP32 package by every recipe; gate each in three parts")
    survey.add_argument("package", help="the FP32 package directory (chunk_kv or stateless)")
    survey.add_argument("--fp32-gate", required=True, help="the package's passed FP32 alignment folder")
    survey.add_argument("--fixtures", required=True, help="reference fixtures folder (index.json + logits.npz)")
    survey.add_argument("-o", "--out", required=True, help="survey folder to create")
    # No argparse choices: run_survey names the known recipes when one is not, and listing
    # them here would import coremltools into `--help`.
    survey.add_argument("--recipes", nargs="+", help="recipes of coreml.recipes.RECIPES (default: all)")
    survey.add_argument("--backend", default="auto", help="package backend for gates and scoring")
    survey.add_argument("--mixed-bpw", type=float,
                        help="bits-per-weight budget of the mixed recipe (default: coreml.recipes.MIXED_BPW)")
    add_quality_arguments(survey)
    survey.add_argument("--fp32-scores", metavar="RUN",
                        help="FP32's scoring run of the same scoring set and bundle (align --scores-out of the "
                             "FP32 gate): read, not scored again")
    survey.add_argument("--target", default="cpu",
                        help="cpu (FP32 package), gpu or ane (fp16 package): only a package whose program can claim "
                             "the target's compute unit deploys (coreml.targets, coreml.ane)")
    survey.add_argument("--jobs", type=int, default=1,
                        help="recipes surveyed at a time, each in its own process with an equal share of the cores")
    add_worker_engine_arguments(survey)
    survey.add_argument("--force", action="store_true", help="replace an existing output")
    survey.set_defaults(func=_survey)

    deploy = subparsers.add_parser("deploy", help="apply the survey's deployed recipe to the package an app runs "
                                                  "(the stateful one), with the surveyed codes; gate it in three parts")
    deploy.add_argument("survey", help="survey folder (from `cmfdeploy survey`)")
    deploy.add_argument("package", help="the FP32 (or fp16) package to compress, of the survey's bundle and precision")
    deploy.add_argument("--gate", required=True, help="that package's passed alignment folder")
    deploy.add_argument("--fixtures", required=True, help="reference fixtures folder (index.json + logits.npz)")
    deploy.add_argument("-o", "--out", required=True, help="deployment folder to create")
    deploy.add_argument("--quality-text", type=Path, default=DEFAULT_QUALITY_TEXT,
                        help="the text the survey read (its calibration lines make a calibration-aware recipe's codes)")
    deploy.add_argument("--items", type=Path, default=DEFAULT_ITEMS, help="scoring set (JSON lines) of the quality part")
    deploy.add_argument("--fp32-scores", metavar="RUN", help="FP32's scoring run of the same scoring set and bundle")
    deploy.add_argument("--backend", default="auto", help="package backend for the gate")
    deploy.add_argument("--force", action="store_true", help="replace an existing output")
    deploy.set_defaults(func=_deploy)

    release = subparsers.add_parser("release", help="pack the deployed recipe, FP32 packages and reports into dist/")
    release.add_argument("survey", help="survey folder (from `cmfdeploy survey`)")
    release.add_argument("-o", "--out", default="dist", help="folder the release folder <model>-<recipe>/ goes in")
    release.add_argument("--recipe", help="release this recipe instead of the survey's deployed one")
    release.add_argument("--package", nargs=2, action="append", default=[], metavar=("PACKAGE", "GATE"),
                         help="a further FP32 package and its passed alignment folder (repeatable)")
    release.add_argument("--deployment", metavar="FOLDER",
                         help="a passed `cmfdeploy deploy` folder of this survey: its package is the one the release "
                              "ships (interface, metadata.json, RELEASE.md); pass its FP32 package with --package")
    release.add_argument("--name", help="model name (default: the source CMF's file stem)")
    release.add_argument("--sign", metavar="KEY",
                         help="Ed25519 private key (PEM or 32 raw bytes): sign the release manifest")
    release.add_argument("--force", action="store_true", help="replace an existing output")
    release.set_defaults(func=_release)

    app = subparsers.add_parser("app-release", help="cut the app's files (the shipped package, tokenizer, "
                                                    "metadata.json) from a release into <release>-app/")
    app.add_argument("release", help="release folder (from `cmfdeploy release`)")
    app.add_argument("-o", "--out", help="folder <release>-app/ goes in (default: the release's own folder)")
    app.add_argument("--sign", metavar="KEY", help="Ed25519 private key (PEM or 32 raw bytes): sign its manifest")
    app.add_argument("--force", action="store_true", help="replace an existing output")
    app.set_defaults(func=_app_release)


def _survey(args: argparse.Namespace) -> int:
    from pipeline.stages.survey import run_survey

    survey = run_survey(args.package, args.fp32_gate, args.fixtures, args.items, args.out,
                        **({"recipes": args.recipes} if args.recipes else {}),
                        force=args.force, backend=args.backend, budget=args.budget, quality_text=args.quality_text,
                        mixed_bpw=args.mixed_bpw, all_figures=args.all_figures, jobs=args.jobs,
                        fp32_scores=args.fp32_scores, target=args.target,
                        engine=worker_engine_of(args))
    for record in survey["recipes"]:
        if record["status"] == "measured":
            gate, quality = record["gate"], record["gate"]["quality"]
            verdict = ("passed" if gate["passed"] else "NOT EXACT (a bug)" if gate["exact"] is False else
                       "over budget" if not gate["within_budget"] else "invariants FAILED")
            units = "+".join(gate.get("compute_units", []))
            print(f"{record['name']}: {record['package']['bits_per_weight']:.2f} bits/weight, "
                  f"{record['package']['size_bytes']} bytes ({record['package']['bytes_vs_fp32']:.3f} x FP32), "
                  f"ppl {quality['ppl_change']:+.2%}, top-1 {quality['top1_agreement']:.3f}, runs on {units}: {verdict}")
        else:
            print(f"{record['name']}: not measured: {record['precondition']['reason']}")
    print(f"deployed: {survey['deployed']['recipe']}; report {args.out}/survey.md")
    return 0


def _release(args: argparse.Namespace) -> int:
    from pipeline.stages.release import make_release

    manifest = make_release(args.survey, args.out, recipe=args.recipe, packages=[tuple(p) for p in args.package],
                            name=args.name, force=args.force, sign_key=args.sign, deployment=args.deployment)
    print(f"{manifest.path}: {len(manifest['files'])} files, {manifest['inventory']['total_bytes']} bytes")
    return 0


def _app_release(args: argparse.Namespace) -> int:
    from pipeline.stages.app_release import make_app_release

    manifest = make_app_release(args.release, args.out, force=args.force, sign_key=args.sign)
    print(f"{manifest.path}: {len(manifest['files'])} files, {manifest['inventory']['total_bytes']} bytes "
          f"({manifest['shipped']['name']}, the package an app loads)")
    return 0


def _deploy(args: argparse.Namespace) -> int:
    from pipeline.stages.deploy import deploy_package
    from pipeline.stages.gates import GateFailed

    deployment = deploy_package(args.survey, args.package, args.gate, args.out, fixtures_dir=args.fixtures,
                                quality_text=args.quality_text, items=args.items, backend=args.backend,
                                fp32_scores=args.fp32_scores, force=args.force)
    if not deployment.passed:
        raise GateFailed(deployment.gate.failure())  # `main` prints it as one line and exits 1
    record = deployment.manifest
    print(f"deployed {record['recipe']} on the {record['package']['kind']} package: {record['package']['size_bytes']} "
          f"bytes, the survey's codes on all {record['codes']['weights']} weights, gate passed; {args.out}")
    return 0
