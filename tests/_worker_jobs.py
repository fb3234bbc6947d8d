"""Worker factories for tests/test_workers.py: plain handlers a worker process imports by name."""

import os
import sys
import threading
from pathlib import Path


def arithmetic(setup: dict):
    """Each task n -> n * setup's factor, with what the worker saw (its pid, thread share, setups built)."""
    built = {"count": 0}
    built["count"] += 1

    def handle(n: int) -> dict:
        print("noise a handler prints must not reach the answers")
        return {"value": n * setup["factor"], "pid": os.getpid(), "threads": os.environ["OMP_NUM_THREADS"],
                "setups": built["count"]}
    return handle


def dies_on(setup: dict):
    def handle(task: str) -> str:
        if task == setup["fatal"]:
            print(f"cannot do {task}", file=sys.stderr)
            os._exit(3)
        return task
    return handle


def chatters(setup: dict):
    """Each task: setup's `bytes` of noise on stderr (more than a pipe holds) before its answer,
    or before dying with a last word for setup's `fatal` task."""
    def handle(task: str) -> str:
        sys.stderr.write("x" * setup["bytes"] + "\n")
        if task == setup.get("fatal"):
            print(f"last word on {task}", file=sys.stderr)
            os._exit(4)
        return task
    return handle


def blocks(setup: dict):
    """Each task: say this worker's pid in setup's file, then wait for ever (a stage mid-task)."""
    def handle(task: str) -> str:
        Path(setup["pid_file"]).write_text(str(os.getpid()))
        threading.Event().wait()
        return task
    return handle


def raises_on(setup: dict):
    """Each task back, but an exception for setup's `fatal` one (a handler's bug, not a dead process)."""
    def handle(task: str) -> str:
        if task == setup["fatal"]:
            raise ValueError(f"cannot do {task}")
        return task
    return handle
