"""Write CMF v2 files (spec §1-§6, §10).

Layout: envelope, header at 128, directory, weight blob at a 4096-aligned offset
(tensors on 64-byte boundaries, on 4096-byte boundaries from 16 KiB up, zero
padding), then masks, vocab. The sparse index is read-only (§7) and never written.

Tensors are streamed: each one is encoded, hashed and written as it arrives, so
memory holds one tensor at a time. The directory precedes the blob, so the blob's
offset depends on every name. For a sequence of tensors the names are known up
front and payloads go straight into the output file behind a reserved head; for any
other iterable (and for shards) they are staged in a temporary blob file that is
copied in-kernel behind the head at the end. Either way the output is a temporary
file in the destination directory, renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from manifests.output import temp_file_beside
from pipeline.ground.cmf.dtypes import DTYPES, DType, dtype_by_name, dtype_for_id
from pipeline.ground.cmf.errors import Parse
from pipeline.ground.cmf.hash64 import hash64
from pipeline.ground.cmf.masks import Masks, encode_masks
from pipeline.ground.cmf.reader import (
    DATA_ALIGN,
    DIR_PREFIX,
    DIR_RECORD,
    ENVELOPE_SIZE,
    FEATURE_BINARY_MASKS,
    FEATURE_LOOP_MASKS,
    FEATURE_QUANT_2F,
    FEATURE_TENSOR_DIR,
    MAGIC,
    MAX_NDIM,
    SHARD_NAME,
    TENSOR_ALIGN,
    VERSION,
    Envelope,
    shard_path,
)
from pipeline.ground.errors import OutputExists

LARGE_TENSOR = 16 * 1024  # tensors this big start on a page (spec §4)
_QUANT_2F_IDS = {dtype_by_name("q8_2f").id, dtype_by_name("vbit").id}
_MAX_NAME = 0xFFFF
_MAX_DIM = 0xFFFFFFFF
_COPY_CHUNK = 1 << 26
_LONGEST_DTYPE_NAME = max(len(dt.name) for dt in DTYPES.values())
# Header keys write_cmf fills itself; extra_header may not override them.
_OWN_KEYS = {
    "format", "version", "arch", "quant_type", "provenance", "tokenizer_config",
    "moe", "mtp", "skills", "shard", "section_hashes",
}  # fmt: skip


@dataclass(frozen=True)
class RawTensor:
    """An already-encoded payload, written as is (e.g. copied from another CMF file)."""

    name: str
    dtype_id: int
    shape: tuple[int, ...]
    payload: bytes | np.ndarray


@dataclass(frozen=True)
class Record:
    """One directory record; `off` is relative to the data section."""

    name: str
    dtype_id: int
    shape: tuple[int, ...]
    off: int
    nbytes: int
    hash64: int


def tensor_alignment(nbytes: int) -> int:
    return DATA_ALIGN if nbytes >= LARGE_TENSOR else TENSOR_ALIGN


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def encode_tensor(item: RawTensor | tuple) -> tuple[str, DType, tuple[int, ...], np.ndarray]:
    """(name, dtype, shape, uint8 payload) from `(name, array, dtype_name)` or a RawTensor.

    The payload is checked against the dtype's size rule, so a file this library
    writes always opens.
    """
    name = item.name if isinstance(item, RawTensor) else item[0]
    where = f"write_cmf: tensor {name!r}"
    try:
        name_len = len(name.encode("utf-8"))
    except (AttributeError, UnicodeEncodeError):
        name_len = 0
    if not 0 < name_len <= _MAX_NAME:
        raise Parse(f"{where}: a name must be a non-empty str of at most {_MAX_NAME} UTF-8 bytes")
    if isinstance(item, RawTensor):
        shape = tuple(int(d) for d in item.shape)
        dtype = dtype_for_id(item.dtype_id, where)
        payload = np.frombuffer(item.payload, np.uint8) if not isinstance(item.payload, np.ndarray) else item.payload
        payload = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    else:
        _, array, dtype_name = item
        dtype = dtype_by_name(dtype_name)
        if dtype.encode is None:
            raise Parse(f"{where}: dtype {dtype.name} has no encoder; pass a RawTensor")
        array = np.asarray(array)
        shape = tuple(array.shape)
        payload = np.ascontiguousarray(dtype.encode(array)).reshape(-1).view(np.uint8)
    if len(shape) > MAX_NDIM or any(not 0 <= d <= _MAX_DIM for d in shape):
        raise Parse(f"{where}: shape {shape} needs ndim <= {MAX_NDIM} and dims < 2^32")
    dtype.check_payload(payload, shape, where)
    return name, dtype, shape, payload


def pack_directory(records: list[Record]) -> bytes:
    """The binary directory (spec §3): prefix, 56-byte records, UTF-8 name pool (names checked by encode_tensor)."""
    names = [r.name.encode("utf-8") for r in records]
    rec = np.zeros(len(records), DIR_RECORD)
    rec["name_len"] = [len(n) for n in names]
    rec["name_off"] = np.cumsum([0] + [len(n) for n in names[:-1]]) if names else []
    rec["dtype"] = [r.dtype_id for r in records]
    rec["ndim"] = [len(r.shape) for r in records]
    for i, r in enumerate(records):
        rec["shape"][i, : len(r.shape)] = r.shape
    rec["off"] = [r.off for r in records]
    rec["nbytes"] = [r.nbytes for r in records]
    rec["hash"] = [r.hash64 for r in records]
    pool_off = DIR_PREFIX + rec.nbytes
    return struct.pack("<QQ", len(records), pool_off) + rec.tobytes() + b"".join(names)


def dump_header(header: dict) -> bytes:
    try:
        return json.dumps(header, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as error:
        raise Parse(f"write_cmf: header is not plain JSON: {error}") from None


@dataclass
class _Shard:
    """A blob being streamed into `file` from offset `start`, and its directory records.

    `file` is either the output file itself, with `start` the data_off reserved for
    the head (no copy later), or a staging file with `start` 0 (copied in later).
    """

    file: object  # binary file object
    start: int
    direct: bool
    records: list[Record] = field(default_factory=list)
    end: int = 0  # end of the last tensor, relative to the blob start

    def add(self, name: str, dtype: DType, shape: tuple[int, ...], payload: np.ndarray) -> None:
        off = round_up(self.end, tensor_alignment(payload.size))
        if off > self.end:
            self.file.write(bytes(off - self.end))
        self.file.write(memoryview(payload))
        self.records.append(Record(name, dtype.id, shape, off, payload.size, hash64(payload)))
        self.end = off + payload.size


def _copy_into(src, dst) -> None:
    """Append all of `src` to `dst`, in-kernel where the OS allows it."""
    src.flush()
    dst.flush()
    size, pos = os.fstat(src.fileno()).st_size, 0
    try:
        while pos < size:
            copied = os.copy_file_range(src.fileno(), dst.fileno(), min(_COPY_CHUNK, size - pos), pos)
            if copied == 0:
                break
            pos += copied
    except (AttributeError, OSError):
        pass  # no copy_file_range here (macOS, some filesystems): copy through user space
    if pos < size:
        src.seek(pos)
        dst.seek(0, os.SEEK_END)
        shutil.copyfileobj(src, dst, _COPY_CHUNK)
    dst.seek(0, os.SEEK_END)


def _head_size(header: dict, dir_len: int) -> int:
    """data_off for a header and a directory of these sizes: the first page after them."""
    return round_up(ENVELOPE_SIZE + len(dump_header(header)) + dir_len, DATA_ALIGN)


def assemble(dst, header: dict, shard: _Shard, sections: dict[str, bytes], features: int) -> None:
    """Complete one file in `dst`: envelope, header, directory, blob, then sections."""
    header_bytes = dump_header(header)
    dir_bytes = pack_directory(shard.records)
    dir_off = ENVELOPE_SIZE + len(header_bytes)
    data_off = round_up(dir_off + len(dir_bytes), DATA_ALIGN)
    if shard.direct:
        if data_off > shard.start:
            raise RuntimeError(f"write_cmf: head needs {data_off:#x} bytes, only {shard.start:#x} were reserved")
        data_off = shard.start
    data_len = shard.end
    offsets = {"masks": (0, 0), "vocab": (0, 0), "index": (0, 0)}
    pos = data_off + data_len
    for name, data in sections.items():
        offsets[name] = (pos, len(data))
        pos += len(data)
    env = Envelope(
        MAGIC, VERSION, 0, features,
        ENVELOPE_SIZE, len(header_bytes), dir_off, len(dir_bytes), data_off, data_len,
        *offsets["masks"], *offsets["vocab"], *offsets["index"],
        hash64(header_bytes), hash64(dir_bytes),
    )  # fmt: skip
    dst.seek(0)
    dst.write(env.pack() + header_bytes + dir_bytes + bytes(data_off - dir_off - len(dir_bytes)))
    if shard.direct:
        dst.seek(data_off + data_len)
    else:
        _copy_into(shard.file, dst)
    for data in sections.values():
        dst.write(data)
    dst.truncate()


def write_cmf(
    path: str | os.PathLike,
    *,
    arch: dict,
    tensors: Iterable[RawTensor | tuple],
    quant_type: str | None = None,
    provenance: dict | None = None,
    tokenizer_json: bytes | str | None = None,
    tokenizer_config: dict | None = None,
    masks: Masks | None = None,
    moe: dict | None = None,
    mtp: dict | None = None,
    skills: list[dict] | None = None,
    extra_header: dict | None = None,
    shard_max_mb: float | None = None,
    extra_features: int = 0,
    force: bool = False,
) -> list[Path]:
    """Write a CMF v2 file (or shards) and return the paths written.

    `tensors` yields `(name, float array, dtype_name)` (encoded with DTYPES) or
    `RawTensor`s, consumed one at a time. `quant_type` defaults to the dtype holding
    the most bytes. With `shard_max_mb`, blobs are split into
    `{stem}-{no:05}-of-{count:05}.cmf` files of at most that many MiB (a single larger
    tensor gets a shard of its own); shard 1 holds masks, vocab, tokenizer_config and
    skills. An existing output is refused unless `force`.

    When `tensors` is a sequence and no sharding is asked for, the directory size is
    known up front (names and count), so payloads are written straight behind a
    reserved head in the output file; otherwise they are staged and copied in-kernel.
    """
    path = Path(path)
    if not force and path.exists():
        raise OutputExists(f"{path}: already exists; pass force to overwrite")
    extra_header = dict(extra_header or {})
    clash = _OWN_KEYS & extra_header.keys()
    if clash:
        raise Parse(f"write_cmf: extra_header keys {sorted(clash)} are set by write_cmf itself")
    limit = None if shard_max_mb is None else int(shard_max_mb * (1 << 20))

    header = {"format": "cmf", "version": VERSION, "arch": arch, "quant_type": quant_type, "provenance": provenance or {}}
    if moe is not None:
        header["moe"] = moe
    if mtp is not None:
        header["mtp"] = mtp
    header.update(extra_header)
    features = FEATURE_TENSOR_DIR | extra_features
    sections: dict[str, bytes] = {}
    if masks is not None:
        features |= FEATURE_BINARY_MASKS
        if arch.get("num_loops", 1) > 1:
            features |= FEATURE_LOOP_MASKS
        sections["masks"] = encode_masks(masks, header, features)
    if tokenizer_json is not None:
        sections["vocab"] = tokenizer_json.encode("utf-8") if isinstance(tokenizer_json, str) else bytes(tokenizer_json)
    first_header = dict(header)
    if tokenizer_config is not None:
        first_header["tokenizer_config"] = tokenizer_config
    if skills:
        first_header["skills"] = skills
    if sections:
        first_header["section_hashes"] = {k: f"{hash64(v):016x}" for k, v in sections.items()}

    temps: list[Path] = []
    shards: list[_Shard] = []
    bytes_by_dtype: dict[str, int] = {}
    seen: set[str] = set()
    try:

        def new_file(tag: str):
            file = temp_file_beside(path, tag)  # closed in the finally below
            temps.append(Path(file.name))
            return file

        if limit is None and isinstance(tensors, Sequence):
            # An upper bound: the longest dtype name stands in for a derived quant_type.
            estimate = dict(first_header, quant_type=quant_type or "X" * _LONGEST_DTYPE_NAME)
            start = _head_size(estimate, _dir_len([t.name if isinstance(t, RawTensor) else t[0] for t in tensors]))
            shard = _Shard(new_file("tmp"), start, direct=True)
            shard.file.seek(start)
            shards.append(shard)
        else:
            shards.append(_Shard(new_file("blob"), 0, direct=False))
        shard = shards[0]
        for item in tensors:
            name, dtype, shape, payload = encode_tensor(item)
            if name in seen:
                raise Parse(f"write_cmf: duplicate tensor name '{name}'")
            seen.add(name)
            if limit is not None and shard.records and round_up(shard.end, 64) + payload.size > limit:
                shard = _Shard(new_file("blob"), 0, direct=False)
                shards.append(shard)
            shard.add(name, dtype, shape, payload)
            bytes_by_dtype[dtype.name] = bytes_by_dtype.get(dtype.name, 0) + payload.size

        count = len(shards)
        finals = [path] if count == 1 else [shard_path(_shard_base(path), no, count) for no in range(1, count + 1)]
        existing = [str(p) for p in finals if p.exists()]
        if existing and not force:
            raise OutputExists(f"{', '.join(existing)}: already exist(s); pass force to overwrite")

        header["quant_type"] = first_header["quant_type"] = quant_type or _main_dtype(bytes_by_dtype)
        outs = []
        for no, (shard, final) in enumerate(zip(shards, finals), start=1):
            shard_header = dict(first_header if no == 1 else header)
            if count > 1:
                shard_header["shard"] = {"no": no, "count": count}
            shard_features = features if no == 1 else features & ~(FEATURE_BINARY_MASKS | FEATURE_LOOP_MASKS)
            if _QUANT_2F_IDS & {r.dtype_id for r in shard.records}:
                shard_features |= FEATURE_QUANT_2F
            dst = shard.file if shard.direct else new_file("tmp")
            with dst:
                assemble(dst, shard_header, shard, sections if no == 1 else {}, shard_features)
                dst.flush()
                os.fsync(dst.fileno())
            outs.append((Path(dst.name), final))
        for tmp, final in outs:
            os.replace(tmp, final)
        return finals
    finally:
        for shard in shards:
            shard.file.close()
        for tmp in temps:
            tmp.unlink(missing_ok=True)


def _dir_len(names: list) -> int:
    pool = sum(len(n.encode("utf-8", "replace")) if isinstance(n, str) else 0 for n in names)
    return DIR_PREFIX + DIR_RECORD.itemsize * len(names) + pool


def _shard_base(path: Path) -> Path:
    """`dir/model.cmf` -> `dir/model`; a shard-style name keeps its base."""
    match = SHARD_NAME.match(path.name)
    return path.with_name(match["base"]) if match else path.with_suffix("")


def _main_dtype(bytes_by_dtype: dict[str, int]) -> str:
    if not bytes_by_dtype:
        return "NONE"
    return max(bytes_by_dtype, key=bytes_by_dtype.get).upper()

