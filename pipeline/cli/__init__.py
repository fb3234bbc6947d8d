"""`cmfdeploy`: a thin argparse shell over the stage functions.

Each area owns a module with `register(subparsers)` (listed in COMMANDS); this file only wires them up and
turns typed errors into one line `KIND: message` with exit status 1 (never a traceback
for bad input).

The CLI is quiet by default: third-party libraries' version warnings, log lines and progress
bars (coremltools' per-pass MIL bars) are hidden, so each stage prints its own lines and its
one progress bar. `-v` lets all of it through.
"""

import argparse
import importlib
import logging
import os
import sys
import warnings

from pipeline.ground.errors import CmfdeployError, CmfdeployWarning

# Subcommand -> the module that registers it. Only the module a command needs is imported,
# and registering imports no torch or coremltools, so `cmfdeploy --help` stays light.
COMMANDS = {
    **dict.fromkeys(["inspect", "verify", "sign", "dump"], "pipeline.cli.cmf_commands"),
    **dict.fromkeys(["bundle", "verify-artifact", "import-hf", "import-gguf"], "pipeline.cli.artifact_commands"),
    **dict.fromkeys(["logits", "ppl", "generate"], "pipeline.cli.eval_commands"),
    **dict.fromkeys(["align", "reference-fixtures"], "pipeline.cli.align_commands"),
    "score": "pipeline.cli.scoring_commands",
    "preflight": "pipeline.cli.preflight_commands",
    **dict.fromkeys(["coreml", "compress"], "pipeline.cli.coreml_commands"),
    **dict.fromkeys(["survey", "deploy", "release", "app-release"], "pipeline.cli.survey_commands"),
    "mlx": "pipeline.cli.mlx_commands",
}
# The distributions `--version` names beside cmfdeploy: the ones whose versions shape an artifact.
VERSION_PACKAGES = ("cmfdeploy", "coremltools", "torch", "mlx")
# Libraries whose loggers speak at import or conversion time (coremltools: "scikit-learn
# version ... is not supported", "Torch version ... has not been tested", "Tuple detected
# at graph output", ...).
THIRD_PARTY_LOGGERS = ("coremltools", "torch", "transformers", "jax", "matplotlib", "PIL")


def quiet_third_party() -> None:
    """Hide third-party warnings, log lines and progress bars for the rest of the process.

    coremltools' MIL pass and frontend bars are plain `tqdm(...)` calls; tqdm reads
    `TQDM_*` variables as its defaults when it is first imported, so this must run before
    anything imports tqdm. The project's own bars pass `disable=` explicitly and stay on.
    Python warnings are hidden except the project's own (`CmfdeployWarning`).
    """
    previous = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    import tqdm.std  # noqa: F401  (binds the disabled default; a no-op when tqdm is already imported)

    # Restored at once, so no child process inherits a disabled tqdm.
    if previous is None:
        del os.environ["TQDM_DISABLE"]
    else:
        os.environ["TQDM_DISABLE"] = previous
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    warnings.simplefilter("default", CmfdeployWarning)


def version_line() -> str:
    """`cmfdeploy X (coremltools Y, torch Z, mlx W)`: installed versions, read from package
    metadata without importing any of them."""
    from manifests.identity import environment

    versions = environment(VERSION_PACKAGES)["packages"]
    own = versions.pop("cmfdeploy")
    return f"cmfdeploy {own} (" + ", ".join(f"{name} {v or 'not installed'}" for name, v in versions.items()) + ")"


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the versions of cmfdeploy, coremltools, "
                         "torch and mlx, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cmfdeploy", description="Ship CMF v2 language models to Apple silicon, every stage verified.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="let third-party warnings, log lines and progress bars through")
    parser.add_argument("--version", action=_Version)
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = [COMMANDS[command]] if command in COMMANDS else dict.fromkeys(COMMANDS.values())
    for module_name in modules:
        importlib.import_module(module_name).register(subparsers)
    return parser


def _command_word(argv: list[str]) -> tuple[str | None, bool]:
    """(the subcommand, whether -v/--verbose came before it): read before argparse runs,
    because quieting has to happen before the command's module is imported."""
    verbose = False
    for arg in argv:
        if not arg.startswith("-"):
            return arg, verbose
        verbose = verbose or arg in ("-v", "--verbose")
    return None, verbose


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, verbose = _command_word(argv)
    if not verbose:
        quiet_third_party()
    args = build_parser(command).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CmfdeployError as error:
        print(f"{error.kind}: {error}", file=sys.stderr)
        return 1

