"""The one worker pool (pipeline.ground.workers): JSON tasks in, JSON results out, in order."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.ground.workers import WorkerFailed, run_in_workers, thread_share_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _from_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # a worker imports `tests._worker_jobs` from its working folder


def test_results_come_back_in_the_order_asked_from_at_most_jobs_workers():
    seen = []
    results = run_in_workers("tests._worker_jobs:arithmetic", {"factor": 3}, [5, 1, 4, 1, 2], jobs=2,
                             where="test", done=lambda task, result: seen.append(task))
    assert [r["value"] for r in results] == [15, 3, 12, 3, 6]
    assert sorted(seen) == [1, 1, 2, 4, 5]
    assert len({r["pid"] for r in results}) <= 2
    assert {r["setups"] for r in results} == {1}  # a worker builds its setup once, for all its tasks
    assert {r["threads"] for r in results} == {thread_share_env(2)["OMP_NUM_THREADS"]}


def test_thread_share_is_a_fraction_of_the_cores_and_never_zero():
    cores = os.cpu_count() or 1
    assert thread_share_env(1)["OPENBLAS_NUM_THREADS"] == str(cores)
    assert thread_share_env(4 * cores)["MKL_NUM_THREADS"] == "1"


def test_a_dying_worker_is_a_typed_error_naming_its_task_and_its_stderr():
    with pytest.raises(WorkerFailed, match=r"survey: the worker running 'b' exited 3:\n(.|\n)*cannot do b"):
        run_in_workers("tests._worker_jobs:dies_on", {"fatal": "b"}, ["a", "b", "c"], jobs=2, where="survey")


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie nobody has reaped yet has stopped running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _until(condition, what: str, limit: float = 300.0) -> None:
    # The limit only bounds a hang; the condition itself does not depend on how fast anything runs.
    end = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < end, f"still waiting for {what}"
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_worker_dies_with_the_stage_that_started_it(tmp_path):
    pid_file = tmp_path / "worker.pid"
    stage = subprocess.Popen([sys.executable, "-c", "from pipeline.ground.workers import run_in_workers; "
                              f"run_in_workers('tests._worker_jobs:blocks', {{'pid_file': {str(pid_file)!r}}}, "
                              "['task'], jobs=1, where='stage')"], cwd=ROOT)
    _until(lambda: pid_file.is_file() and pid_file.read_text(), "the worker to start its task")
    worker = int(pid_file.read_text())
    assert _alive(worker)
    stage.send_signal(signal.SIGKILL)
    stage.wait()
    _until(lambda: not _alive(worker), "the worker to die with its stage")
