"""CLI: `cmfdeploy mlx generate MODEL.cmf --prompt ...` and `cmfdeploy mlx score MODEL.cmf ITEMS.jsonl -o OUT`."""

import sys

from pipeline.errors import CmfdeployError


class GenerateError(CmfdeployError):
    """A generate request that cannot be run as given."""


def register(subparsers) -> None:
    mlx = subparsers.add_parser("mlx", help="run a CMF model on the MLX runtime (weights stay quantized)")
    commands = mlx.add_subparsers(dest="mlx_command", required=True)

    g = commands.add_parser("generate", help="stream a completion, then prefill and decode tokens/s")
    g.add_argument("model", help="CMF file")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    g.add_argument("--bos", action="store_true", help="prepend the BOS token to a plain prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
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
    from pipeline.tokenizer import tokenizer_from_artifact
    from mlx_runtime.backend import load
    from mlx_runtime.chat import chat_ids
    from mlx_runtime.generate import Sampling, Stats, generate

    if args.max_tokens < 1:
        raise GenerateError(f"--max-tokens {args.max_tokens}: must be at least 1")
    tokenizer = tokenizer_from_artifact(args.model)
    model = load(args.model, task=args.task, skill=args.skill)
    print(model.report.format(), file=sys.stderr)
    if args.chat:
        prompt = chat_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    else:
        prompt = tokenizer.encode(args.prompt, add_bos=args.bos)
    stats = Stats()
    sampling = Sampling(args.temperature, args.top_p, args.seed)
    tokens, shown = [], ""
    for token in generate(model, prompt, max_tokens=args.max_tokens, sampling=sampling,
                          eos_ids=tokenizer.eos_ids, stats=stats):
        tokens.append(token)
        text = tokenizer.decode(tokens)
        # Hold back a partial UTF-8 sequence until its last byte arrives.
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    print()
    print(f"prefill: {stats.prompt_tokens} tokens, {stats.prefill_tps:.1f} tokens/s; "
          f"decode: {stats.generated} tokens, {stats.decode_tps:.1f} tokens/s", file=sys.stderr)
    return 0


def _score(args) -> int:
    from pipeline.scoring import score

    path, summary = score(args.model, args.items, args.output, backend="mlx", force=args.force)
    print(f"{path}: {summary['items']} items, top-1 accuracy {summary['top1_accuracy']}, MRR {summary['mrr']}")
    return 0
