"""The one worker pool (pipeline.ground.workers): JSON tasks in, JSON results out, in order."""

import os
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
