"""The one worker pool (pipeline.ground.workers): JSON tasks in, JSON results out, in order."""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipeline.ground.ray_engine import INSTALL, RayMissing, job_slots
from pipeline.ground import workers
from pipeline.ground.workers import (STDERR_TAIL, WorkerEngine, UnknownWorkerEngine, WorkerFailed, affordable_jobs,
                                      job_memory, run_in_workers, thread_share_env)

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


def test_local_workers_are_as_many_as_fit_in_the_memory_available(monkeypatch, capsys):
    """A 1.7B model's workers are let 10 GiB each (1.25x its 6.85 GB of FP32 weights + 1.5 GiB):
    two of them do not fit beside what a 24 GB machine has left, so one runs, and it says so."""
    gib = 2**30
    monkeypatch.setattr(workers, "available_memory", lambda: 18 * gib)
    assert job_memory(int(6.85e9)) == int(1.25 * 6.85e9 + 1.5 * gib)
    assert affordable_jobs(2, job_memory(int(6.85e9)), "x") == 1
    assert affordable_jobs(2, job_memory(int(0.54e9)), "x") == 2  # SmolLM2-135M: 2.1 GiB each
    assert affordable_jobs(3, 20 * gib, "x") == 1  # never fewer than one
    assert affordable_jobs(2, None, "x") == 2
    capsys.readouterr()
    results = run_in_workers("tests._worker_jobs:arithmetic", {"factor": 2}, [1, 2, 3], jobs=2, where="fitted",
                             memory_per_job=10 * gib)
    assert [r["value"] for r in results] == [2, 4, 6] and len({r["pid"] for r in results}) == 1
    assert {r["threads"] for r in results} == {thread_share_env(1)["OMP_NUM_THREADS"]}  # the lone worker's share
    assert "fitted: 2 workers of up to 10.0 GiB each exceed the 18.0 GiB available; running 1" in capsys.readouterr().err


def test_a_job_that_maps_its_own_weights_is_let_them_resident_too(tmp_path, monkeypatch):
    """make align's gates each step a weight file of their own: a gate is let its private bound
    and the weights' pages, so two gates of Gemma 3 (1.07 GB) run side by side and two of a
    1.7B model (6.85 GB) do not on a 24 GB machine (22 GiB available)."""
    from pipeline.ground.bundle_format import WEIGHTS_NAME

    gib = 2**30
    monkeypatch.setattr(workers, "available_memory", lambda: 22 * gib)
    for weight_bytes, jobs in ((int(1.07e9), 2), (int(6.85e9), 1)):
        bundle = tmp_path / str(weight_bytes)
        bundle.mkdir()
        with open(bundle / WEIGHTS_NAME, "wb") as weights:
            weights.truncate(weight_bytes)  # sparse: only its size is read
        assert workers.mapped_job_memory(bundle) == job_memory(weight_bytes) + weight_bytes
        assert affordable_jobs(2, workers.mapped_job_memory(bundle), "x") == jobs
    assert workers.mapped_job_memory(tmp_path / "none") is None



@pytest.mark.skipif(not Path("/proc/self/status").exists() or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="reads /proc; malloc_trim is glibc's")
def test_freed_heap_memory_goes_back_to_the_system():
    """Freed blocks below the top of glibc's heap stay the process's resident memory until
    `return_freed_memory` trims them (a worker's next job would otherwise start on top of them).
    Run in a fresh interpreter: 200 MB freed in 64 KB blocks (heap, not mmap), the last block
    kept so the heap's top cannot shrink on its own."""
    script = (
        "import numpy as np\n"
        "from pipeline.ground.workers import return_freed_memory\n"
        "def anon():\n"
        "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('RssAnon'))\n"
        "blocks = [np.ones(8192) for _ in range(3200)]\n"
        "last = blocks.pop()\n"
        "start = anon(); del blocks\n"
        "freed = anon(); return_freed_memory(); trimmed = anon()\n"
        "print(start - freed, freed - trimmed)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    by_free, by_trim = (int(x) for x in out.split())
    assert by_free < 50 * 1024 and by_trim > 150 * 1024, out  # kB: the free alone returns little, the trim most

def test_thread_share_is_a_fraction_of_the_cores_and_never_zero():
    cores = os.cpu_count() or 1
    assert thread_share_env(1)["OPENBLAS_NUM_THREADS"] == str(cores)
    assert thread_share_env(4 * cores)["MKL_NUM_THREADS"] == "1"


def test_a_dying_worker_is_a_typed_error_naming_its_task_and_its_stderr():
    with pytest.raises(WorkerFailed, match=r"survey: the worker running 'b' exited 3:\n(.|\n)*cannot do b"):
        run_in_workers("tests._worker_jobs:dies_on", {"fatal": "b"}, ["a", "b", "c"], jobs=2, where="survey")


def test_a_worker_that_fills_its_stderr_pipe_is_not_stalled_and_its_last_words_are_kept():
    # 1 MB is sixteen times a Linux pipe's buffer: an undrained pipe would block the worker.
    setup = {"bytes": 1 << 20, "fatal": "c"}
    assert run_in_workers("tests._worker_jobs:chatters", {"bytes": 1 << 20}, ["a", "b"], jobs=1,
                          where="survey") == ["a", "b"]
    with pytest.raises(WorkerFailed, match=r"exited 4:\nx+\nlast word on c\n$") as failed:
        run_in_workers("tests._worker_jobs:chatters", setup, ["a", "b", "c"], jobs=2, where="survey")
    assert len(str(failed.value)) < STDERR_TAIL + 200


def test_a_worker_error_reaches_the_caller_when_the_temp_folder_is_unusable(tmp_path, monkeypatch):
    """On a full disk a worker's own error is the one that says so: its stderr must not need the
    temp folder to be carried back."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "gone"))
    with pytest.raises(WorkerFailed, match=r"exited 3:\n(.|\n)*cannot do b"):
        run_in_workers("tests._worker_jobs:dies_on", {"fatal": "b"}, ["a", "b"], jobs=1, where="survey")


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
    """...and the killed stage leaves nothing in its temp folder (the workers' logs are unlinked files)."""
    pid_file, temp = tmp_path / "worker.pid", tmp_path / "temp"
    temp.mkdir()
    stage = subprocess.Popen([sys.executable, "-c", "from pipeline.ground.workers import run_in_workers; "
                              f"run_in_workers('tests._worker_jobs:blocks', {{'pid_file': {str(pid_file)!r}}}, "
                              "['task'], jobs=1, where='stage')"], cwd=ROOT, env={**os.environ, "TMPDIR": str(temp)})
    _until(lambda: pid_file.is_file() and pid_file.read_text(), "the worker to start its task")
    worker = int(pid_file.read_text())
    assert _alive(worker)
    stage.send_signal(signal.SIGKILL)
    stage.wait()
    _until(lambda: not _alive(worker), "the worker to die with its stage")
    assert list(temp.iterdir()) == []


def test_a_worker_engine_is_local_or_ray_and_only_ray_takes_an_address():
    assert WorkerEngine().in_process and not WorkerEngine("ray", "10.0.0.1:6379").in_process
    with pytest.raises(UnknownWorkerEngine, match="worker engine 'dask' is not among"):
        WorkerEngine("dask")
    with pytest.raises(UnknownWorkerEngine, match="address '10.0.0.1:6379': only the ray engine"):
        WorkerEngine("local", "10.0.0.1:6379")


def test_without_ray_the_ray_worker_engine_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray gives `import ray`
    with pytest.raises(RayMissing, match=re.escape(INSTALL)):
        run_in_workers("tests._worker_jobs:arithmetic", {"factor": 1}, [1], jobs=1, where="test",
                       engine=WorkerEngine("ray"))
    assert INSTALL == "pip install cmfdeploy[cluster]"


@pytest.mark.parametrize("nodes, jobs, tasks, slots", [
    ((2.0,), 2, 5, (2, 1)),  # the test cluster: two actors of one thread, as two local workers on two cores
    ((16.0,), 2, 10, (2, 8)),
    ((16.0, 16.0), 4, 10, (4, 8)),
    ((16.0,), 4, 1, (1, 4)),  # one task: one actor, still a 1/jobs share
    ((3.0, 3.0), 3, 3, (3, 1)),  # two threads each would leave the third actor no node to fit on
    ((2.0,), 8, 8, (2, 1)),  # no more actors than CPUs: one that never starts would hold its task for ever
])
def test_job_slots_share_the_cluster_and_fit_on_its_nodes(nodes, jobs, tasks, slots):
    actors, threads = job_slots(nodes, jobs, tasks)
    assert (actors, threads) == slots
    assert sum(int(cpus) // threads for cpus in nodes) >= actors
