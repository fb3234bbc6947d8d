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
name and renamed into place: a reader finds a whole entry or none, and of two workers that
made the same entry at once, the later keeps its own result and drops its copy. Arrays come
back as read-only maps of the files (a 1 GB Hessian set is the page cache's, shared by every
worker that reads it).
"""

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
        """(arrays, record) stored under `key`, made by `make` and stored on a miss."""
        entry = self.folder / key
        if not entry.is_dir():
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
                # another worker stored the same result first: this one's is equal, and kept
            return arrays, record
        record = json.loads((entry / "record.json").read_text())
        return {path.stem: np.load(path, mmap_mode="r", allow_pickle=False) for path in entry.glob("*.npy")}, record
