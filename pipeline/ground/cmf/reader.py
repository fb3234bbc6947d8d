"""Open a CMF v2 file: validate its structure and expose the directory (spec §1-§7, §10).

`open_cmf` memory-maps the file and checks everything that can be checked without a
pass over the weight blob: the envelope, every section's bounds, the directory
records (names, dtypes, shapes, offsets, size rules), the header JSON, the masks
section and the sparse index. Open therefore costs O(directory), never O(weights);
tensor hashes are checked on demand by `verify_cmf`. A file either opens or raises a
`CmfError` subclass naming the file, the item and the offending value in hex.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.ground.cmf.dtypes import DType, dtype_for_id
from pipeline.ground.cmf.errors import Bounds, InvalidMagic, Parse, ShardError, UnsupportedFeature, UnsupportedVersion
from pipeline.ground.cmf.masks import Masks, parse_masks, parse_sparse_index

MAGIC = b"CMF\x01"
VERSION = 2
ENVELOPE_SIZE = 128
DATA_ALIGN = 4096
TENSOR_ALIGN = 64
MAX_NDIM = 6
U64_MAX = (1 << 64) - 1

FEATURE_TENSOR_DIR = 1 << 0
FEATURE_BINARY_MASKS = 1 << 1
FEATURE_QUANT_2F = 1 << 2
FEATURE_LOOP_MASKS = 1 << 5
FEATURE_SKILL_FILE = 1 << 6
# Bits 3 (DELTA_MASKS) and 4 (HOT_PACKS) are reserved: no reader implements them.
KNOWN_FEATURES = (
    FEATURE_TENSOR_DIR | FEATURE_BINARY_MASKS | FEATURE_QUANT_2F | FEATURE_LOOP_MASKS | FEATURE_SKILL_FILE
)

# Envelope: magic, version, flags, required_features, six (off, len) pairs, header_hash, dir_hash.
_ENVELOPE = struct.Struct("<4sIII14Q")
SECTIONS = ("header", "dir", "data", "masks", "vocab", "index")
# Sections whose hash lives in the header's `section_hashes` (header and dir are in the envelope).
HASHED_SECTIONS = ("masks", "vocab", "index")

DIR_PREFIX = 16
DIR_RECORD = np.dtype(
    [
        ("name_off", "<u4"),
        ("name_len", "<u2"),
        ("dtype", "u1"),
        ("ndim", "u1"),
        ("shape", "<u4", (MAX_NDIM,)),
        ("off", "<u8"),
        ("nbytes", "<u8"),
        ("hash", "<u8"),
    ]
)
assert DIR_RECORD.itemsize == 56

SHARD_NAME = re.compile(r"^(?P<base>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.cmf$")


def shard_path(base: Path, no: int, count: int) -> Path:
    """`{base}-{no:05}-of-{count:05}.cmf` next to `base` (spec §10); `base` has no suffix."""
    return base.with_name(f"{base.name}-{no:05d}-of-{count:05d}.cmf")


@dataclass(frozen=True)
class Envelope:
    magic: bytes
    version: int
    flags: int
    required_features: int
    header_off: int
    header_len: int
    dir_off: int
    dir_len: int
    data_off: int
    data_len: int
    masks_off: int
    masks_len: int
    vocab_off: int
    vocab_len: int
    index_off: int
    index_len: int
    header_hash: int
    dir_hash: int

    @classmethod
    def unpack(cls, buf) -> Envelope:
        return cls(*_ENVELOPE.unpack_from(buf, 0))

    def pack(self) -> bytes:
        return _ENVELOPE.pack(*(getattr(self, f) for f in self.__dataclass_fields__))

    def section(self, name: str) -> tuple[int, int]:
        return getattr(self, f"{name}_off"), getattr(self, f"{name}_len")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    off: int  # absolute offset in the file that holds it
    nbytes: int
    hash64: int
    shard_no: int


class _Container:
    """One validated file of a (possibly sharded) model: its mmap, envelope, header and directory."""

    def __init__(self, path: Path):
        self.path = path
        self.label = path.name
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < ENVELOPE_SIZE:
                    raise Bounds(f"{self.label}: file is {size:#x} bytes, shorter than the {ENVELOPE_SIZE:#x}-byte envelope")
                self.mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as error:
            raise Bounds(f"{self.label}: cannot map file: {error.strerror}") from None
        self.size = size
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)
        try:
            self.envelope = self._check_envelope()
            self.header = self._parse_header()
            self.records = self._parse_directory()
        except BaseException:
            self.close()
            raise

    # -- envelope and sections

    def _check_envelope(self) -> Envelope:
        env = Envelope.unpack(self.mm)
        if env.magic != MAGIC:
            raise InvalidMagic(f"{self.label}: magic {env.magic.hex()} is not {MAGIC.hex()} (CMF\\x01)")
        if env.version != VERSION:
            raise UnsupportedVersion(f"{self.label}: version {env.version:#x}, only {VERSION} is supported")
        unknown = env.required_features & ~KNOWN_FEATURES
        if unknown:
            raise UnsupportedFeature(
                f"{self.label}: required_features {env.required_features:#x} has unsupported bits {unknown:#x}"
            )
        for name in SECTIONS:
            off, length = env.section(name)
            if length == 0 and name in ("header", "dir"):
                raise Bounds(f"{self.label}: section '{name}' has length 0")
            if length == 0:
                continue
            if off + length > U64_MAX:
                raise Bounds(f"{self.label}: section '{name}' off {off:#x} + len {length:#x} overflows u64")
            if off + length > self.size:
                raise Bounds(
                    f"{self.label}: section '{name}' [{off:#x}, {off + length:#x}) ends past end of file {self.size:#x}"
                )
        if env.data_off % DATA_ALIGN:
            raise Bounds(f"{self.label}: data_off {env.data_off:#x} is not a multiple of {DATA_ALIGN:#x}")
        return env

    def section(self, name: str) -> np.ndarray:
        """Zero-copy bytes of a section; empty when absent."""
        off, length = self.envelope.section(name)
        return self.buf[off : off + length]

    # -- header

    def _parse_header(self) -> dict:
        raw = self.section("header")
        try:
            header = json.loads(raw.tobytes().decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as error:
            raise Parse(f"{self.label}: header JSON at {self.envelope.header_off:#x}: {error}") from None
        if not isinstance(header, dict):
            raise Parse(f"{self.label}: header JSON is a {type(header).__name__}, not an object")
        if not isinstance(header.get("arch"), dict):
            raise Parse(f"{self.label}: header 'arch' is {_short(header.get('arch'))}, not an object")
        for key in ("tokenizer_config", "moe", "mtp"):
            if header.get(key) is not None and not isinstance(header[key], dict):
                raise Parse(f"{self.label}: header '{key}' is {_short(header[key])}, not an object or null")
        hashes = header.get("section_hashes")
        if hashes is not None:
            if not isinstance(hashes, dict):
                raise Parse(f"{self.label}: header 'section_hashes' is {_short(hashes)}, not an object")
            for key in HASHED_SECTIONS:
                if key in hashes:
                    parse_hex64(hashes[key], f"{self.label}: section_hashes['{key}']")
        shard = header.get("shard")
        if shard is not None:
            ok = isinstance(shard, dict) and all(type(shard.get(k)) is int for k in ("no", "count"))
            if not ok or not 1 <= shard["no"] <= shard["count"]:
                raise Parse(f"{self.label}: header 'shard' is {_short(shard)}, not {{no, count}} with 1 <= no <= count")
        skills = header.get("skills")
        if skills is not None and not (
            isinstance(skills, list) and all(isinstance(s, dict) and isinstance(s.get("id"), str) for s in skills)
        ):
            raise Parse(f"{self.label}: header 'skills' is {_short(skills)}, not a list of objects with a string 'id'")
        return header

    @property
    def shard(self) -> tuple[int, int] | None:
        shard = self.header.get("shard")
        return None if shard is None else (shard["no"], shard["count"])

    # -- directory

    def _parse_directory(self) -> list[tuple[str, DType, tuple[int, ...], int, int, int]]:
        """(name, dtype, shape, absolute off, nbytes, hash) per record, all checks done."""
        env, label = self.envelope, self.label
        dir_bytes = self.section("dir")
        if dir_bytes.size < DIR_PREFIX:
            raise Bounds(f"{label}: directory length {dir_bytes.size:#x} is shorter than its {DIR_PREFIX}-byte prefix")
        count, pool_off = struct.unpack_from("<QQ", dir_bytes, 0)
        records_end = DIR_PREFIX + DIR_RECORD.itemsize * count
        if records_end > dir_bytes.size:
            raise Bounds(f"{label}: directory count {count:#x} needs {records_end:#x} bytes, dir_len is {dir_bytes.size:#x}")
        if not records_end <= pool_off <= dir_bytes.size:
            raise Bounds(f"{label}: directory pool_off {pool_off:#x} outside [{records_end:#x}, {dir_bytes.size:#x}]")
        rec = np.frombuffer(dir_bytes, dtype=DIR_RECORD, count=count, offset=DIR_PREFIX)
        pool = dir_bytes[pool_off:]

        # Vectorised structural checks first; each reports its first offender by index.
        def first(mask) -> int | None:
            hit = np.flatnonzero(mask)
            return int(hit[0]) if hit.size else None

        bad = first(rec["ndim"] > MAX_NDIM)
        if bad is not None:
            raise Parse(f"{label}: tensor #{bad}: ndim {rec['ndim'][bad]} > {MAX_NDIM}")
        name_end = rec["name_off"].astype(np.uint64) + rec["name_len"]
        bad = first((name_end > pool.size) | (rec["name_len"] == 0))
        if bad is not None:
            raise Bounds(
                f"{label}: tensor #{bad}: name [{rec['name_off'][bad]:#x}, +{rec['name_len'][bad]:#x}) "
                f"outside the name pool of {pool.size:#x} bytes"
            )
        padded = np.arange(MAX_NDIM)[None, :] >= rec["ndim"][:, None]
        bad = first((rec["shape"] * padded).any(axis=1))
        if bad is not None:
            raise Parse(f"{label}: tensor #{bad}: shape padding past ndim {rec['ndim'][bad]} is not zero")

        names = []
        seen = set()
        for i in range(count):
            start = int(rec["name_off"][i])
            try:
                name = pool[start : start + int(rec["name_len"][i])].tobytes().decode("utf-8")
            except UnicodeDecodeError:
                raise Parse(f"{label}: tensor #{i}: name is not UTF-8 (at dir+{pool_off + start:#x})") from None
            if name in seen:
                raise Parse(f"{label}: tensor #{i}: duplicate name '{name}'")
            seen.add(name)
            names.append(name)

        bad = first(rec["off"] % TENSOR_ALIGN != 0)
        if bad is not None:
            raise Bounds(f"{label}: tensor '{names[bad]}' off {rec['off'][bad]:#x} is not a multiple of {TENSOR_ALIGN}")
        # off + nbytes > data_len, written so that it cannot wrap in u64.
        data_len = np.uint64(env.data_len)
        bad = first((rec["nbytes"] > data_len) | (rec["off"] > data_len - np.minimum(rec["nbytes"], data_len)))
        if bad is not None:
            end = int(rec["off"][bad]) + int(rec["nbytes"][bad])
            raise Bounds(f"{label}: tensor '{names[bad]}' ends at {end:#x} past data_len {env.data_len:#x}")

        out = []
        for i, name in enumerate(names):
            where = f"{label}: tensor '{name}'"
            dtype = dtype_for_id(int(rec["dtype"][i]), where)
            shape = tuple(int(d) for d in rec["shape"][i][: rec["ndim"][i]])
            off = env.data_off + int(rec["off"][i])
            nbytes = int(rec["nbytes"][i])
            # Reads only fixed-size arithmetic, or vbit's width header (one byte per row).
            dtype.check_payload(self.buf[off : off + nbytes], shape, where)
            out.append((name, dtype, shape, off, nbytes, int(rec["hash"][i])))
        return out

    def close(self) -> None:
        self.buf = None
        try:
            self.mm.close()
        except BufferError:
            # Views handed out by raw()/decode() still reference the map; it is
            # unmapped when the last of them is garbage-collected.
            pass


def parse_hex64(value, where: str) -> int:
    if not (isinstance(value, str) and re.fullmatch(r"[0-9a-fA-F]{1,16}", value)):
        raise Parse(f"{where} is {_short(value)}, not a hex u64 string")
    return int(value, 16)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class CmfFile:
    """An open CMF model: one file, or shard 1 with its siblings merged (spec §10)."""

    def __init__(self, containers: list[_Container]):
        self._containers = containers
        first = containers[0]
        self.path = first.path
        self.paths = [c.path for c in containers]
        self.envelope = first.envelope
        self.header = first.header
        self.arch = first.header["arch"]
        self.required_features = first.envelope.required_features
        self.tensors: dict[str, TensorInfo] = {}
        for shard_no, container in enumerate(containers, start=1):
            for name, dtype, shape, off, nbytes, h in container.records:
                if name in self.tensors:
                    raise ShardError(
                        f"{container.label}: tensor '{name}' is also in shard {self.tensors[name].shard_no}"
                    )
                self.tensors[name] = TensorInfo(name, dtype, shape, off, nbytes, h, shard_no)
        self.masks: Masks | None = None
        if first.envelope.masks_len:
            self.masks = parse_masks(first.section("masks"), self.header, self.required_features, first.label)
        self.sparse_index: list[dict] | None = None
        if first.envelope.index_len:
            self.sparse_index = parse_sparse_index(first.section("index"), first.label)

    # -- metadata

    @property
    def is_skill_file(self) -> bool:
        return bool(self.required_features & FEATURE_SKILL_FILE)

    @property
    def moe(self) -> dict | None:
        """The MoE block: top-level per spec §2.2; some writers nest it in `arch`."""
        return self.header.get("moe") or self.arch.get("moe")

    @property
    def tokenizer_config(self) -> dict | None:
        return self.header.get("tokenizer_config")

    @property
    def skills(self) -> list[dict]:
        return self.header.get("skills") or []

    @property
    def vocab(self) -> bytes | None:
        data = self._containers[0].section("vocab")
        return data.tobytes() if data.size else None

    def section_bytes(self, name: str, shard_no: int = 1) -> np.ndarray:
        """Zero-copy bytes of a section of one file (`header`, `dir`, `data`, `masks`, `vocab`, `index`)."""
        if name not in SECTIONS:
            raise KeyError(f"unknown section {name!r}; sections are {SECTIONS}")
        return self._containers[shard_no - 1].section(name)

    def envelope_of(self, shard_no: int) -> Envelope:
        return self._containers[shard_no - 1].envelope

    def header_of(self, shard_no: int) -> dict:
        return self._containers[shard_no - 1].header

    # -- tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path.name}: no tensor named {name!r}") from None

    def raw(self, name: str) -> np.ndarray:
        """The payload bytes of a tensor: a zero-copy uint8 view over the mmap."""
        info = self.info(name)
        return self._containers[info.shard_no - 1].buf[info.off : info.off + info.nbytes]

    def evict(self, name: str) -> None:
        """Drop the pages of a tensor's payload from this process's resident set once the
        caller holds its own copy (a runtime that copies weights out of the map would
        otherwise hold them twice while loading). The map is read-only and file-backed, so
        a later read faults the same bytes back in; pages shared with a neighbour go too."""
        info = self.info(name)
        container = self._containers[info.shard_no - 1]
        start = info.off - info.off % mmap.PAGESIZE
        container.mm.madvise(mmap.MADV_DONTNEED, start, info.off + info.nbytes - start)

    def parts(self, name: str) -> dict[str, np.ndarray]:
        info = self.info(name)
        return info.dtype.parts(self.raw(name), info.shape, self._where(info))

    def decode(self, name: str) -> np.ndarray:
        """float32 array of the directory shape."""
        info = self.info(name)
        return info.dtype.decode(self.raw(name), info.shape, self._where(info))

    def _where(self, info: TensorInfo) -> str:
        return f"{self._containers[info.shard_no - 1].label}: tensor '{info.name}'"

    # -- lifetime

    def close(self) -> None:
        for container in self._containers:
            container.close()

    def __enter__(self) -> CmfFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CmfFile({str(self.path)!r}, {len(self.tensors)} tensors, {len(self.paths)} file(s))"


def open_cmf(path: str | os.PathLike) -> CmfFile:
    """Open and validate a CMF v2 file; any shard name resolves to shard 1 and merges its siblings.

    A file whose header says it is shard k > 1 but whose name does not follow
    `{base}-{no:05}-of-{count:05}.cmf` cannot lead back to shard 1, so it is refused
    (`ShardError`: it cannot be opened directly).
    """
    path = Path(path)
    match = SHARD_NAME.match(path.name)
    if match is None:
        container = _Container(path)
        shard = container.shard
        if shard is None or shard == (1, 1):
            return _build([container])
        container.close()
        no, count = shard
        if no != 1:
            raise ShardError(
                f"{path.name}: header says shard {no} of {count}; open shard 1 "
                f"(named '<base>-00001-of-{count:05d}.cmf') instead"
            )
        raise ShardError(
            f"{path.name}: shard 1 of {count}, but the name does not follow "
            f"'<base>-NNNNN-of-{count:05d}.cmf', so its siblings cannot be found"
        )

    base = path.with_name(match["base"])
    count = int(match["count"])
    containers: list[_Container] = []
    try:
        for no in range(1, count + 1):
            sibling = shard_path(base, no, count)
            if not sibling.exists():
                raise ShardError(f"{path.name}: sibling shard {sibling.name} is missing")
            container = _Container(sibling)
            containers.append(container)
            if container.shard != (no, count):
                raise ShardError(
                    f"{sibling.name}: header 'shard' is {container.header.get('shard')}, "
                    f"the name says {{'no': {no}, 'count': {count}}}"
                )
            _check_sibling(containers[0], container)
        return _build(containers)
    except BaseException:
        for container in containers:
            container.close()
        raise


def _check_sibling(first: _Container, other: _Container) -> None:
    if other is first:
        return
    if other.header["arch"] != first.header["arch"]:
        raise ShardError(f"{other.label}: header 'arch' differs from shard 1's ({first.label})")
    for name in HASHED_SECTIONS:
        if other.envelope.section(name)[1]:
            raise ShardError(f"{other.label}: holds a '{name}' section; only shard 1 may (spec §10)")
    for key in ("tokenizer_config", "skills"):
        if other.header.get(key):
            raise ShardError(f"{other.label}: header holds '{key}'; only shard 1 may (spec §10)")


def _build(containers: list[_Container]) -> CmfFile:
    try:
        return CmfFile(containers)
    except BaseException:
        for container in containers:
            container.close()
        raise
