"""Seeded mutation fuzzing of every reader beyond CMF, at scale: counts per reader.

Builds the default fixture's bundle, chunk-KV package and its gate in a temporary folder, then runs
`--cases` mutants (default 1,000) per reader of tests/_fuzz_targets.py, each in a forked,
memory-capped child with a per-mutant alarm (tests/_fuzz.py), and prints per reader the
mutants, typed errors, clean reads and defects (anything else: another exception, a hang,
a huge allocation, a clean read that disagrees with an independent reader). Exit status 1
when any reader has a defect. `make test` runs a seeded 100 per reader
(tests/test_fuzz_readers.py).

    nice -n 10 python benchmarks/fuzz_bench.py [--cases 1000] [--seed 0] [--readers mlmodel ...]
"""

import argparse
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _fuzz import fuzz  # noqa: E402
from _fuzz_targets import TARGETS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0, help="added to each reader's own seed")
    parser.add_argument("--readers", nargs="+", choices=sorted(TARGETS), default=sorted(TARGETS))
    args = parser.parse_args()

    from coreml.convert import export_coreml
    from pipeline.stages.gates import align_package
    from pipeline.stages.bundle import export_bundle

    defects = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        bundle = export_bundle(ROOT / "fixtures" / "botchan-llama-1m.cmf", tmp / "bundle").path
        packages = tmp / "coreml"
        export_coreml(bundle, packages, kinds=("chunk_kv",))
        align_package(packages / "chunk_kv", ROOT / "fixtures" / "reference", tmp / "gate")
        artifacts = {"bundle": bundle, "package": packages / "chunk_kv", "gate": tmp / "gate"}
        for reader in args.readers:
            work = tmp / "work" / reader
            work.mkdir(parents=True)
            mutate, exercise = TARGETS[reader](artifacts, work)
            start = time.perf_counter()
            tally = fuzz(reader, args.cases, zlib.crc32(reader.encode()) + args.seed, mutate, exercise)
            print(f"{tally.line()} ({time.perf_counter() - start:.1f} s)", flush=True)
            for defect in tally.defects[:20]:
                print(f"    {defect}")
            defects += len(tally.defects)
    print(f"total defects: {defects}")
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
