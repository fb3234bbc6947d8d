"""`cmfdeploy`: a thin argparse shell over the stage functions.

Each area owns a module with `register(subparsers)` (listed in COMMANDS); this file only wires them up and
turns typed errors into one line `KIND: message` with exit status 1 (never a traceback
for bad input).
"""

import argparse
import importlib
import sys

from pipeline.errors import CmfdeployError

# Subcommand -> the module that registers it. Only the module a command needs is imported,
# so `cmfdeploy verify` never pays for torch or coremltools; `--help` imports them all.
COMMANDS = {
    **dict.fromkeys(["inspect", "verify", "sign", "dump"], "pipeline.cmf.commands"),
    **dict.fromkeys(["bundle", "verify-artifact", "import-hf", "import-gguf"], "pipeline.artifact_commands"),
    **dict.fromkeys(["logits", "ppl"], "pipeline.eval_commands"),
    **dict.fromkeys(["align", "reference-fixtures"], "pipeline.align_commands"),
    "score": "pipeline.scoring_commands",
    **dict.fromkeys(["coreml", "compress"], "coreml.commands"),
    **dict.fromkeys(["survey", "release"], "pipeline.survey_commands"),
    "mlx": "mlx_runtime.commands",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cmfdeploy", description="Ship CMF v2 language models to Apple silicon, every stage verified.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = [COMMANDS[command]] if command in COMMANDS else dict.fromkeys(COMMANDS.values())
    for module_name in modules:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CmfdeployError as error:
        print(f"{error.kind}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
