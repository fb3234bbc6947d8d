"""CLI arguments of the stages that run worker jobs (coreml, survey, score)."""

import argparse

from pipeline.ground.workers import ENGINES, Executor


def add_executor_arguments(parser: argparse.ArgumentParser) -> None:
    """--executor and --address: where a stage's worker jobs run (`pipeline.ground.workers.Executor`)."""
    parser.add_argument("--executor", choices=ENGINES, default="local",
                        help="local worker processes, or the actors of a Ray cluster that sees the build folder at "
                             "the same path (pip install cmfdeploy[cluster])")
    parser.add_argument("--address", help="the Ray cluster's address (default: RAY_ADDRESS, else a Ray started here)")


def executor_of(args: argparse.Namespace) -> Executor:
    return Executor(args.executor, args.address)
