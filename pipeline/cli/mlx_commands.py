"""CLI: `cmfdeploy mlx generate MODEL.cmf --prompt ...` and `cmfdeploy mlx score MODEL.cmf ITEMS.jsonl -o OUT`."""

import sys

from pipeline.ground.generation import add_generation_arguments


def register(subparsers) -> None:
    mlx = subparsers.add_parser("mlx", help="run a CMF model on the MLX runtime (weights stay quantized)")
    commands = mlx.add_subparsers(dest="mlx_command", required=True)

    g = commands.add_parser("generate", help="stream a completion, then prefill and decode tokens/s")
    g.add_argument("model", help="CMF file")
    add_generation_arguments(g)
    g.add_argument("--task", help="task mask to apply (name or id)")
    g.add_argument("--skill", help="skill id whose tensors replace the base's")
    g.set_defaults(func=_generate)

    s = commands.add_parser("score", help="rank the candidates of a scoring set on the MLX runtime")
    s.add_argument("model", help="CMF file")
    s.add_argument("items", help="JSON lines {id, context, candidates[], gold?}")
    s.add_argument("-o", "--output", required=True, help="run folder to create")
    s.add_argument("--force", action="store_true", help="replace an existing output")
    s.set_defaults(func=_score)


def _generate(args) -> int:
    from mlx_runtime.backend import load
    from mlx_runtime.generate import generate
    from pipeline.ground.generation import GenerateError, Stats, prompt_ids, sampling_of, stream_text
    from pipeline.ground.tokenizer import tokenizer_from_artifact

    if args.max_tokens < 1:
        raise GenerateError(f"--max-tokens {args.max_tokens}: must be at least 1")
    tokenizer = tokenizer_from_artifact(args.model)
    model = load(args.model, task=args.task, skill=args.skill)
    print(model.report.format(), file=sys.stderr)
    stats = Stats()
    stream_text(generate(model, prompt_ids(tokenizer, args), max_tokens=args.max_tokens, sampling=sampling_of(args),
                         eos_ids=tokenizer.eos_ids, stats=stats), tokenizer, sys.stdout)
    print(stats.line(), file=sys.stderr)
    return 0


def _score(args) -> int:
    from pipeline.stages.scoring import score

    path, summary = score(args.model, args.items, args.output, backend="mlx", force=args.force)
    print(f"{path}: {summary['items']} items, top-1 accuracy {summary['top1_accuracy']}, MRR {summary['mrr']}")
    return 0
