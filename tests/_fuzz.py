"""Seeded mutation fuzzing, shared by the readers' fuzz tests and benchmarks/fuzz_bench.py.

A reader is run on mutants of a valid input. Each mutant must give a typed CmfdeployError
or a clean read (checked against an independent reader where one exists); anything else is
a defect: another exception, a hang (a per-mutant alarm), or a huge allocation (the loop runs
in a forked child whose address space is capped at what it had plus `memory` bytes, so an
oversized allocation fails there as MemoryError instead of taking the machine).
"""

import json
import os
import resource
import signal
import struct
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from pipeline.ground.errors import CmfdeployError

HANG_SECONDS = 10
MEMORY_BUDGET = 1 << 30  # far above any fixture reader's working set (a few MB), far below the machine
U64_INTERESTING = [0, 1, 63, 64, 4095, 4096, 2**31, 2**32 - 1, 2**32, 2**60, 2**63, 2**64 - 64, 2**64 - 1]
# Recorded names that must never be followed outside an artifact.
PATH_ATTACKS = ["..", "../manifest.json", "a/../../b", "/etc/passwd", "/", "", "C:\\x", "./../x", "x/" * 200]


@contextmanager
def deadline(seconds: int, what: str):
    def hang(signum, frame):
        raise TimeoutError(f"{what}: no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def interesting(old: int, size: int, rng: np.random.Generator) -> int:
    """A boundary value, a nearby value, an in-file offset, or `old` with one bit flipped."""
    choice = rng.integers(4)
    if choice == 0:
        return int(rng.choice(U64_INTERESTING))
    if choice == 1:
        return old + int(rng.integers(-4096, 4097))
    if choice == 2:
        return int(rng.integers(0, size + 1))
    return old ^ (1 << int(rng.integers(64)))


def mutate_bytes(data: bytes, rng: np.random.Generator, fields: list[tuple[int, str]] = ()) -> tuple[bytes, str]:
    """Flip bytes, truncate, insert junk, or set one integer field (`(offset, struct format)`,
    e.g. a header's length or a record's offset) to an interesting value."""
    buf, size = bytearray(data), len(data)
    kind = int(rng.integers(5 if fields else 4))
    if kind == 0:
        positions = rng.integers(0, size, int(rng.integers(1, 5)))
        for pos in positions:
            buf[pos] ^= int(rng.integers(1, 256))
        return bytes(buf), f"flip {positions.tolist()}"
    if kind == 1:
        cut = int(rng.integers(0, size))
        return bytes(buf[:cut]), f"truncate to {cut}"
    if kind == 2:
        extra = rng.integers(0, 256, int(rng.integers(1, 2000)), dtype=np.uint8).tobytes()
        at = int(rng.integers(0, size))
        return bytes(buf[:at] + extra + buf[at:]), f"insert {len(extra)} bytes at {at}"
    if kind == 3:
        off, fmt = int(rng.integers(0, max(size - 8, 1))), "<Q" if rng.integers(2) else "<I"
    else:
        off, fmt = fields[int(rng.integers(len(fields)))]
    width = struct.calcsize(fmt)
    if off + width > size:
        return bytes(buf), f"no-op field at {off}"
    value = interesting(struct.unpack_from(fmt, data, off)[0], size, rng) % (1 << 8 * width)
    struct.pack_into(fmt, buf, off, value)
    return bytes(buf), f"{fmt} at {off} = {value:#x}"


def _nodes(obj, path=()):
    yield path, obj
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        yield from _nodes(value, (*path, key))


def _odd_value(rng: np.random.Generator):
    choices = [None, True, 0, -1, 2**63, 2**64 + 1, 1.5, -1e308, "", "x" * 10000, [], [1, "a"], {}, {"k": None},
               *PATH_ATTACKS]
    return choices[int(rng.integers(len(choices)))]


def mutate_json(obj, rng: np.random.Generator) -> tuple[object, str]:
    """Delete a key or element, give a value another type, put a path attack into a string,
    or add a key; `obj` is copied first."""
    obj = json.loads(json.dumps(obj))
    nodes = list(_nodes(obj))
    path, value = nodes[int(rng.integers(len(nodes)))]
    if not path:
        obj[f"added_{int(rng.integers(100))}"] = _odd_value(rng)
        return obj, "added a top-level key"
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    kind = int(rng.integers(4))
    if kind == 0:
        del parent[key]
        return obj, f"deleted {list(path)}"
    if kind == 1 and isinstance(parent, dict):
        attack = PATH_ATTACKS[int(rng.integers(len(PATH_ATTACKS)))]
        parent[attack] = parent.pop(key)  # a key that names a file: files, weights, dims
        return obj, f"renamed {list(path)} to {attack!r}"
    if kind == 2 and isinstance(value, str):
        parent[key] = PATH_ATTACKS[int(rng.integers(len(PATH_ATTACKS)))]
        return obj, f"{list(path)} = {parent[key]!r}"
    parent[key] = _odd_value(rng)
    return obj, f"{list(path)} = {str(parent[key])[:40]!r}"


@dataclass
class Tally:
    reader: str
    mutants: int = 0
    typed: int = 0
    clean: int = 0
    defects: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"{self.reader}: {self.mutants} mutants, {self.typed} typed errors, {self.clean} clean reads, "
                f"{len(self.defects)} defects")


def _address_space() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _loop(reader: str, cases: int, seed: int, mutate, exercise, hang_seconds: int, memory: int) -> Tally:
    limit = _address_space() + memory
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    rng = np.random.default_rng(seed)
    tally = Tally(reader)
    for case in range(cases):
        mutant, what = mutate(rng)
        tally.mutants += 1
        try:
            with deadline(hang_seconds, f"case {case} ({what})"):
                exercise(mutant)
            tally.clean += 1
        except CmfdeployError:
            tally.typed += 1
        except BaseException as error:  # noqa: BLE001 - the point is to name any escape
            tally.defects.append(f"case {case} ({what}): {type(error).__name__}: {str(error)[:300]}"
                                 + (_where(error) if os.environ.get("FUZZ_TRACE") else ""))
    return tally


def fuzz(reader: str, cases: int, seed: int, mutate: Callable, exercise: Callable[[object], None],
         hang_seconds: int = HANG_SECONDS, memory: int = MEMORY_BUDGET) -> Tally:
    """Run `cases` mutants (`mutate(rng) -> (mutant, description)`, then `exercise(mutant)`,
    which raises AssertionError on a clean but wrong read) in a forked, memory-capped child."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, report as JSON, exit without running the parent's cleanup
        os.close(read_end)
        code = 0
        try:
            tally = _loop(reader, cases, seed, mutate, exercise, hang_seconds, memory)
            payload = json.dumps(tally.__dict__).encode()
        except BaseException as error:  # noqa: BLE001 - reported to the parent, which fails
            payload, code = json.dumps({"reader": reader, "crash": repr(error)}).encode(), 1
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(payload)
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        payload = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not payload:
        return Tally(reader, defects=[f"the fuzzing child died (wait status {status}) without reporting"])
    result = json.loads(payload)
    if "crash" in result:
        return Tally(reader, defects=[f"the fuzzing loop itself failed: {result['crash']}"])
    return Tally(**result)


def _where(error: BaseException) -> str:
    import traceback

    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f" [at {frame.filename}:{frame.lineno}]"
