"""CLI: `cmfdeploy score ARTIFACT ITEMS.jsonl [-o OUTDIR] [--backend B] [--jobs N]`."""

from pipeline.cli.worker_arguments import add_worker_engine_arguments, worker_engine_of


def register(subparsers) -> None:
    p = subparsers.add_parser("score", help="rank the candidates of a scoring set with one backend")
    p.add_argument("artifact", help="CMF file, bundle, Core ML package or release folder")
    p.add_argument("items", help="JSON lines {id, context, candidates[], gold?}")
    p.add_argument("-o", "--output", help="run folder to create (default: print the summary only)")
    p.add_argument("--backend", default="auto", help="torch, coreml, mlx, ... (default: by artifact kind)")
    p.add_argument("--tokenizer", help="CMF or folder with tokenizer.json (default: the artifact)")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes scoring batches of items side by side, each with an equal share of the cores")
    add_worker_engine_arguments(p)
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.set_defaults(func=_score)


def _score(args) -> int:
    from pipeline.stages.scoring import score

    path, summary = score(args.artifact, args.items, args.output, backend=args.backend,
                          tokenizer_from=args.tokenizer, force=args.force, jobs=args.jobs, engine=worker_engine_of(args))
    print(f"{path or args.artifact}: {summary['items']} items, top-1 accuracy {summary['top1_accuracy']}, MRR {summary['mrr']}")
    return 0
