"""Arrays a stage computes once and then only reads, held in an unlinked scratch file and read
back through a map, as the bundle's weights are.

    scratch = ScratchFile()
    decoded = scratch.hold(decode(constant))   # a read-mostly np.memmap; the array itself can go

A decoded weight (a compressed package's constants as the executor and the gate's reference
each decode them) is as large as the model. Held as the process's own memory, two of them and
the conversion's copies came to 4-10 times the weights in a survey worker (docs/MEMORY.md).
Written once to a file and mapped, their pages are the page cache's: clean, shared, dropped
under memory pressure and read again from disk, never swapped, so a stage's private memory
stays bounded by what it computes at a time.

The file is unlinked from the start (`tempfile.TemporaryFile`), so nothing is left behind by a
process that dies; each map holds it open for as long as the array lives. It lies in the temp
folder (TMPDIR): on a tmpfs that is memory too, and the sampler counts it as shared memory.
"""

import tempfile

import numpy as np

# Each array starts on a page of its own: the map of one never shares a page with the next.
PAGE = 4096


class ScratchFile:
    """An unlinked file that arrays are appended to and read back from through copy-on-write
    maps (writable as torch wants them; a write would copy only its page, never reach the file)."""

    def __init__(self, directory: str | None = None):
        self._file = tempfile.TemporaryFile(prefix="cmfdeploy-scratch-", dir=directory)
        self._end = 0

    def hold(self, array: np.ndarray) -> np.ndarray:
        """`array`'s values as a map of this file (the array itself is not kept)."""
        array = np.ascontiguousarray(array)
        if array.nbytes == 0:
            return array
        offset = -(-self._end // PAGE) * PAGE
        self._file.seek(offset)
        self._file.write(memoryview(array).cast("B"))
        self._file.flush()
        self._end = offset + array.nbytes
        return np.memmap(self._file, dtype=array.dtype, mode="c", offset=offset, shape=array.shape)
