"""Measurements one survey's recipes would each make again, shared through a folder: the
calibration Hessians (every GPTQ recipe and `mixed` gathers the same ones) and GPTQ codes
(`mixed` codes every option's weights as the uniform recipes do).

    cache = ResultCache(folder)
    key = content_key("gptq", step.record(), weight, hessian)    # sha256 of what it is made from
    arrays = cache.arrays(key, make)                              # make() runs only on a miss

An entry is named by the sha256 of everything its result is computed from (the input
arrays' bytes, the parameters, and the source of the code that computes it), so a stale or
foreign entry is never found: only the result the same computation would give again. It is
a folder of .npy files (no pickle) and a JSON record of the rest, written under a temporary
name and renamed into place: a reader finds a whole entry or none. A worker that wants an
entry another is making waits for it (`ResultCache.arrays`). Arrays come
back as read-only maps of the files (a 1 GB Hessian set is the page cache's, shared by every
worker that reads it).
"""

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

# The source of the code whose results are cached: an entry made by other code is not found.
_SOURCES = ("codes.py", "calibration.py", "recipes/gptq.py", "recipes/hot_rows.py", "recipes/affine.py")
CODE_DIGEST = hashlib.sha256(b"".join((Path(__file__).parent / name).read_bytes() for name in _SOURCES)).hexdigest()


def content_key(*parts) -> str:
    """sha256 over `parts` (arrays by dtype, shape and bytes; anything else as canonical JSON) and CODE_DIGEST."""
    digest = hashlib.sha256(CODE_DIGEST.encode())
    for part in parts:
        if isinstance(part, np.ndarray):
            array = np.ascontiguousarray(part)
            digest.update(f"{array.dtype.str}{array.shape}".encode())
            digest.update(memoryview(array.reshape(-1).view(np.uint8)))
        else:
            digest.update(json.dumps(part, sort_keys=True).encode())
    return digest.hexdigest()


class ResultCache:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def arrays(self, key: str, make: Callable[[], tuple[dict[str, np.ndarray], dict]]) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, record) stored under `key`, made by `make` and stored on a miss.

        One worker makes an entry while the others that want it wait for it (a lock file per
        key): a survey's two workers both start with GPTQ recipes, and each made the same
        Hessians beside the other (Gemma 3: minutes of both cores). Where the lock does not
        reach (a folder shared by several machines), the rename below still keeps one whole
        entry."""
        entry = self.folder / key
        if not entry.is_dir():
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f".{key}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not entry.is_dir():
                    return self._store(key, entry, make)
        record = json.loads((entry / "record.json").read_text())
        return {path.stem: np.load(path, mmap_mode="r", allow_pickle=False) for path in entry.glob("*.npy")}, record

    def _store(self, key: str, entry: Path, make: Callable[[], tuple[dict[str, np.ndarray], dict]]):
        arrays, record = make()
        staging = self.folder / f".{key}.{os.getpid()}"
        staging.mkdir(parents=True)
        for name, array in arrays.items():
            np.save(staging / f"{name}.npy", np.ascontiguousarray(array), allow_pickle=False)
        (staging / "record.json").write_text(json.dumps(record, sort_keys=True))
        try:
            staging.rename(entry)
        except OSError:
            shutil.rmtree(staging)
            if not entry.is_dir():
                raise
            # another machine stored the same result first: this one's is equal, and kept
        return arrays, record
