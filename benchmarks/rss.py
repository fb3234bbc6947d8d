"""Resident memory: of this process, for benchmarks that run each case in a fresh interpreter,
and of a whole stage (a process and every process it starts), sampled.

Linux reads /proc/self/status: getrusage's ru_maxrss survives exec there, so a child started
by a big parent would report the parent's peak. Elsewhere ru_maxrss is the best there is.

    python benchmarks/rss.py [--interval 0.1] [--json out.json] -- COMMAND ARGS...

runs COMMAND and prints its wall time and peaks (`TreeSampler`): total resident memory (VmRSS,
mapped file pages included) and anonymous memory (RssAnon: the heap, numpy and torch buffers,
copy-on-write pages once written), each as the largest single process and as the sum over
the process tree at one sample, and which process held each largest (its command, and when). A mapped file's pages that are only read are reclaimable and
shared between processes, so the anonymous peak is what bounds a stage's memory; the total is
reported beside it. Linux only (it reads /proc).
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_mib(field: str) -> float | None:
    if not _STATUS.exists():
        return None
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    return None


def peak_rss_mib() -> float:
    """The peak resident set of this process image (VmHWM)."""
    peak = _status_mib("VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def current_rss_mib() -> float | None:
    """The resident set now (VmRSS); None where /proc is missing."""
    return _status_mib("VmRSS")


# -- a process tree, sampled

_PROC = Path("/proc")
_FIELDS = {"VmRSS": "rss", "RssAnon": "anon", "VmHWM": "hwm"}


def process_memory(pid: int) -> dict[str, int] | None:
    """{"rss", "anon", "hwm"} in bytes from /proc/<pid>/status; None once the process is gone."""
    try:
        text = (_PROC / str(pid) / "status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    found = {}
    for line in text.splitlines():
        key = line.split(":", 1)[0]
        if key in _FIELDS:
            found[_FIELDS[key]] = int(line.split()[1]) * 1024  # kB
    # A zombie has no memory lines left.
    return found if len(found) == len(_FIELDS) else None


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (/proc/<pid>/stat; the `children` files need a kernel option)."""
    parents = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        # The command name in parentheses may hold spaces; the fields after its last ')' do not.
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def process_tree(root: int) -> list[int]:
    """`root` and every descendant alive now."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


class TreeSampler:
    """Peaks of a process tree's memory over the samples taken (`sample`).

    `process_rss` is exact (each process's own high-water mark, VmHWM, read at every sample);
    the anonymous peaks and the tree sums are as high as the samples saw, so a spike shorter
    than the interval may be missed. A page two processes share counts in each one's RSS:
    the tree's total sums them, its anonymous sum is private memory plus copy-on-write pages
    not yet written.
    """

    def __init__(self, root: int):
        self.root = root
        self.peaks = {"process_rss": 0, "process_anon": 0, "tree_rss": 0, "tree_anon": 0}
        self.samples = 0
        self.processes: set[int] = set()
        self.tree = [root]
        self.started = time.perf_counter()
        # Which process held each per-process peak, and when: a stage of several processes
        # (a survey's workers) says which one to look at.
        self.holders: dict[str, dict] = {}

    def sample(self, rescan: bool = True) -> None:
        """Read the memory of each process of the tree; `rescan` finds the tree anew first
        (reading every process's parent is the sample's dearest part on a busy machine)."""
        if rescan:
            self.tree = process_tree(self.root)
        rss = anon = 0
        for pid in self.tree:
            memory = process_memory(pid)
            if memory is None:
                continue
            self.processes.add(pid)
            rss, anon = rss + memory["rss"], anon + memory["anon"]
            for peak, value in (("process_rss", max(memory["hwm"], memory["rss"])), ("process_anon", memory["anon"])):
                if value > self.peaks[peak]:
                    self.peaks[peak] = value
                    self.holders[peak] = {"pid": pid, "command": _command(pid),
                                          "seconds": round(time.perf_counter() - self.started, 1)}
        self.peaks["tree_rss"] = max(self.peaks["tree_rss"], rss)
        self.peaks["tree_anon"] = max(self.peaks["tree_anon"], anon)
        self.samples += 1

    def result(self) -> dict:
        return {**self.peaks, "samples": self.samples, "processes": len(self.processes), "holders": self.holders}


def _command(pid: int) -> str:
    """The start of `pid`'s command line ('' once it is gone)."""
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children and theirs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_sampled(argv: list[str], interval: float = 0.1, rescan_every: int = 10, **popen) -> dict:
    """Run `argv` to its end, sampling its tree every `interval` s (finding the tree anew
    every `rescan_every` samples): {"returncode", "seconds", "cpu_seconds" (the whole tree's,
    each process counted once its parent has waited for it: how many cores the wall time
    kept busy), and `TreeSampler.result()`'s peaks in bytes}."""
    start, cpu = time.perf_counter(), _children_cpu()
    process = subprocess.Popen(argv, **popen)
    sampler = TreeSampler(process.pid)
    while process.poll() is None:
        sampler.sample(rescan=sampler.samples % rescan_every == 0)
        time.sleep(interval)
    return {"returncode": process.returncode, "seconds": time.perf_counter() - start,
            "cpu_seconds": _children_cpu() - cpu, **sampler.result()}


def _main() -> int:
    parser = argparse.ArgumentParser(description="Run a command; print its wall time and peak memory (total and anonymous).")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default 0.1)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    result = {"command": command, **run_sampled(command, args.interval)}
    gib = {k: round(v / 2**30, 3) for k, v in result.items() if k.startswith(("process_", "tree_"))}
    print(json.dumps({"seconds": round(result["seconds"], 2), "cpu_seconds": round(result["cpu_seconds"], 1),
                      "returncode": result["returncode"], **gib,
                      "largest_process": result["holders"].get("process_rss", {}).get("command")}), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result["returncode"]


if __name__ == "__main__":
    sys.exit(_main())
