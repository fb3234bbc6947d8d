"""The one worker pool: independent jobs run by worker processes that share the cores.

    results = run_in_workers("coreml.convert:conversion_worker", setup, ["stateful", "stateless"], jobs=2,
                             where=out_dir, shared=(staging,), engine=WorkerEngine("ray"))

A worker is `python -m pipeline.ground.workers MODULE:FACTORY SETUP`: it imports
`FACTORY`, calls it once with the JSON `SETUP` (what every job shares: a verified bundle, a
reference model, a scored baseline), and answers each JSON task it reads on stdin with the
JSON result of `handler(task)`, one line each. JSON in, JSON out: no pickle, so a task and
its result are plain data any worker engine can ship. Each worker gets a 1/`jobs` share of the
cores for its BLAS and OpenMP pools, set in its environment before it imports numpy or torch.

The `WorkerEngine` says where the workers run: local processes (the default, above), or the actors
of a Ray cluster (`pipeline.ground.ray_engine`: the same entry, setup and tasks, one actor per
job slot), whose nodes see the `shared` folders at the same paths as this machine.

The caller names its own factory, so this module imports nothing above the ground.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.ground.errors import CmfdeployError

# How much of a failed worker's stderr its error carries: the traceback's end, where the cause is.
STDERR_TAIL = 4000
# The thread pools a worker's share of the cores bounds (torch's OpenMP, MKL, numpy's OpenBLAS).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# Each engine's runner, with run_in_workers' arguments, looked up by name when a stage asks for
# it: only the Ray engine's module imports Ray.
WORKER_ENGINES = {"local": "pipeline.ground.workers:run_locally", "ray": "pipeline.ground.ray_engine:run_on_ray"}


class WorkerFailed(CmfdeployError):
    """A worker died or failed before answering its task; carries the end of its stderr (a local
    process) or of its remote traceback (a Ray actor)."""


class UnknownWorkerEngine(CmfdeployError):
    """A worker engine that is not among WORKER_ENGINES, or a cluster address given to the local one."""


@dataclass(frozen=True)
class WorkerEngine:
    """Where a stage's workers run: `local` processes, or `ray`, the cluster at `address`
    (None: the one RAY_ADDRESS names, else a Ray instance started on this machine for the run)."""

    name: str = "local"
    address: str | None = None

    def __post_init__(self):
        if self.name not in WORKER_ENGINES:
            raise UnknownWorkerEngine(f"worker engine {self.name!r} is not among {list(WORKER_ENGINES)}")
        if self.address is not None and self.name != "ray":
            raise UnknownWorkerEngine(f"address {self.address!r}: only the ray engine runs on a cluster")

    @property
    def in_process(self) -> bool:
        """Whether a single job may run in the calling process: only local workers would run it here."""
        return self.name == "local"


LOCAL = WorkerEngine()


def thread_share(jobs: int) -> int:
    """Threads per worker for `jobs` workers side by side on this machine's cores (each would
    otherwise claim them all)."""
    return max(1, (os.cpu_count() or 1) // jobs)


def thread_env(threads: int) -> dict[str, str]:
    """The variables that hold each BLAS/OpenMP pool to `threads`."""
    return dict.fromkeys(THREAD_VARIABLES, str(threads))


def thread_share_env(jobs: int) -> dict[str, str]:
    """This process's environment with each BLAS/OpenMP pool at 1/`jobs` of the cores, for one
    of `jobs` worker processes running side by side."""
    return {**os.environ, **thread_env(thread_share(jobs))}


def job_memory(weight_bytes: int) -> int:
    """What one worker over a model of `weight_bytes` FP32 weight bytes is let to hold: the
    private-memory bound every stage keeps to (docs/MEMORY.md), 1.25x the weights + 1.5 GiB."""
    return int(1.25 * weight_bytes + 1.5 * 2**30)


def bundle_job_memory(bundle: Path) -> int | None:
    """`job_memory` of the model in `bundle`; None where it has no weights file (a worker
    verifies the bundle and refuses it by name)."""
    from pipeline.ground.bundle_format import WEIGHTS_NAME

    weights = Path(bundle) / WEIGHTS_NAME
    return job_memory(weights.stat().st_size) if weights.exists() else None


def mapped_job_memory(bundle: Path) -> int | None:
    """`bundle_job_memory`, and the model's FP32 weight bytes once more: what a job that reads a
    weight file of its own through a map needs resident (a gate steps its package's weight.bin
    whole a token at a time, beside the bundle's map that every job shares). Those pages are
    the page cache's, but two 1.7B gates' 6.85 GB each and their own memory do not fit in 24 GB
    together, and a page dropped between steps is read back from disk at every step."""
    from pipeline.ground.bundle_format import WEIGHTS_NAME

    private = bundle_job_memory(bundle)
    return None if private is None else private + (Path(bundle) / WEIGHTS_NAME).stat().st_size


def return_freed_memory() -> None:
    """Hand the memory this process has freed back to the system. glibc keeps freed heap pages
    as the process's own: after a compression, coremltools' copy of the program (1 W, freed)
    stayed resident through the gate that follows (SmolLM2 int8-b32: 0.97 GB anonymous after
    the compression, 0.30 GB once trimmed). A no-op where the C library has no malloc_trim."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:
        pass


def available_memory() -> int | None:
    """Bytes this machine can give new processes without swapping (Linux MemAvailable); None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def affordable_jobs(jobs: int, memory_per_job: int | None, where: object) -> int:
    """`jobs`, or fewer where that many workers of `memory_per_job` bytes each would not fit in
    the memory available now (at least one: a single job runs whatever it needs). Says so on
    stderr: a 1.7B model's two conversion workers would want 20 GB of a 24 GB machine."""
    available = available_memory()
    if memory_per_job is None or available is None or jobs * memory_per_job <= available:
        return jobs
    fitting = max(1, available // memory_per_job)
    print(f"{where}: {jobs} workers of up to {memory_per_job / 2**30:.1f} GiB each exceed the "
          f"{available / 2**30:.1f} GiB available; running {fitting}", file=sys.stderr)
    return fitting


def run_in_workers(entry: str, setup: dict, tasks: Sequence[Any], jobs: int, *, where: object,
                   shared: Sequence[str | Path] = (), engine: WorkerEngine = LOCAL,
                   done: Callable[[Any, Any], None] | None = None, memory_per_job: int | None = None) -> list[Any]:
    """The result of every task, in the order of `tasks`, from at most `jobs` workers of `entry`.

    Tasks start in the order given (put the longest first, so no worker runs alone at the
    end); `done(task, result)` is called as each one comes back. The first worker to die
    raises WorkerFailed naming `where` and its task; the other workers are then killed,
    since their work is lost with the caller's staging folder anyway. `shared`: the folders
    the workers read and write (a staging folder), which a Ray worker checks it sees.
    `memory_per_job` (`job_memory`): local workers are as many as fit in this machine's
    available memory (`affordable_jobs`); a cluster's actors are Ray's to place.
    """
    if engine.name == "local":
        jobs = affordable_jobs(jobs, memory_per_job, where)
    module, _, runner = WORKER_ENGINES[engine.name].partition(":")
    return getattr(importlib.import_module(module), runner)(entry, setup, tasks, jobs, where=where, shared=shared,
                                                            engine=engine, done=done)


def run_locally(entry: str, setup: dict, tasks: Sequence[Any], jobs: int, *, where: object,
                shared: Sequence[str | Path], engine: WorkerEngine, done: Callable[[Any, Any], None] | None) -> list[Any]:
    """`run_in_workers` in worker processes of this machine (which sees every `shared` folder)."""
    env = thread_share_env(jobs)
    argv = [sys.executable, "-m", __name__, entry, json.dumps(setup), str(os.getpid())]
    waiting = list(enumerate(tasks))
    results: dict[int, Any] = {}
    workers: list[subprocess.Popen] = []
    with selectors.DefaultSelector() as ready:
        try:
            for _ in range(min(jobs, len(waiting))):
                worker = subprocess.Popen(argv, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE)
                workers.append(worker)
                current, tail = [waiting.pop(0)], bytearray()
                ready.register(worker.stdout, selectors.EVENT_READ, (worker, current, tail))
                ready.register(worker.stderr, selectors.EVENT_READ, tail)
                _send(worker, current[0][1])
            while len(results) < len(tasks):
                for key, _ in ready.select():
                    if isinstance(key.data, bytearray):
                        if not _keep_tail(key.fileobj, key.data):
                            ready.unregister(key.fileobj)
                        continue
                    worker, current, tail = key.data
                    line = worker.stdout.readline()
                    if not line:
                        code = worker.wait()
                        _drain(worker.stderr, tail)
                        raise WorkerFailed(f"{where}: the worker running {current[0][1]!r} exited {code}:\n"
                                           f"{tail.decode(errors='replace')[-STDERR_TAIL:]}")
                    index, task = current[0]
                    results[index] = json.loads(line)
                    if done is not None:
                        done(task, results[index])
                    if waiting:
                        current[0] = waiting.pop(0)
                        _send(worker, current[0][1])
        finally:
            for worker in workers:
                worker.stdin.close()
                if len(results) < len(tasks):
                    worker.kill()
                worker.wait()
                worker.stdout.close()
                worker.stderr.close()
    return [results[index] for index in range(len(tasks))]


def _keep_tail(stream, tail: bytearray) -> bool:
    """Append what a worker has written to its stderr to `tail`, keeping the end that an error
    carries; False at the end of the stream. The tail is held in memory, not in a file: a worker
    that dies of a full temp folder would lose its log, and with it the error that says so."""
    chunk = os.read(stream.fileno(), 1 << 16)
    tail += chunk
    del tail[:-4 * STDERR_TAIL]  # enough bytes for STDERR_TAIL characters of UTF-8
    return bool(chunk)


def _drain(stream, tail: bytearray) -> None:
    """Keep the rest of a dead worker's stderr. Everything it wrote is in the pipe once it has
    exited, so reading without blocking gets it all, even if some process it started holds the
    pipe open."""
    os.set_blocking(stream.fileno(), False)
    try:
        while _keep_tail(stream, tail):
            pass
    except BlockingIOError:
        pass


def _send(worker: subprocess.Popen, task: Any) -> None:
    worker.stdin.write(json.dumps(task) + "\n")
    worker.stdin.flush()


def serve(entry: str, setup: dict, parent: int) -> None:
    """A worker's life: build the handler once, then answer each task line on stdin."""
    _die_with(parent)
    module, _, factory = entry.partition(":")
    handler = getattr(importlib.import_module(module), factory)(setup)
    answers, sys.stdout = sys.stdout, sys.stderr  # stdout carries the answers alone
    for line in sys.stdin:
        print(json.dumps(handler(json.loads(line))), file=answers, flush=True)
        return_freed_memory()  # what one job freed is not the next job's resident memory


def _die_with(parent: int) -> None:
    """End this worker when the process that started it dies: a killed stage must not leave
    workers writing into its staging folder. On Linux the kernel sends the SIGKILL
    (PR_SET_PDEATHSIG); elsewhere the parent's closed stdin ends the worker after its task."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request above was in place
        os._exit(1)


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))
