"""CLI arguments of the stages that run worker jobs (coreml, survey, score)."""

import argparse

from pipeline.ground.workers import WORKER_ENGINES, WorkerEngine


def add_worker_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """--worker-engine and --address: where a stage's worker jobs run (`pipeline.ground.workers.WorkerEngine`)."""
    parser.add_argument("--worker-engine", choices=WORKER_ENGINES, default="local",
                        help="local worker processes, or the actors of a Ray cluster that sees the build folder at "
                             "the same path (pip install cmfdeploy[cluster])")
    parser.add_argument("--address", help="the Ray cluster's address (default: RAY_ADDRESS, else a Ray started here)")


def worker_engine_of(args: argparse.Namespace) -> WorkerEngine:
    return WorkerEngine(args.worker_engine, args.address)
