"""`cmfdeploy logits`, `cmfdeploy ppl` and `cmfdeploy generate`: one artifact, any backend.

The artifact is a CMF file, a bundle, a Core ML package folder or a release folder; text goes
through the artifact's own tokenizer (packages and releases carry theirs).
"""

import sys
from pathlib import Path

import numpy as np

from manifests.output import refuse_existing
from pipeline.ground.backend_protocol import BACKENDS
from pipeline.cli.cmf_commands import write_npz
from pipeline.ground.errors import CmfdeployError
from pipeline.ground.generation import add_generation_arguments
from pipeline.ground.tokenizer import tokenizer_from_artifact


class EvalInputError(CmfdeployError):
    """An --ids file or --text file that cannot be used."""


def register(subparsers) -> None:
    logits = subparsers.add_parser("logits", help="write float32 logits [T, vocab] of a token sequence to .npz")
    _common(logits)
    source = logits.add_mutually_exclusive_group(required=True)
    source.add_argument("--ids", type=Path, help=".npy of 1-D integer token ids")
    source.add_argument("--text", type=Path, help="UTF-8 text, tokenized with the artifact's tokenizer (BOS first "
                        "when the tokenizer config has one)")
    logits.add_argument("--chunk", type=int, help="feed the sequence through the KV cache CHUNK tokens at a time")
    logits.add_argument("-o", "--output", type=Path, required=True, help="output .npz with `ids` and `logits`")
    logits.add_argument("--force", action="store_true", help="overwrite an existing output")
    logits.set_defaults(func=_logits)

    ppl = subparsers.add_parser("ppl", help="perplexity of a text file in non-overlapping windows")
    _common(ppl)
    ppl.add_argument("--text", type=Path, required=True, help="UTF-8 text file")
    ppl.add_argument("--window", type=int, default=128, help="tokens per window, BOS included (default 128)")
    ppl.set_defaults(func=_ppl)

    generate = subparsers.add_parser("generate", help="stream a completion from any artifact (a stateful or "
                                     "chunk-KV package, a release, a CMF), then prefill and decode tokens/s")
    _common(generate)
    add_generation_arguments(generate)
    generate.set_defaults(func=_generate)


def _common(parser) -> None:
    parser.add_argument("artifact", type=Path, help="CMF file, bundle, Core ML package or release folder")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--task", help="CMF task mask (torch and mlx backends)")
    parser.add_argument("--skill", help="CMF skill id (torch and mlx backends)")


def _backend(args, **options):
    from pipeline.stages.backends import open_backend  # torch: only once a command runs

    for key in ("task", "skill"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    return open_backend(args.artifact, args.backend, **options)


def _text_ids(artifact: Path, text_path: Path) -> tuple[np.ndarray, int | None]:
    """(text token ids, BOS id or None) from the artifact's tokenizer."""
    tokenizer = tokenizer_from_artifact(artifact)
    try:
        text = text_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise EvalInputError(f"{text_path}: cannot read as UTF-8 text ({error})") from None
    return tokenizer.encode(text), tokenizer.bos_id


def _logits(args) -> int:
    refuse_existing(args.output, args.force)
    if args.ids is not None:
        try:
            ids = np.load(args.ids, allow_pickle=False)
        except (OSError, ValueError) as error:
            raise EvalInputError(f"{args.ids}: not a readable .npy file ({error})") from None
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise EvalInputError(f"{args.ids}: ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    else:
        text_ids, bos_id = _text_ids(args.artifact, args.text)
        ids = text_ids if bos_id is None else np.concatenate([[bos_id], text_ids])
    backend = _backend(args, **({} if args.chunk is None else {"chunk": args.chunk}))
    logits = np.asarray(backend.logits(ids), dtype=np.float32)
    write_npz(args.output, [("ids", ids.astype(np.int64)), ("logits", logits)])
    print(f"{args.output}: logits {logits.shape} from {backend.name}")
    return 0


def _ppl(args) -> int:
    from pipeline.stages.evaluate import perplexity

    ids, bos_id = _text_ids(args.artifact, args.text)
    backend = _backend(args)
    result = perplexity(backend, ids, window=args.window, bos_id=bos_id)
    print(f"backend {backend.name}: {result.tokens} tokens in {result.windows} windows of {args.window}, "
          f"mean NLL {result.mean_nll:.6f} nats, perplexity {result.perplexity:.4f}")
    return 0


def _generate(args) -> int:
    from pipeline.ground.generation import Stats, generate, prompt_ids, sampling_of, stream_text

    tokenizer = tokenizer_from_artifact(args.artifact)
    backend = _backend(args)
    print(f"{args.artifact}: generating on {backend.name}", file=sys.stderr)
    stats = Stats()
    stream_text(generate(backend, prompt_ids(tokenizer, args), max_tokens=args.max_tokens,
                         sampling=sampling_of(args), eos_ids=tokenizer.eos_ids, stats=stats, where=str(args.artifact)),
                tokenizer, sys.stdout)
    print(stats.line(), file=sys.stderr)
    return 0
