"""Peak disk of one stage, as a multiple of the model's FP32 weight bytes (W): what
`manifests.disk.DISK_NEEDS` bounds, checked against a real run (docs/DISK.md).

    python benchmarks/disk_peaks.py --bundle build/M/bundle --watch /tmp/d -- coreml build/M/bundle -o /tmp/d/coreml ...

runs `python -m pipeline.cli ARGS...` with a fresh TMPDIR and, every `--interval` seconds,
counts the disk the stage holds: the blocks of every file under the watched folders and the
temp folder, and of every file the stage's processes hold open after unlinking it (the gates'
scratch files, `pipeline.ground.scratch`, which no folder walk sees), each file once. It prints
the peak over what the folders held before the run, and that peak / W, W being the size of the
bundle's weights.safetensors. A file that lives shorter than the interval may be missed, so the
peak is a lower bound of the true one: the bounds are derived from what a stage writes and
only checked against it.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rss import process_tree  # noqa: E402 - a sibling benchmark module, not an installed one

ROOT = Path(__file__).resolve().parents[1]


def _held_blocks(path: Path, seen: set) -> int:
    """Disk taken by the file at `path` (allocated blocks, so a sparse scratch file counts what
    is written), unless (device, inode) is in `seen`."""
    try:
        stat = os.stat(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError, ProcessLookupError):
        return 0
    key = (stat.st_dev, stat.st_ino)
    if key in seen or not os.path.isfile(path):
        return 0
    seen.add(key)
    return stat.st_blocks * 512


def disk_held(folders: list[Path], pids: list[int]) -> int:
    """Bytes held by files under `folders` and by unlinked files that `pids` hold open."""
    seen: set = set()
    total = 0
    for folder in folders:
        for where, _, names in os.walk(folder):
            total += sum(_held_blocks(Path(where) / name, seen) for name in names)
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        try:
            links = list(fds.iterdir())
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
        for link in links:
            try:
                unlinked = os.readlink(link).endswith(" (deleted)")
            except OSError:
                continue
            if unlinked:
                total += _held_blocks(link, seen)
    return total


def measure(args: list[str], watch: list[Path], interval: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="disk-peaks-tmp-") as temp:
        folders = [*watch, Path(temp)]
        before = disk_held(folders, [])
        env = {**os.environ, "TMPDIR": temp, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        start = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, env=env)
        peak, samples = before, 0
        while process.poll() is None:
            peak = max(peak, disk_held(folders, process_tree(process.pid)))
            samples += 1
            time.sleep(interval)
        after = disk_held(folders, [])
    return {"returncode": process.returncode, "seconds": round(time.perf_counter() - start, 1), "samples": samples,
            "peak_bytes": peak - before, "left_bytes": after - before}


def main() -> int:
    parser = argparse.ArgumentParser(description="Peak disk of a cmfdeploy stage, as a multiple of W.")
    parser.add_argument("--bundle", type=Path, required=True, help="the model's bundle (W: its weights.safetensors)")
    parser.add_argument("--watch", type=Path, action="append", required=True,
                        help="a folder the stage writes under (its output's parent); repeatable")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between samples (default 0.2)")
    parser.add_argument("--json", type=Path, help="append the result here as one JSON line")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the pipeline.cli arguments")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no stage command given")
    for folder in args.watch:
        folder.mkdir(parents=True, exist_ok=True)
    weights = (args.bundle / "weights.safetensors").stat().st_size
    result = {"stage": command[0], "command": command, "weight_bytes": weights,
              **measure(command, args.watch, args.interval)}
    result["peak_over_w"] = round(result["peak_bytes"] / weights, 3)
    result["left_over_w"] = round(result["left_bytes"] / weights, 3)
    print(json.dumps({k: result[k] for k in ("stage", "returncode", "seconds", "weight_bytes", "peak_bytes",
                                             "peak_over_w", "left_bytes", "left_over_w")}))
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(result) + "\n")
    return result["returncode"]


if __name__ == "__main__":
    sys.exit(main())
