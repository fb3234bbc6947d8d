"""CLI: `cmfdeploy preflight BUNDLE -o DIR [--text FILE] [--context N] [--force]`."""

from pathlib import Path


def register(subparsers) -> None:
    from pipeline.stages.preflight import DEFAULT_TEXT  # no torch: the stage imports it when it runs

    p = subparsers.add_parser("preflight", help="find where a bundle's model overflows fp16 and choose the "
                              "mitigations that keep it finite (refused by name when none does)")
    p.add_argument("bundle", type=Path, help="FP32 bundle folder")
    p.add_argument("-o", "--output", type=Path, required=True, help="report folder to create")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="text whose calibration lines are measured "
                   "(default: fixtures/botchan.txt)")
    p.add_argument("--context", type=int, help="tokens of the long window (default: the model's, at most 2048)")
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.set_defaults(func=_preflight)


def _preflight(args) -> int:
    from pipeline.stages.preflight import run_preflight

    manifest = run_preflight(args.bundle, args.output, text=args.text, context=args.context, force=args.force)
    mitigations = manifest["mitigations"]
    print(f"{args.output}: fp16 {manifest['verdict']} over {manifest['context']} tokens; mitigations: residual scale "
          f"{mitigations['residual_scale']:g}, {mitigations['rmsnorm']} RMSNorm"
          + (", k bias past RoPE" if mitigations.get("key_bias") == "rope_offset" else ""))
    return 0
