"""The worker pool's Ray engine: `run_in_workers(..., engine=WorkerEngine("ray"))` on a cluster.

The same `MODULE:FACTORY` entry, JSON setup and JSON tasks as the local processes
(`pipeline.ground.workers`), served by Ray actors, one per job slot: an actor calls the
factory once with the setup and answers the tasks it is given, JSON strings in and out (what
Ray does to ship a string is its own business; nothing of ours is pickled). Results come back
in the order asked, and a failed task is a WorkerFailed naming it, with the remote
traceback's end.

The cluster shares the stage's files, it does not ship them: an actor works in this
process's working folder and reads and writes the paths the setup names (a bundle, packages,
the stage's staging folder), so every node must see them at the same paths (one shared
filesystem). An actor that does not is a `FolderNotShared` naming the path and its node,
before it takes a task. Ray itself is an optional install (`pip install cmfdeploy[cluster]`),
imported only here and only when this engine runs.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipeline.ground.errors import CmfdeployError
from pipeline.ground.workers import STDERR_TAIL, WorkerEngine, WorkerFailed, thread_env

INSTALL = "pip install cmfdeploy[cluster]"
# How long a cluster's head may take to accept a TCP connection. ray.init itself retries an
# address that never answers for ever (5 s connects, 30 s GCS waits, again and again), so a
# mistyped address would hang the stage instead of failing it.
CONNECT_SECONDS = 10.0
# The ports Ray listens on when an address names none: the GCS's, and the Ray client server's.
DEFAULT_PORTS = {"": 6379, "ray": 10001}


class RayMissing(CmfdeployError):
    """The Ray worker engine was asked for, and Ray is not installed."""


class RayUnreachable(CmfdeployError):
    """No Ray cluster answers at the address given."""


class FolderNotShared(WorkerFailed):
    """A Ray worker's node does not see a folder the stage shares with its workers."""


class RayWorker:
    """One job slot on the cluster: the entry's handler, built once from the setup."""

    def __init__(self, entry: str, setup: str, cwd: str, shared: str):
        self.entry, self.setup, self.cwd, self.shared = entry, setup, cwd, json.loads(shared)
        self.handler = None

    def start(self) -> str:
        """Move into the stage's working folder, check the shared folders, build the handler:
        JSON {"node", "unseen"}, `unseen` the first folder this node cannot use (then no handler)."""
        node = socket.gethostname()
        needs = [(self.cwd, os.R_OK | os.X_OK), *((folder, os.R_OK | os.W_OK | os.X_OK) for folder in self.shared)]
        for folder, access in needs:
            if not (os.path.isdir(folder) and os.access(folder, access)):
                return json.dumps({"node": node, "unseen": folder})
        os.chdir(self.cwd)  # the setup's relative paths are the stage's, as a local worker's are
        module, _, factory = self.entry.partition(":")
        self.handler = getattr(importlib.import_module(module), factory)(json.loads(self.setup))
        return json.dumps({"node": node, "unseen": None})

    def answer(self, task: str) -> str:
        return json.dumps(self.handler(json.loads(task)))


def import_ray():
    """The ray module, or RayMissing saying how to install it."""
    try:
        return importlib.import_module("ray")
    except ImportError as error:
        raise RayMissing(f"the ray worker engine needs Ray, which is not installed here ({error}): {INSTALL}") from error


def refuse_unreachable(address: str, where: object, seconds: float = CONNECT_SECONDS) -> None:
    """RayUnreachable unless the head at `address` (`host:port`, or `ray://host:port`) accepts a TCP
    connection within `seconds`; `auto` and `local` name no head to probe (Ray finds or starts one)."""
    if address in ("auto", "local"):
        return
    scheme, _, rest = address.rpartition("://")
    host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "")
    if scheme not in DEFAULT_PORTS or not host or not (port or str(DEFAULT_PORTS[scheme])).isdigit():
        raise RayUnreachable(f"{where}: Ray address {address!r} is not host:port or ray://host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port or DEFAULT_PORTS[scheme])), timeout=seconds).close()
    except OSError as error:
        raise RayUnreachable(f"{where}: no Ray cluster at {address!r}: its head does not accept a connection "
                             f"within {seconds:g} s ({error})") from error


def job_slots(nodes: Sequence[float], jobs: int, tasks: int) -> tuple[int, int]:
    """(actors, threads each) for `jobs` workers on nodes of these CPU counts: a 1/`jobs` share of
    the cluster's CPUs, as a local worker gets of the machine's, less while the actors would not
    all fit on the nodes whole (an actor cannot span nodes; one that fits nowhere would wait for
    ever); no more actors than tasks, or than the cluster has CPUs (each holds at least one)."""
    actors = max(1, min(jobs, tasks, int(sum(nodes))))
    threads = max(1, int(sum(nodes)) // jobs)
    while threads > 1 and sum(int(cpus) // threads for cpus in nodes) < actors:
        threads -= 1
    return actors, threads


def run_on_ray(entry: str, setup: dict, tasks: Sequence[Any], jobs: int, *, where: object,
               shared: Sequence[str | Path], engine: WorkerEngine,
               done: Callable[[Any, Any], None] | None) -> list[Any]:
    """`run_in_workers` on the Ray cluster at the engine's address (a Ray instance this process
    has already joined is used as it is; otherwise this run joins the address, or RAY_ADDRESS's
    cluster, or starts one here, and leaves it after)."""
    ray, address = import_ray(), engine.address
    joined_here = not ray.is_initialized()
    if joined_here:
        if address or os.environ.get("RAY_ADDRESS"):
            refuse_unreachable(address or os.environ["RAY_ADDRESS"], where)
        try:
            # The workers' output stays on the cluster, as a local worker's stays in its log.
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        except ConnectionError as error:
            raise RayUnreachable(f"{where}: no Ray cluster at {address or os.environ.get('RAY_ADDRESS')!r}: "
                                 f"{error}") from error
    actors = []
    try:
        nodes = [node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"]]
        count, threads = job_slots(nodes, jobs, len(tasks))
        cwd = os.getcwd()
        # The stage's folder first on the workers' import path, as `python -m` puts it for a local worker.
        path = os.pathsep.join(filter(None, (cwd, os.environ.get("PYTHONPATH"))))
        worker = ray.remote(RayWorker).options(num_cpus=threads, runtime_env={
            "env_vars": {**thread_env(threads), "PYTHONPATH": path}})
        shared_json = json.dumps([str(Path(folder).absolute()) for folder in shared])
        actors = [worker.remote(entry, json.dumps(setup), cwd, shared_json) for _ in range(count)]
        running = {actor.start.remote(): (actor, None) for actor in actors}
        waiting = list(enumerate(tasks))
        results: dict[int, Any] = {}
        while len(results) < len(tasks):
            [ref], _ = ray.wait(list(running), num_returns=1)
            actor, job = running.pop(ref)
            try:
                answer = json.loads(ray.get(ref))
            except ray.exceptions.RayError as error:
                doing = f"running {job[1]!r}" if job else f"building {entry} from its setup"
                raise WorkerFailed(f"{where}: the Ray worker {doing} failed:\n{str(error)[-STDERR_TAIL:]}") from None
            if job is None:
                if answer["unseen"]:
                    raise FolderNotShared(
                        f"{where}: the Ray worker on node {answer['node']} cannot read and write {answer['unseen']}: "
                        "every node must see the stage's working and build folders at the same paths as this "
                        "machine (a shared filesystem)")
            else:
                results[job[0]] = answer
                if done is not None:
                    done(job[1], answer)
            if waiting:
                job = waiting.pop(0)
                running[actor.answer.remote(json.dumps(job[1]))] = (actor, job)
    finally:
        for actor in actors:
            ray.kill(actor)  # their work is lost with the caller's staging folder anyway
        if joined_here:
            ray.shutdown()
    return [results[index] for index in range(len(tasks))]
