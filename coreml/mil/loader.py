"""Read a saved `.mlpackage` into plain Python objects: the spec protobuf plus its weight blobs.

The package layout is Apple's: `Manifest.json` names the root model item (normally
`Data/com.apple.CoreML/model.mlmodel`), whose ML Program refers to weights as
`@model_path/weights/weight.bin` at a byte offset. The weight file is MIL blob storage
(MILBlob/Blob/StorageFormat.hpp in coremltools): a 64-byte `storage_header`, then per blob a
64-byte `blob_metadata` (sentinel 0xDEADBEEF, dtype, size, data offset, padding bits)
followed by the 64-byte aligned raw data. Sub-byte types are packed LSB first.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coreml.mil.errors import MilError

# coremltools.proto imports the whole coremltools package (slow, noisy); it is needed only here.
from coremltools.proto import MIL_pb2, Model_pb2  # noqa: E402


@dataclass(frozen=True)
class MilDType:
    """One MIL scalar type: how its values are held in numpy and how they are stored."""

    name: str
    numpy: np.dtype
    nbits: int  # storage width; < 8 means packed sub-byte
    blob_id: int | None  # BlobDataType in weight.bin, None when it never appears there


_DT = MIL_pb2.DataType
# (MIL data type, name, numpy dtype used in the executor, storage bits, BlobDataType id)
_DTYPE_TABLE = [
    (_DT.BOOL, "bool", np.bool_, 8, None),
    (_DT.FLOAT16, "fp16", np.float16, 16, 1),
    (_DT.FLOAT32, "fp32", np.float32, 32, 2),
    (_DT.FLOAT64, "fp64", np.float64, 64, None),
    (_DT.UINT8, "uint8", np.uint8, 8, 3),
    (_DT.INT8, "int8", np.int8, 8, 4),
    (_DT.INT16, "int16", np.int16, 16, 6),
    (_DT.UINT16, "uint16", np.uint16, 16, 7),
    (_DT.INT4, "int4", np.int8, 4, 8),
    (_DT.UINT1, "uint1", np.uint8, 1, 9),
    (_DT.UINT2, "uint2", np.uint8, 2, 10),
    (_DT.UINT4, "uint4", np.uint8, 4, 11),
    (_DT.UINT3, "uint3", np.uint8, 3, 12),
    (_DT.UINT6, "uint6", np.uint8, 6, 13),
    (_DT.INT32, "int32", np.int32, 32, 14),
    (_DT.UINT32, "uint32", np.uint32, 32, 15),
    (_DT.INT64, "int64", np.int64, 64, None),
    (_DT.UINT64, "uint64", np.uint64, 64, None),
    (_DT.STRING, "string", np.object_, 0, None),
]
DTYPES: dict[int, MilDType] = {
    code: MilDType(name, np.dtype(npt), nbits, blob) for code, name, npt, nbits, blob in _DTYPE_TABLE
}
DTYPE_BY_NAME: dict[str, MilDType] = {d.name: d for d in DTYPES.values()}


@dataclass(frozen=True)
class TensorSpec:
    """Declared type of a value: dtype and shape, `None` for a dimension unknown until run time.
    A value of unknown rank (MIL's one `variadic` dimension: `fill` of a computed shape) has
    `rank_known` False and no dimensions."""

    dtype: MilDType
    shape: tuple[int | None, ...]
    is_state: bool = False
    rank_known: bool = True


@dataclass(frozen=True)
class Arg:
    """One operand binding: a variable name, or an immediate value inlined in the op."""

    name: str | None
    value: object = None


@dataclass(frozen=True)
class Operation:
    type: str
    inputs: dict[str, tuple[Arg, ...]]
    outputs: tuple[tuple[str, TensorSpec | None], ...]
    attributes: dict[str, object]
    blocks: tuple["Block", ...] = ()


@dataclass(frozen=True)
class Block:
    inputs: tuple[tuple[str, TensorSpec | None], ...]
    outputs: tuple[str, ...]
    operations: tuple[Operation, ...]


@dataclass(frozen=True)
class FeatureSpec:
    """A model-level input/output/state from the spec description (what a caller passes)."""

    name: str
    dtype: MilDType | None  # None for an output whose type the spec leaves open
    shape: tuple[int, ...]  # default shape; empty when unspecified
    ranges: tuple[tuple[int, int], ...] | None = None  # (lo, hi) per dim, hi == -1 unbounded
    enumerated: tuple[tuple[int, ...], ...] | None = None


# A function's opset string (Model.proto's `opset`) -> the iOS version whose MIL it is.
IOS_BY_OPSET = {"CoreML5": 15, "CoreML6": 16, "CoreML7": 17, "CoreML8": 18, "CoreML9": 26}


@dataclass(frozen=True)
class Function:
    name: str
    opset: str
    inputs: tuple[tuple[str, TensorSpec], ...]
    block: Block
    spec_inputs: tuple[FeatureSpec, ...]
    spec_outputs: tuple[FeatureSpec, ...]
    spec_states: tuple[FeatureSpec, ...]

    @property
    def ios(self) -> int:
        """The iOS version of this function's opset, which some ops' semantics depend on."""
        if self.opset not in IOS_BY_OPSET:
            raise MilError(f"function {self.name}: opset {self.opset!r} is not one of {sorted(IOS_BY_OPSET)}")
        return IOS_BY_OPSET[self.opset]


@dataclass(frozen=True)
class Program:
    path: Path
    functions: dict[str, Function]
    default_function: str
    metadata: dict[str, str] = field(default_factory=dict)


def unpack_subbyte(packed: np.ndarray, nbits: int, count: int, signed: bool) -> np.ndarray:
    """Unpack `count` nbits-wide integers stored LSB first (coremltools pack_elements_into_bits)."""
    packed = packed.view(np.uint8)
    if 8 % nbits == 0:  # whole values per byte: shift in place, one byte per value of memory
        shifts = np.arange(0, 8, nbits, dtype=np.uint8)
        values = ((packed[:, None] >> shifts) & np.uint8((1 << nbits) - 1)).reshape(-1)[:count]
    else:  # 3 and 6 bits straddle bytes, but every 3 bytes (24 bits) hold whole values
        per_word = 24 // nbits
        words = np.zeros((-(-count // per_word), 3), np.uint8)
        flat = words.reshape(-1)
        flat[: min(flat.size, packed.size)] = packed[: flat.size]
        w = words.astype(np.uint32)
        w = w[:, 0] | (w[:, 1] << 8) | (w[:, 2] << 16)
        shifts = np.arange(0, 24, nbits, dtype=np.uint32)
        values = ((w[:, None] >> shifts) & np.uint32((1 << nbits) - 1)).astype(np.uint8).reshape(-1)[:count]
    if signed:
        return (values.astype(np.int8) << (8 - nbits)) >> (8 - nbits)  # sign-extend
    return values


def _from_bytes(raw: bytes | memoryview | np.ndarray, dtype: MilDType, shape: tuple[int, ...], where: str):
    count = math.prod(shape)  # Python ints: a crafted shape must not wrap around int64
    buf = np.frombuffer(raw, dtype=np.uint8)
    if dtype.numpy == np.object_:
        raise MilError(f"{where}: {dtype.name} tensors cannot be stored as raw bytes")
    if dtype.nbits < 8:
        need = (count * dtype.nbits + 7) // 8
        if buf.size < need:
            raise MilError(f"{where}: {dtype.name} tensor of shape {shape} needs {need} bytes, found {buf.size}")
        return unpack_subbyte(buf[:need], dtype.nbits, count, signed=dtype.name == "int4").reshape(shape)
    need = count * dtype.numpy.itemsize
    if buf.size != need:
        raise MilError(f"{where}: {dtype.name} tensor of shape {shape} needs {need} bytes, found {buf.size}")
    return buf.view(dtype.numpy).reshape(shape)


@dataclass(frozen=True)
class BlobEntry:
    """One blob's `blob_metadata`, checked: where it sits and where its data lies."""

    offset: int  # of the blob_metadata record (what a program's blobFileValue.offset names)
    blob_dtype: int  # BlobDataType
    data_offset: int
    size: int
    padding_bits: int  # unused trailing bits of a packed sub-byte blob


class BlobStorage:
    """Memory-mapped MIL blob storage file (`weight.bin`); blobs are read on demand by offset."""

    SENTINEL = 0xDEADBEEF
    HEADER = np.dtype([("count", "<u4"), ("version", "<u4"), ("reserved", "<u8", 7)])
    METADATA = np.dtype(
        [("sentinel", "<u4"), ("dtype", "<u4"), ("size", "<u8"), ("offset", "<u8"),
         ("padding_bits", "<u8"), ("reserved", "<u8", 4)]
    )

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if path.stat().st_size else b""
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        if self._bytes.size < 64:
            raise MilError(f"{path}: blob storage header needs 64 bytes, file has {self._bytes.size}")
        header = self._bytes[:64].view(self.HEADER)[0]
        if header["version"] != 2:
            raise MilError(f"{path}: storage_header.version is {header['version']}, only 2 is supported")

    def entry(self, offset: int, dtype: MilDType) -> BlobEntry:
        """The checked metadata of the blob at `offset`, which the program declares as `dtype`."""
        where = f"{self.path} @ {offset}"
        if offset % 64 or offset + 64 > self._bytes.size:
            raise MilError(f"{where}: blob offset outside the file or not 64-byte aligned")
        meta = self._bytes[offset : offset + 64].view(self.METADATA)[0]
        if meta["sentinel"] != self.SENTINEL:
            raise MilError(f"{where}: blob_metadata.sentinel is {int(meta['sentinel']):#x}, expected 0xdeadbeef")
        if meta["dtype"] != dtype.blob_id:
            raise MilError(f"{where}: blob_metadata.mil_dtype is {int(meta['dtype'])}, the program declares {dtype.name}")
        start, size = int(meta["offset"]), int(meta["size"])
        if start + size > self._bytes.size:
            raise MilError(f"{where}: blob data [{start}, {start + size}) runs past the end of the file")
        return BlobEntry(offset, int(meta["dtype"]), start, size, int(meta["padding_bits"]))

    def read(self, offset: int, dtype: MilDType, shape: tuple[int, ...]) -> np.ndarray:
        entry = self.entry(offset, dtype)
        data = self._bytes[entry.data_offset : entry.data_offset + entry.size]
        return _from_bytes(data, dtype, shape, f"{self.path} @ {offset}")

    def stream(self, entry: BlobEntry, window: int = 1 << 24) -> Iterator[memoryview]:
        """A blob's data a window at a time; each window's pages are dropped from this process
        once the consumer moves on, so hashing or copying a whole weight file through the map
        never holds it resident (peak RSS counts mapped file pages)."""
        view = memoryview(self._map)
        for start in range(entry.data_offset, entry.data_offset + entry.size, window):
            stop = min(start + window, entry.data_offset + entry.size)
            with view[start:stop] as chunk:
                yield chunk
            page = start - start % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, page, stop - page)


def blob_file(model_dir: Path, name: str, where: str) -> Path:
    """The weight file a blobFileValue names (`@model_path/...`), which must lie inside `model_dir`."""
    path = (model_dir / name.removeprefix("@model_path/")).resolve()
    if model_dir.resolve() not in path.parents or not path.is_file():
        raise MilError(f"{where}: weight file {name!r} is not a file inside {model_dir}")
    return path


def mil_dtype(code: int, where: str) -> MilDType:
    if code not in DTYPES:
        name = MIL_pb2.DataType.Name(code) if code in MIL_pb2.DataType.values() else f"code {code}"
        raise MilError(f"{where}: data type {name} is not supported")
    return DTYPES[code]


def tensor_spec(vt: MIL_pb2.ValueType, where: str) -> TensorSpec | None:
    kind = vt.WhichOneof("type")
    if kind == "stateType":
        inner = tensor_spec(vt.stateType.wrappedType, where)
        if inner is None:
            raise MilError(f"{where}: state type does not wrap a tensor")
        return TensorSpec(inner.dtype, inner.shape, is_state=True, rank_known=inner.rank_known)
    if kind != "tensorType":
        return None
    tt = vt.tensorType
    if any(d.WhichOneof("dimension") == "unknown" and d.unknown.variadic for d in tt.dimensions):
        return TensorSpec(mil_dtype(tt.dataType, where), (), rank_known=False)
    dims = tuple(d.constant.size if d.WhichOneof("dimension") == "constant" else None for d in tt.dimensions)
    return TensorSpec(mil_dtype(tt.dataType, where), dims)


class _ValueReader:
    """Decodes MIL `Value`s; blob-backed ones are read once per (file, offset) and shared."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self._files: dict[str, BlobStorage] = {}
        self._cache: dict[tuple[str, int], np.ndarray] = {}

    def value(self, v: MIL_pb2.Value, where: str):
        which = v.WhichOneof("value")
        if which == "blobFileValue":
            return self._blob(v, where)
        if which != "immediateValue":
            raise MilError(f"{where}: value has neither an immediate nor a blob payload")
        return self._immediate(v.type, v.immediateValue, where)

    def _immediate(self, vt: MIL_pb2.ValueType, iv, where: str):
        kind = iv.WhichOneof("value")
        if kind == "tensor":
            spec = tensor_spec(vt, where)
            if spec is None:
                raise MilError(f"{where}: immediate tensor without a tensor type")
            return _tensor_value(iv.tensor, spec, where)
        if kind == "tuple":
            types = vt.tupleType.types
            return tuple(
                self._immediate(types[i] if i < len(types) else item.type, item.immediateValue, where)
                for i, item in enumerate(iv.tuple.values)
            )
        if kind == "list":
            return [self.value(item, where) for item in iv.list.values]
        if kind == "dictionary":
            return {self.value(kv.key, where): self.value(kv.value, where) for kv in iv.dictionary.values}
        raise MilError(f"{where}: immediate value kind {kind!r} is not supported")

    def _blob(self, v: MIL_pb2.Value, where: str) -> np.ndarray:
        spec = tensor_spec(v.type, where)
        if spec is None or None in spec.shape:
            raise MilError(f"{where}: blob value needs a tensor type of fixed shape")
        name, offset = v.blobFileValue.fileName, v.blobFileValue.offset
        key = (name, offset)
        if key not in self._cache:
            if name not in self._files:
                self._files[name] = BlobStorage(blob_file(self.model_dir, name, where))
            self._cache[key] = self._files[name].read(offset, spec.dtype, spec.shape)
        return self._cache[key]


def _tensor_value(tv: MIL_pb2.TensorValue, spec: TensorSpec, where: str) -> np.ndarray:
    shape = tuple(d if d is not None else 0 for d in spec.shape)
    kind = tv.WhichOneof("value")
    if kind == "bytes":
        return _from_bytes(tv.bytes.values, spec.dtype, shape, where).copy()
    values = () if kind is None else getattr(tv, kind).values
    # Checked before any array is made: a crafted shape must neither fail a reshape nor allocate.
    if len(values) != math.prod(shape):
        raise MilError(f"{where}: immediate {spec.dtype.name} tensor of shape {shape} holds {len(values)} values")
    if kind == "strings":
        return np.array(list(values), dtype=object).reshape(shape)
    return np.array(values, dtype=spec.dtype.numpy).reshape(shape)


def feature_spec(fd: Model_pb2.FeatureDescription, where: str) -> FeatureSpec:
    kind = fd.type.WhichOneof("Type")
    if kind == "stateType":
        arr = fd.type.stateType.arrayType
    elif kind == "multiArrayType":
        arr = fd.type.multiArrayType
    else:
        raise MilError(f"{where}: feature {fd.name!r} has type {kind}; only multi-arrays and states are supported")
    dtypes = {
        Model_pb2.ArrayFeatureType.FLOAT32: DTYPE_BY_NAME["fp32"],
        Model_pb2.ArrayFeatureType.FLOAT16: DTYPE_BY_NAME["fp16"],
        Model_pb2.ArrayFeatureType.DOUBLE: DTYPE_BY_NAME["fp64"],
        Model_pb2.ArrayFeatureType.INT32: DTYPE_BY_NAME["int32"],
    }
    ranges = enumerated = None
    if arr.WhichOneof("ShapeFlexibility") == "shapeRange":
        ranges = tuple((r.lowerBound, r.upperBound) for r in arr.shapeRange.sizeRanges)
    elif arr.WhichOneof("ShapeFlexibility") == "enumeratedShapes":
        enumerated = tuple(tuple(s.shape) for s in arr.enumeratedShapes.shapes)
    return FeatureSpec(fd.name, dtypes.get(arr.dataType), tuple(arr.shape), ranges, enumerated)


def _block(pb: MIL_pb2.Block, reader: _ValueReader, where: str) -> Block:
    ops = []
    for op in pb.operations:
        at = f"{where}, op {op.type} -> {', '.join(o.name for o in op.outputs) or '(no outputs)'}"
        inputs = {
            key: tuple(
                Arg(b.name) if b.WhichOneof("binding") == "name" else Arg(None, reader.value(b.value, at))
                for b in arg.arguments
            )
            for key, arg in op.inputs.items()
        }
        attributes = {k: reader.value(v, at) for k, v in op.attributes.items()}
        ops.append(
            Operation(
                type=op.type,
                inputs=inputs,
                outputs=tuple((o.name, tensor_spec(o.type, at)) for o in op.outputs),
                attributes=attributes,
                blocks=tuple(_block(b, reader, at) for b in op.blocks),
            )
        )
    return Block(
        inputs=tuple((i.name, tensor_spec(i.type, where)) for i in pb.inputs),
        outputs=tuple(pb.outputs),
        operations=tuple(ops),
    )


def model_path(package: Path) -> Path:
    """The root model spec file of a `.mlpackage`, as its Manifest.json names it."""
    manifest_path = package / "Manifest.json"
    if not manifest_path.is_file():
        raise MilError(f"{package}: not an .mlpackage (no Manifest.json)")
    try:
        manifest = json.loads(manifest_path.read_text())
        root = manifest["itemInfoEntries"][manifest["rootModelIdentifier"]]["path"]
    except (ValueError, KeyError, TypeError) as exc:
        raise MilError(f"{manifest_path}: rootModelIdentifier does not name an item ({exc!r})") from None
    path = (package / "Data" / root).resolve()
    if package.resolve() not in path.parents or not path.is_file():
        raise MilError(f"{manifest_path}: root model path {root!r} is not a file inside the package")
    return path


def program_spec(package: Path) -> tuple[Path, Model_pb2.Model]:
    """The root spec file of an ML Program package and its protobuf (weights not read)."""
    spec_path = model_path(package)
    model = Model_pb2.Model()
    try:
        model.ParseFromString(spec_path.read_bytes())
    except Exception as exc:  # protobuf raises its own DecodeError hierarchy
        raise MilError(f"{spec_path}: not a Core ML model spec ({exc})") from None
    if model.WhichOneof("Type") != "mlProgram":
        raise MilError(f"{spec_path}: model type is {model.WhichOneof('Type')}, expected mlProgram")
    return spec_path, model


@dataclass(frozen=True)
class ConstDigest:
    dtype: np.dtype
    shape: tuple[int, ...]
    sha256: str  # of the const's data bytes, as numpy holds them (little-endian, C order)


@dataclass(frozen=True)
class BlobConst:
    """A weight-file const of one function's top-level block, read on demand from its file's map."""
    function: str
    name: str
    storage: BlobStorage
    offset: int
    dtype: MilDType
    shape: tuple[int, ...]

    def digest(self) -> ConstDigest:
        """Its dtype, shape and the sha256 of its data, streamed through the map
        (`BlobStorage.stream`), so a weight file as large as the model is never resident while
        another copy is (the converter's reference model, a map of the bundle, is)."""
        digest = hashlib.sha256()
        for chunk in self.storage.stream(self.storage.entry(self.offset, self.dtype)):
            digest.update(chunk)
        return ConstDigest(self.dtype.numpy, self.shape, digest.hexdigest())

    def values(self) -> np.ndarray:
        """Its data as an array viewing the map (no copy)."""
        return self.storage.read(self.offset, self.dtype, self.shape)


def blob_consts(package: str | Path) -> list[BlobConst]:
    """Every weight-file const of each function's top-level block, in program order. Packed
    sub-byte consts are left out: no float weight is one."""
    package = Path(package)
    spec_path, model = program_spec(package)
    storages: dict[str, BlobStorage] = {}
    consts = []
    for name, fn in model.mlProgram.functions.items():
        where = f"{spec_path}: function {name}"
        for op in fn.block_specializations[fn.opset].operations if fn.opset in fn.block_specializations else ():
            value = op.attributes["val"] if op.type == "const" and "val" in op.attributes else None
            if value is None or value.WhichOneof("value") != "blobFileValue":
                continue
            spec = tensor_spec(value.type, where)
            if spec is None or None in spec.shape or spec.dtype.nbits < 8:
                continue
            blob = value.blobFileValue
            if blob.fileName not in storages:
                storages[blob.fileName] = BlobStorage(blob_file(spec_path.parent, blob.fileName, where))
            consts.append(BlobConst(name, op.outputs[0].name, storages[blob.fileName], blob.offset, spec.dtype,
                                    tuple(spec.shape)))
    return consts


def blob_const_digests(package: str | Path) -> dict[str, ConstDigest]:
    """Every weight-file const (`blob_consts`) by output name: its dtype, shape and data's sha256."""
    return {const.name: const.digest() for const in blob_consts(package)}


def load_program(package: str | Path) -> Program:
    """Parse a saved ML Program package; every const is decoded (blob data stays memory-mapped)."""
    package = Path(package)
    spec_path, model = program_spec(package)
    reader = _ValueReader(spec_path.parent)
    desc = model.description
    described = {f.name: f for f in desc.functions}
    functions = {}
    for name, fn in model.mlProgram.functions.items():
        where = f"{spec_path}: function {name}"
        if fn.opset not in fn.block_specializations:
            raise MilError(f"{where}: no block for opset {fn.opset!r}")
        fd = described.get(name, desc)
        functions[name] = Function(
            name=name,
            opset=fn.opset,
            inputs=tuple((i.name, tensor_spec(i.type, where)) for i in fn.inputs),
            block=_block(fn.block_specializations[fn.opset], reader, where),
            spec_inputs=tuple(feature_spec(f, where) for f in fd.input),
            spec_outputs=tuple(feature_spec(f, where) for f in fd.output),
            spec_states=tuple(feature_spec(f, where) for f in fd.state),
        )
    default = desc.defaultFunctionName or "main"
    if default not in functions:
        raise MilError(f"{spec_path}: default function {default!r} not among {sorted(functions)}")
    return Program(package, functions, default, dict(desc.metadata.userDefined))
