"""Arrays a stage computes once and then only reads, held in an unlinked scratch file and read
back through a map, as the bundle's weights are.

    scratch = ScratchFile()
    decoded = scratch.hold(decode(constant))   # a view of the file's map; the array itself can go

A decoded weight (a compressed package's constants as the executor and the gate's reference
each decode them) is as large as the model, and a gate's logits of a long case are 1 GB a
side on a 262k vocabulary. Held as the process's own memory, they and the conversion's copies
came to 4-10 times the weights in a survey worker (docs/MEMORY.md). Written to a file's shared
map, their pages are the page cache's: written back to disk by the kernel, dropped under
memory pressure and read again, never swapped, so a stage's private memory stays bounded by
what it computes at a time.

The file is unlinked from the start (`tempfile.TemporaryFile`), so nothing is left behind by a
process that dies, and sparse: it is mapped a segment of address space at a time, one map
(and one file descriptor) per segment however many arrays it holds, and only what is written
takes disk. It lies in the temp folder (TMPDIR): on a tmpfs that is memory too, and the
sampler counts it as shared memory.
"""

import os
import tempfile

import numpy as np

from pipeline.ground.errors import CmfdeployError

# Each array starts on a page of its own.
PAGE = 4096
# Address space one map of the file reserves (never memory or disk until written).
SEGMENT = 1 << 30


class ScratchSpace(CmfdeployError):
    """The temp folder has no room for an array a stage holds in scratch."""


class ScratchFile:
    """An unlinked sparse file that arrays are written into through shared maps; what `hold` and
    `empty` return are views of those maps, which keep them (and the file) alive."""

    def __init__(self, directory: str | None = None):
        self._directory = directory or tempfile.gettempdir()
        self._file = tempfile.TemporaryFile(prefix="cmfdeploy-scratch-", dir=directory)
        self._segment: np.memmap | None = None
        self._used = 0
        self._file_end = 0

    def hold(self, array: np.ndarray) -> np.ndarray:
        """`array`'s values in this file (the array itself is not kept)."""
        array = np.asarray(array)
        out = self.empty(array.shape, array.dtype)
        out[...] = array
        return out

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An array of `shape` and `dtype` in this file, to be written (unwritten, it reads as zeros)."""
        dtype = np.dtype(dtype)
        return self._room(int(np.prod(shape)) * dtype.itemsize).view(dtype).reshape(shape)

    def _room(self, nbytes: int) -> np.ndarray:
        """`nbytes` of the map, page-aligned, in the current segment or a new one."""
        start = -(-self._used // PAGE) * PAGE
        if self._segment is None or start + nbytes > len(self._segment):
            size = max(SEGMENT, -(-nbytes // PAGE) * PAGE)
            os.ftruncate(self._file.fileno(), self._file_end + size)
            self._segment = np.memmap(self._file, np.uint8, mode="r+", offset=self._file_end, shape=(size,))
            self._file_end += size
            start = 0
        if nbytes:
            # The disk blocks are taken now: a sparse file's page written through the map where
            # the disk is full kills the process with SIGBUS, naming nothing.
            at = self._file_end - len(self._segment) + start
            try:
                os.posix_fallocate(self._file.fileno(), at, nbytes)
            except OSError as error:
                raise ScratchSpace(f"{self._directory}: no room for {nbytes} bytes of scratch (a file there already "
                                   f"holds {at} bytes): {error.strerror}; free space there, or point TMPDIR at a "
                                   "folder with more") from error
        self._used = start + nbytes
        return np.asarray(self._segment[start:start + nbytes])
