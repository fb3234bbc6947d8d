"""`cmfdeploy`: a thin argparse shell over the stage functions.

Each area owns a module with `register(subparsers)`; this file only wires them up and
turns typed errors into one line `KIND: message` with exit status 1 (never a traceback
for bad input).
"""

import argparse
import importlib
import sys

from pipeline.errors import CmfdeployError

COMMAND_MODULES = [
    "pipeline.cmf.commands",
    "pipeline.artifact_commands",
    "pipeline.eval_commands",
    "pipeline.align_commands",
    "mlx_runtime.commands",
    "pipeline.scoring_commands",
    "coreml.commands",
    "coreml.survey_commands",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cmfdeploy", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CmfdeployError as error:
        print(f"{error.kind}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
