"""The CMF v2 dtype table (spec §3.1-3.2): one declarative entry per dtype id.

Each `DType` knows its size rule, the open-time payload check, the named planes
of its payload (`parts`: zero-copy numpy views that runtimes map onto their own
quantized kernels), a float32 decoder and, where the spec defines one, an
encoder. Buffers are uint8 numpy arrays, normally views over an mmap; nothing
here copies a payload except the decoders' float32 output.

Plane names, per dtype (`G` groups of 32 over the flattened tensor, `gpr = in/32`):

| dtype | planes |
|---|---|
| f32, f16 | `values` (directory shape) |
| bf16 | `bits` u16 (directory shape; the high half of a float32) |
| u8 | `values` u8 |
| q8_row | `q` i8[out,in], `scale` f16[out] |
| q8_2f | `q` i8[out,in], `row` f16[out], `col` f16[in] |
| q4_block, q4_tiled | `nibbles` u8[G,16], `scales` f16[G] (strided views for q4_tiled) |
| q4tp | `nibbles` u8[rows,gpr,16], `lo` f16[rows], `step` f16[rows], `codes` u8[rows,cb] |
| q2tp | `plane` u8[rows,gpr,8], `lo`, `step`, `codes` as q4tp |
| vbit | `bits` u8[rows], `scales` f16[rows,gpr], `packed` u8[...] |
| vbit_ro | vbit's planes plus `offsets` u32[rows+1] |
| q1 | `scales` f16[G], `signs` u8[G,4] |
| q1s | q1's planes plus `index` u32[count], `value` f16[count] |
| q1t | `scales` f16[G], `codes` u8[G,7], `row_ptr` u32[rows+1], `col` u16[nnz], `value` f16[nnz] |

Nibble order everywhere: element 2k of a group is the LOW nibble of byte k.
`ladder(lo, step)`, `tile_rungs(codes, gpr)` and `q2tp_scales(ladder, rungs)` expose the
q4tp/q2tp rung maths and `vbit_row_bytes(bits, in_)` the vbit row lengths, so runtimes reuse them.

Every method takes `where`, a prefix for error messages (the reader passes the
file and tensor name). Bad payloads raise `Bounds` (sizes, offsets, indices)
or `Parse` (a shape the dtype cannot have, reserved dtypes), naming the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.ground.cmf.errors import Bounds, Parse

GROUP = 32
VBIT_WIDTHS = (3, 4, 5, 6, 8)
LADDER_RUNGS = 32

Shape = tuple[int, ...]


# ---------------------------------------------------------------- shape helpers


def _numel(shape: Shape) -> int:
    return math.prod(shape)


def _groups(shape: Shape) -> int:
    return -(-_numel(shape) // GROUP)


def _rows_cols(shape: Shape, name: str, where: str, *, tiled: bool = False) -> tuple[int, int]:
    if len(shape) != 2:
        raise Parse(f"{where}: {name} needs a 2-D shape, got {tuple(shape)}")
    rows, cols = shape
    if tiled and cols % GROUP:
        raise Parse(f"{where}: {name} needs in % 32 == 0, got shape {tuple(shape)}")
    return rows, cols


def _code_bytes(gpr: int) -> int:
    return -(-gpr * 5 // 8)


def _f16(buf: np.ndarray) -> np.ndarray:
    return buf.view("<f2")


def _expect_size(buf: np.ndarray, need: int, name: str, shape: Shape, where: str) -> None:
    if buf.size != need:
        raise Bounds(f"{where}: {name} payload is {buf.size} bytes, shape {tuple(shape)} needs {need}")


def _split(buf: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Consecutive planes of `buf` with the given byte sizes (the caller checked the total)."""
    ends = np.cumsum([0, *sizes])
    return [buf[a:b] for a, b in zip(ends[:-1], ends[1:])]


def _finish(flat: np.ndarray, shape: Shape) -> np.ndarray:
    """First numel values of a group-padded flat decode, in the directory shape."""
    return np.ascontiguousarray(flat.reshape(-1)[: _numel(shape)]).reshape(shape)


# ---------------------------------------------------------------- shared quantizer maths


def _round_f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def _safe_div(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """w / s with 0 where s == 0 (an all-zero group quantizes to the zero code)."""
    s = s.astype(np.float32)
    return np.divide(w, s, out=np.zeros(np.broadcast_shapes(w.shape, s.shape), np.float32), where=s != 0)


def _rms(x: np.ndarray, axis: int) -> np.ndarray:
    """Root mean square along axis in float64; 0 along an empty axis."""
    return np.sqrt(np.square(x, dtype=np.float64).sum(axis=axis) / max(x.shape[axis], 1))


def _byte_table(values: np.ndarray) -> np.ndarray:
    """A [256, k] float32 table of what each byte decodes to, as 256 single wide elements.

    Gathering one k*4-byte element per payload byte is several times faster than
    2-D fancy indexing; numpy moves native 8/16-byte types faster than void ones.
    """
    nbytes = values.shape[1] * 4
    wide = {8: np.uint64, 16: np.complex128}.get(nbytes, np.dtype(f"V{nbytes}"))
    return np.ascontiguousarray(values, dtype=np.float32).view(wide).reshape(256)


def _expand(table: np.ndarray, payload: np.ndarray) -> np.ndarray:
    """float32 [..., n, k] -> [..., n * k]: each payload byte replaced by its k table values."""
    k = table.itemsize // 4
    return table[payload].view(np.float32).reshape(*payload.shape[:-1], payload.shape[-1] * k)


def _group_pad(w: np.ndarray) -> np.ndarray:
    """Flattened float32 values, zero-padded to whole groups: [G, 32]."""
    flat = np.asarray(w, dtype=np.float32).reshape(-1)
    g = _groups(flat.shape)
    out = np.zeros(g * GROUP, np.float32)
    out[: flat.size] = flat
    return out.reshape(g, GROUP)


def ladder(lo: np.ndarray, step: np.ndarray) -> np.ndarray:
    """q4tp/q2tp row ladders, float32 [rows, 32]: t[0] = exp2(lo), t[c] = t[c-1] * exp2(step).

    One float32 rounding per multiply, exactly as spec §3.2 fixes it; never
    2**(lo + c*step), which rounds differently.
    """
    lo32 = np.asarray(lo, dtype=np.float32)
    mult = np.exp2(np.asarray(step, dtype=np.float32))
    t = np.empty((lo32.size, LADDER_RUNGS), np.float32)
    t[:, 0] = np.exp2(lo32)
    for c in range(1, LADDER_RUNGS):
        np.multiply(t[:, c - 1], mult, out=t[:, c])
    return t


def tile_rungs(codes: np.ndarray, gpr: int) -> np.ndarray:
    """5-bit rung code per tile, [rows, gpr] uint8, from the row-aligned LSB-first code plane."""
    rows = codes.shape[0]
    wide = np.zeros((rows, codes.shape[1] + 1), np.uint16)  # a code may span into the next byte
    wide[:, :-1] = codes
    bit = np.arange(gpr) * 5
    byte, shift = bit // 8, (bit % 8).astype(np.uint16)
    pair = wide[:, byte] | (wide[:, byte + 1] << np.uint16(8))
    return ((pair >> shift) & np.uint16(31)).astype(np.uint8)


def q2tp_scales(t: np.ndarray, rung: np.ndarray) -> np.ndarray:
    """q2tp group scales, float32 [rows, gpr], from the row ladders `t` ([rows, 32], `ladder`)
    and the tile rung codes (`tile_rungs`): code 0 is an exactly-zero group, r >= 1 is rung r - 1."""
    idx = np.maximum(rung.astype(np.intp) - 1, 0)
    return np.where(rung > 0, np.take_along_axis(t, idx, axis=1), np.float32(0))


def _pack_rungs(rungs: np.ndarray) -> np.ndarray:
    """Inverse of tile_rungs: [rows, gpr] codes < 32 -> [rows, ceil(gpr*5/8)] bytes."""
    rows, gpr = rungs.shape
    bits = (rungs[:, :, None] >> np.arange(5, dtype=np.uint8)) & 1  # LSB-first within each code
    bits = bits.reshape(rows, gpr * 5)
    padded = np.zeros((rows, _code_bytes(gpr) * 8), np.uint8)
    padded[:, : gpr * 5] = bits
    return np.packbits(padded, axis=1, bitorder="little")


def _nearest_rung(t: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Per row, index of the rung of ascending ladder t [rows, K] nearest to s [rows, gpr] in log2."""
    k = t.shape[1]
    logt = np.log2(np.maximum(t, np.finfo(np.float32).tiny)).astype(np.float64)
    logs = np.log2(np.maximum(s, np.finfo(np.float32).tiny)).astype(np.float64)
    # Count of rungs below each target, per row, without a per-row loop.
    below = (logt[:, None, :] < logs[:, :, None]).sum(axis=2)
    lo_i = np.clip(below - 1, 0, k - 1)
    hi_i = np.clip(below, 0, k - 1)
    r = np.arange(t.shape[0])[:, None]
    pick_hi = np.abs(logt[r, hi_i] - logs) < np.abs(logs - logt[r, lo_i])
    return np.where(pick_hi, hi_i, lo_i)


def _fit_ladder(s: np.ndarray, n_rungs: int) -> tuple[np.ndarray, np.ndarray]:
    """f16 (lo, step) per row spanning the row's nonzero group scales s [rows, gpr] with n_rungs rungs."""
    pos = s > 0
    big = np.where(pos, s, 0).max(axis=1, initial=0)
    small = np.where(pos, s, np.inf).min(axis=1, initial=np.inf)
    any_pos = pos.any(axis=1)
    lo = np.where(any_pos, np.log2(np.where(any_pos, small, 1.0)), 0.0)
    hi = np.where(any_pos, np.log2(np.where(any_pos, big, 1.0)), 0.0)
    step = (hi - lo) / (n_rungs - 1)
    return _round_f16(lo), _round_f16(step)


# ---------------------------------------------------------------- the DType record


@dataclass(frozen=True)
class DType:
    """One dtype id. `encode` is None where the spec defines no encoder."""

    id: int
    name: str
    decodable: bool
    _size: Callable[[Shape, str], int | None]
    _parts: Callable[[np.ndarray, Shape, str], dict[str, np.ndarray]] | None
    _decode: Callable[[np.ndarray, Shape, str], np.ndarray] | None
    encode: Callable[..., np.ndarray] | None = None
    _check: Callable[[np.ndarray, Shape, str], None] | None = None

    def fixed_nbytes(self, shape: Shape, where: str = "") -> int | None:
        """Payload size the shape implies; None for variable-length and reserved dtypes."""
        return self._size(tuple(shape), where or self.name)

    def check_payload(self, buf: np.ndarray, shape: Shape, where: str = "") -> None:
        """Everything checkable at open: fixed sizes, and vbit/vbit_ro width headers and lengths."""
        where = where or self.name
        need = self.fixed_nbytes(shape, where)
        if need is not None:
            _expect_size(buf, need, self.name, tuple(shape), where)
        if self._check is not None:
            self._check(buf, tuple(shape), where)

    def _usable(self, buf: np.ndarray, shape: Shape, where: str) -> None:
        if not self.decodable:
            raise Parse(f"{where}: dtype {self.id} ({self.name}) is reserved and has no defined decoding")
        self.check_payload(buf, shape, where)

    def parts(self, buf: np.ndarray, shape: Shape, where: str = "") -> dict[str, np.ndarray]:
        where = where or self.name
        self._usable(buf, shape, where)
        return self._parts(buf, tuple(shape), where)

    def decode(self, buf: np.ndarray, shape: Shape, where: str = "") -> np.ndarray:
        """float32 array of the directory shape."""
        where = where or self.name
        self._usable(buf, shape, where)
        return self._decode(buf, tuple(shape), where)


# ---------------------------------------------------------------- plain floats and bytes


def _plain(itemsize: int) -> Callable[[Shape, str], int]:
    return lambda shape, where: itemsize * _numel(shape)


def _no_size(shape: Shape, where: str) -> None:
    return None


def _f32_parts(buf, shape, where):
    return {"values": buf.view("<f4").reshape(shape)}


def _f16_parts(buf, shape, where):
    return {"values": buf.view("<f2").reshape(shape)}


def _bf16_parts(buf, shape, where):
    return {"bits": buf.view("<u2").reshape(shape)}


def _float_decode(parts_fn):
    # f32 on a little-endian host is already float32: the decode is the payload view itself
    # (read-only over a mapped file), not a copy of it.
    return lambda buf, shape, where: parts_fn(buf, shape, where)["values"].astype(np.float32, copy=False)


def _bf16_decode(buf, shape, where):
    return (_bf16_parts(buf, shape, where)["bits"].astype(np.uint32) << np.uint32(16)).view(np.float32)


def _u8_parts(buf, shape, where):
    # u8 is not size-checked at open (spec §1.2), so its own decoder bounds-checks.
    _expect_size(buf, _numel(shape), "u8", shape, where)
    return {"values": buf.reshape(shape)}


def _u8_decode(buf, shape, where):
    return _u8_parts(buf, shape, where)["values"].astype(np.float32)


def _to_bytes(*planes: np.ndarray) -> np.ndarray:
    return np.concatenate([np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in planes])


def _enc_f32(w):
    return _to_bytes(np.asarray(w, dtype="<f4"))


def _enc_f16(w):
    with np.errstate(over="ignore"):  # beyond 65504 is inf, as IEEE rounding says
        return _to_bytes(np.asarray(w, dtype=np.float32).astype("<f2"))


def _enc_bf16(w):
    """Round-to-nearest-even to the top 16 bits; NaNs stay (quiet) NaNs."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (u >> np.uint32(16)) | np.uint32(0x40)
    return _to_bytes(np.where(np.isnan(w), quiet_nan, rounded).astype("<u2"))


# ---------------------------------------------------------------- q8


def _q8_row_size(shape, where):
    rows, cols = _rows_cols(shape, "q8_row", where)
    return rows * cols + 2 * rows


def _q8_row_parts(buf, shape, where):
    rows, cols = shape
    q, scale = _split(buf, [rows * cols, 2 * rows])
    return {"q": q.view(np.int8).reshape(rows, cols), "scale": _f16(scale)}


def _q8_row_decode(buf, shape, where):
    p = _q8_row_parts(buf, shape, where)
    return p["q"].astype(np.float32) * p["scale"].astype(np.float32)[:, None]


def _enc_q8_row(w):
    w = np.asarray(w, dtype=np.float32)
    _rows_cols(w.shape, "q8_row", "q8_row encoder")
    scale = _round_f16(np.abs(w).max(axis=1, initial=0) / 127)
    q = np.clip(np.rint(_safe_div(w, scale[:, None])), -127, 127).astype(np.int8)
    return _to_bytes(q, scale.astype("<f2"))


def _q8_2f_size(shape, where):
    rows, cols = _rows_cols(shape, "q8_2f", where)
    return rows * cols + 2 * rows + 2 * cols


def _q8_2f_parts(buf, shape, where):
    rows, cols = shape
    q, row, col = _split(buf, [rows * cols, 2 * rows, 2 * cols])
    return {"q": q.view(np.int8).reshape(rows, cols), "row": _f16(row), "col": _f16(col)}


def _q8_2f_decode(buf, shape, where):
    p = _q8_2f_parts(buf, shape, where)
    # Left to right, as the spec writes it: (q * row) is exact, one rounding for * col.
    return (p["q"].astype(np.float32) * p["row"].astype(np.float32)[:, None]) * p["col"].astype(np.float32)


Q8_2F_COL_FLOOR = 6.104e-5  # smallest normal f16, so col never underflows


def _enc_q8_2f(w):
    w = np.asarray(w, dtype=np.float32)
    _rows_cols(w.shape, "q8_2f", "q8_2f encoder")
    col = _round_f16(np.maximum(_rms(w, axis=0), Q8_2F_COL_FLOOR))
    wc = w / col.astype(np.float32)
    row = _round_f16(np.abs(wc).max(axis=1, initial=0) / 127)
    q = np.clip(np.rint(_safe_div(wc, row[:, None])), -127, 127).astype(np.int8)
    return _to_bytes(q, row.astype("<f2"), col.astype("<f2"))


# ---------------------------------------------------------------- q4 block / tiled

# byte -> (low nibble - 8, high nibble - 8): one gather decodes two elements.
_NIB_LUT = _byte_table(np.stack([(np.arange(256) & 15) - 8, (np.arange(256) >> 4) - 8], axis=1))


def _nibble_values(nibbles: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(q - 8) * scale for nibble bytes [..., 16] and scales broadcastable to [...]: float32 [..., 32]."""
    vals = _expand(_NIB_LUT, nibbles)
    vals *= scales.astype(np.float32)[..., None]
    return vals


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes 0..15 [..., 32] -> bytes [..., 16], element 2k in the low nibble of byte k."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _q4_quantize(wg: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Nibble bytes of w against reconstructed scales (broadcastable to wg[..., 0])."""
    q = np.clip(np.rint(_safe_div(wg, scale[..., None])), -8, 7) + 8
    return _pack_nibbles(q.astype(np.uint8))


def _q4_size(shape, where):
    return 18 * _groups(shape)


def _q4_block_parts(buf, shape, where):
    g = _groups(shape)
    nib, sc = _split(buf, [16 * g, 2 * g])
    return {"nibbles": nib.reshape(g, 16), "scales": _f16(sc)}


def _q4_tiled_parts(buf, shape, where):
    tiles = buf.reshape(_groups(shape), 18)
    return {"nibbles": tiles[:, 2:], "scales": tiles[:, :2].view("<f2")[:, 0]}


def _q4_decode(parts_fn):
    def decode(buf, shape, where):
        p = parts_fn(buf, shape, where)
        return _finish(_nibble_values(p["nibbles"], p["scales"]), shape)

    return decode


def _q4_encode_groups(w):
    wg = _group_pad(w)
    scale = _round_f16(np.abs(wg).max(axis=1) / 7)
    return _q4_quantize(wg, scale.astype(np.float32)), scale


def _enc_q4_block(w):
    nib, scale = _q4_encode_groups(w)
    return _to_bytes(nib, scale.astype("<f2"))


def _enc_q4_tiled(w):
    nib, scale = _q4_encode_groups(w)
    tiles = np.empty((nib.shape[0], 18), np.uint8)
    tiles[:, :2] = scale.astype("<f2").view(np.uint8).reshape(-1, 2)
    tiles[:, 2:] = nib
    return tiles.reshape(-1)


# ---------------------------------------------------------------- q4tp / q2tp


def _tp_size(plane_bytes: int, name: str):
    def size(shape, where):
        rows, cols = _rows_cols(shape, name, where, tiled=True)
        gpr = cols // GROUP
        return rows * gpr * plane_bytes + 4 * rows + rows * _code_bytes(gpr)

    return size


def _tp_parts(plane_bytes: int, plane_name: str):
    def parts(buf, shape, where):
        rows, cols = shape
        gpr = cols // GROUP
        plane, params, codes = _split(buf, [rows * gpr * plane_bytes, 4 * rows, rows * _code_bytes(gpr)])
        params = _f16(params).reshape(rows, 2)
        return {
            plane_name: plane.reshape(rows, gpr, plane_bytes),
            "lo": params[:, 0],
            "step": params[:, 1],
            "codes": codes.reshape(rows, _code_bytes(gpr)),
        }

    return parts


_q4tp_parts = _tp_parts(16, "nibbles")
_q2tp_parts = _tp_parts(8, "plane")


def _q4tp_decode(buf, shape, where):
    p = _q4tp_parts(buf, shape, where)
    rows, gpr = p["nibbles"].shape[:2]
    t = ladder(p["lo"], p["step"])
    scale = np.take_along_axis(t, tile_rungs(p["codes"], gpr).astype(np.intp), axis=1)
    return _nibble_values(p["nibbles"], scale).reshape(shape)


# byte -> its four 2-bit fields (LSB-first) minus 1.5.
_Q2_LUT = _byte_table(((np.arange(256)[:, None] >> (2 * np.arange(4))) & 3) - 1.5)


def _q2tp_decode(buf, shape, where):
    p = _q2tp_parts(buf, shape, where)
    rows, gpr = p["plane"].shape[:2]
    scale = q2tp_scales(ladder(p["lo"], p["step"]), tile_rungs(p["codes"], gpr))
    vals = _expand(_Q2_LUT, p["plane"])
    vals *= scale[..., None]
    return vals.reshape(shape)


def _enc_q4tp(w):
    """Per row a 32-rung ladder spanning the row's group scales absmax/7 (lo/step rounded to f16
    first); each group takes the rung nearest its scale in log2 and its nibbles are quantized
    against that reconstructed rung, so decode(encode(w)) is what any decoder computes."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = _rows_cols(w.shape, "q4tp", "q4tp encoder", tiled=True)
    wg = w.reshape(rows, cols // GROUP, GROUP)
    s = np.abs(wg).max(axis=2) / 7
    lo, step = _fit_ladder(s, LADDER_RUNGS)
    t = ladder(lo, step)
    rung = _nearest_rung(t, s)
    scale = np.take_along_axis(t, rung, axis=1)
    params = np.stack([lo, step], axis=1).astype("<f2")
    return _to_bytes(_q4_quantize(wg, scale), params, _pack_rungs(rung.astype(np.uint8)))


def _enc_q2tp(w):
    """As q4tp with values (c - 1.5) * s, s = absmax/1.5 per group; all-zero groups take rung 0
    and the other groups the nearest of the ladder's first 31 rungs (codes 1..31)."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = _rows_cols(w.shape, "q2tp", "q2tp encoder", tiled=True)
    gpr = cols // GROUP
    wg = w.reshape(rows, gpr, GROUP)
    s = np.abs(wg).max(axis=2) / 1.5
    lo, step = _fit_ladder(s, LADDER_RUNGS - 1)
    t = ladder(lo, step)
    rung = np.where(s > 0, _nearest_rung(t[:, : LADDER_RUNGS - 1], s) + 1, 0).astype(np.uint8)
    scale = q2tp_scales(t, rung)
    c = np.clip(np.rint(_safe_div(wg, scale[..., None]) + 1.5), 0, 3).astype(np.uint8)
    c = c.reshape(rows, gpr, 8, 4)
    plane = (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).astype(np.uint8)
    params = np.stack([lo, step], axis=1).astype("<f2")
    return _to_bytes(plane, params, _pack_rungs(rung))


# ---------------------------------------------------------------- vbit / vbit_ro


def vbit_row_bytes(bits: np.ndarray, in_: int) -> np.ndarray:
    """Packed bytes of each vbit row: ceil(in * b / 8), int64 [rows]."""
    return (in_ * bits.astype(np.int64) + 7) // 8


def _vbit_head(buf, shape, where, name):
    """(bits, scales, rest) after checking that the width header and scales fit and are valid."""
    rows, cols = _rows_cols(shape, name, where, tiled=True)
    head = rows + 2 * rows * (cols // GROUP)
    if buf.size < head:
        raise Bounds(f"{where}: {name} payload is {buf.size} bytes, shorter than its {head}-byte width/scale header")
    bits = buf[:rows]
    bad = np.flatnonzero(~np.isin(bits, VBIT_WIDTHS))
    if bad.size:
        r = int(bad[0])
        raise Bounds(f"{where}: {name} row {r} (payload byte {r}) has width {int(bits[r])}, not one of {VBIT_WIDTHS}")
    return bits, buf[rows:head], buf[head:]


def _vbit_check(buf, shape, where):
    bits, _, packed = _vbit_head(buf, shape, where, "vbit")
    need = int(vbit_row_bytes(bits, shape[1]).sum())
    if packed.size != need:
        raise Bounds(f"{where}: vbit packed rows are {packed.size} bytes, the width header needs {need}")


def _vbit_ro_check(buf, shape, where):
    bits, _, rest = _vbit_head(buf, shape, where, "vbit_ro")
    rows = shape[0]
    if rest.size < 4 * (rows + 1):
        raise Bounds(f"{where}: vbit_ro has {rest.size} bytes after its scales, its offset table needs {4 * (rows + 1)}")
    offsets = rest[: 4 * (rows + 1)].view("<u4").astype(np.int64)
    spans = vbit_row_bytes(bits, shape[1])
    want = np.concatenate([[0], np.cumsum(spans)])
    bad = np.flatnonzero(offsets != want)
    if bad.size:
        i = int(bad[0])
        raise Bounds(f"{where}: vbit_ro offsets[{i}] = {int(offsets[i])}, the width header implies {int(want[i])}")
    packed = rest.size - 4 * (rows + 1)
    if packed != want[-1]:
        raise Bounds(f"{where}: vbit_ro packed rows are {packed} bytes, the width header needs {int(want[-1])}")


def _vbit_parts(buf, shape, where):
    bits, scales, packed = _vbit_head(buf, shape, where, "vbit")
    return {"bits": bits, "scales": _f16(scales).reshape(shape[0], shape[1] // GROUP), "packed": packed}


def _vbit_ro_parts(buf, shape, where):
    bits, scales, rest = _vbit_head(buf, shape, where, "vbit_ro")
    n_off = 4 * (shape[0] + 1)
    return {
        "bits": bits,
        "scales": _f16(scales).reshape(shape[0], shape[1] // GROUP),
        "offsets": rest[:n_off].view("<u4"),
        "packed": rest[n_off:],
    }


def _vbit_codes(rowbytes: np.ndarray, b: int) -> np.ndarray:
    """Codes u8 [k, cols] of MSB-first width-b rows [k, cols*b/8].

    With in % 32 == 0 every row is whole blocks of b bytes holding 8 codes, and code j
    of a block sits at the same bit offset j*b in every block: eight strided slices
    decode the whole tensor.
    """
    k, nblk = rowbytes.shape[0], rowbytes.shape[1] // b
    blk = rowbytes.reshape(k, nblk, b)
    u = np.empty((k, nblk, 8), np.uint8)
    mask = np.uint16((1 << b) - 1)
    for j in range(8):
        byte, bit = divmod(j * b, 8)
        pair = blk[..., byte].astype(np.uint16) << np.uint16(8)
        if bit + b > 8:  # the code runs into the next byte
            pair |= blk[..., byte + 1]
        u[..., j] = (pair >> np.uint16(16 - b - bit)) & mask
    return u.reshape(k, nblk * 8)


def _vbit_values(bits, scales, packed, cols):
    """Rows grouped by width (at most five groups); w = (u - L) * scale[r, i/32]."""
    rows = bits.size
    out = np.empty((rows, cols), np.float32)
    spans = vbit_row_bytes(bits, cols)
    starts = np.concatenate([[0], np.cumsum(spans)[:-1]])
    for b in np.unique(bits):
        b = int(b)
        sel = np.flatnonzero(bits == b)
        # Whole-row gather through a zero-copy window view: one memcpy per row, not per byte.
        rowbytes = np.lib.stride_tricks.sliding_window_view(packed, cols * b // 8)[starts[sel]]
        vals = _vbit_codes(rowbytes, b).astype(np.float32)
        vals -= np.float32(2 ** (b - 1) - 1)
        vals = vals.reshape(sel.size, cols // GROUP, GROUP)
        vals *= scales[sel].astype(np.float32)[..., None]
        if sel.size == rows:  # one width for the whole tensor (the usual case): no scatter
            return vals.reshape(rows, cols)
        out[sel] = vals.reshape(sel.size, cols)
    return out


def _vbit_decode(parts_fn):
    def decode(buf, shape, where):
        p = parts_fn(buf, shape, where)
        return _vbit_values(p["bits"], p["scales"], p["packed"], shape[1])

    return decode


VBIT_REL_RMSE = 0.05


def _vbit_quantize(w: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes u16 [rows, cols], f16 scales [rows, gpr]) at width b."""
    L = 2 ** (b - 1) - 1
    wg = w.reshape(w.shape[0], w.shape[1] // GROUP, GROUP)
    scale = _round_f16(np.abs(wg).max(axis=2) / L)
    u = np.clip(np.rint(_safe_div(wg, scale[..., None])) + L, 0, 2**b - 1)
    return u.reshape(w.shape).astype(np.uint16), scale


def _vbit_choose_bits(w: np.ndarray, rel_rmse: float) -> np.ndarray:
    """Per row the smallest width whose reconstruction RMSE is within rel_rmse of the row RMS."""
    rows = w.shape[0]
    chosen = np.full(rows, VBIT_WIDTHS[-1], np.uint8)
    undecided = np.ones(rows, bool)
    row_rms = _rms(w, axis=1)
    for b in VBIT_WIDTHS[:-1]:
        u, scale = _vbit_quantize(w, b)
        L = 2 ** (b - 1) - 1
        recon = (u.astype(np.float32) - L).reshape(scale.shape + (GROUP,)) * scale.astype(np.float32)[..., None]
        err = _rms(recon.reshape(w.shape) - w, axis=1)
        ok = undecided & (err <= rel_rmse * row_rms)
        chosen[ok] = b
        undecided &= ~ok
    return chosen


def _vbit_encode_planes(w, bits, rel_rmse, name):
    w = np.asarray(w, dtype=np.float32)
    rows, cols = _rows_cols(w.shape, name, f"{name} encoder", tiled=True)
    if bits is None:
        bits = _vbit_choose_bits(w, rel_rmse)
    bits = np.broadcast_to(np.asarray(bits, dtype=np.uint8), (rows,)).copy()
    bad = ~np.isin(bits, VBIT_WIDTHS)
    if bad.any():
        raise Bounds(f"{name} encoder: width {int(bits[bad][0])} is not one of {VBIT_WIDTHS}")
    spans = vbit_row_bytes(bits, cols)
    starts = np.concatenate([[0], np.cumsum(spans)[:-1]])
    packed = np.zeros(int(spans.sum()), np.uint8)
    scales = np.zeros((rows, cols // GROUP), np.float16)
    for b in np.unique(bits):
        b = int(b)
        sel = np.flatnonzero(bits == b)
        u, scales[sel] = _vbit_quantize(w[sel], b)
        # MSB-first code bits, concatenated along the row; packbits pads the row to a byte.
        stream = ((u[..., None] >> np.arange(b - 1, -1, -1, dtype=np.uint16)) & 1).astype(np.uint8)
        rowbytes = np.packbits(stream.reshape(sel.size, cols * b), axis=1)
        packed[starts[sel][:, None] + np.arange(rowbytes.shape[1])] = rowbytes
    offsets = np.concatenate([[0], np.cumsum(spans)]).astype("<u4")
    return bits, scales.astype("<f2"), offsets, packed


def _enc_vbit(w, bits=None, rel_rmse=VBIT_REL_RMSE):
    """`bits`: one width or one per row; by default each row takes the smallest width in
    {3,4,5,6,8} whose reconstruction RMSE is at most `rel_rmse` x the row's RMS (else 8)."""
    bits, scales, _, packed = _vbit_encode_planes(w, bits, rel_rmse, "vbit")
    return _to_bytes(bits, scales, packed)


def _enc_vbit_ro(w, bits=None, rel_rmse=VBIT_REL_RMSE):
    """vbit's encoder plus the row-offset table."""
    bits, scales, offsets, packed = _vbit_encode_planes(w, bits, rel_rmse, "vbit_ro")
    return _to_bytes(bits, scales, offsets, packed)


# ---------------------------------------------------------------- q1 / q1s / q1t

# byte -> its 8 bits LSB-first as -1/+1.
_SIGN_LUT = _byte_table(np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 1.0, -1.0))


def _q1_size(shape, where):
    return 6 * _groups(shape)


def _q1_tiles(buf, g):
    tiles = buf[: 6 * g].reshape(g, 6)
    return {"scales": tiles[:, :2].view("<f2")[:, 0], "signs": tiles[:, 2:]}


def _q1_values(p) -> np.ndarray:
    vals = _expand(_SIGN_LUT, p["signs"])
    vals *= p["scales"].astype(np.float32)[:, None]
    return vals


def _q1_parts(buf, shape, where):
    return _q1_tiles(buf, _groups(shape))


def _q1_decode(buf, shape, where):
    return _finish(_q1_values(_q1_parts(buf, shape, where)), shape)


def _q1_encode_tiles(w) -> tuple[np.ndarray, np.ndarray]:
    """(tile bytes [G, 6], reconstruction [G, 32]): s = mean |w| over the group's real elements,
    the L2-optimal scale for sign codes."""
    wg = _group_pad(w)
    n = np.asarray(w).size
    count = np.clip(n - GROUP * np.arange(wg.shape[0]), 1, GROUP)
    scale = _round_f16(np.abs(wg).sum(axis=1) / count)
    sign = wg >= 0
    tiles = np.empty((wg.shape[0], 6), np.uint8)
    tiles[:, :2] = scale.astype("<f2").view(np.uint8).reshape(-1, 2)
    tiles[:, 2:] = np.packbits(sign, axis=1, bitorder="little")
    recon = np.where(sign, 1.0, -1.0).astype(np.float32) * scale.astype(np.float32)[:, None]
    return tiles, recon


def _enc_q1(w):
    return _q1_encode_tiles(w)[0].reshape(-1)


def _q1s_parts(buf, shape, where):
    g = _groups(shape)
    base = 6 * g
    if buf.size < base + 4:
        raise Bounds(f"{where}: q1s payload is {buf.size} bytes, its base and count need {base + 4}")
    count = int(buf[base : base + 4].view("<u4")[0])
    need = base + 4 + 6 * count
    if buf.size != need:
        raise Bounds(f"{where}: q1s payload is {buf.size} bytes, count {count} at byte {base} implies {need}")
    records = buf[base + 4 :].reshape(count, 6)
    return {
        **_q1_tiles(buf, g),
        "index": records[:, :4].view("<u4")[:, 0],
        "value": records[:, 4:].view("<f2")[:, 0],
    }


def _q1s_decode(buf, shape, where):
    p = _q1s_parts(buf, shape, where)
    n = _numel(shape)
    flat = _q1_values(p).reshape(-1)
    bad = np.flatnonzero(p["index"] >= n)
    if bad.size:
        j = int(bad[0])
        off = 6 * _groups(shape) + 4 + 6 * j
        raise Bounds(f"{where}: q1s overlay entry {j} (byte {off}) has index {int(p['index'][j])}, tensor has {n} elements")
    flat[p["index"]] = p["value"].astype(np.float32)
    return _finish(flat, shape)


Q1_OUTLIERS = 0.01


def _top_errors(err: np.ndarray, fraction: float) -> np.ndarray:
    """Sorted flat indices of the round(fraction * size) largest entries of err."""
    k = min(int(round(fraction * err.size)), err.size)
    if k == 0:
        return np.zeros(0, np.intp)
    flat = err.reshape(-1)
    return np.sort(np.argpartition(flat, flat.size - k)[flat.size - k :])


def _enc_q1s(w, outliers=Q1_OUTLIERS):
    """q1 plus the `outliers` fraction of elements with the largest q1 error stored as f16."""
    w = np.asarray(w, dtype=np.float32)
    tiles, recon = _q1_encode_tiles(w)
    flat = w.reshape(-1)
    idx = _top_errors(np.abs(recon.reshape(-1)[: flat.size] - flat), outliers)
    records = np.empty((idx.size, 6), np.uint8)
    records[:, :4] = idx.astype("<u4").view(np.uint8).reshape(-1, 4)
    records[:, 4:] = flat[idx].astype("<f2").view(np.uint8).reshape(-1, 2)
    return _to_bytes(tiles, np.array([idx.size], "<u4"), records)


Q1T_MAX_IN = 65536  # overlay columns are u16


def _q1t_rows_cols(shape, where):
    rows, cols = _rows_cols(shape, "q1t", where)
    if cols > Q1T_MAX_IN:
        raise Parse(f"{where}: q1t needs in <= {Q1T_MAX_IN}, got shape {tuple(shape)}")
    return rows, cols


def _q1t_parts(buf, shape, where):
    rows, _ = _q1t_rows_cols(shape, where)
    g = _groups(shape)
    base, ptr_end = 9 * g, 9 * g + 4 * (rows + 1)
    if buf.size < ptr_end:
        raise Bounds(f"{where}: q1t payload is {buf.size} bytes, its tiles and row_ptr need {ptr_end}")
    row_ptr = buf[base:ptr_end].view("<u4")
    nnz = int(row_ptr[-1])
    if row_ptr[0] != 0:
        raise Bounds(f"{where}: q1t row_ptr[0] (byte {base}) is {int(row_ptr[0])}, must be 0")
    drops = np.flatnonzero(np.diff(row_ptr.astype(np.int64)) < 0)
    if drops.size:
        r = int(drops[0]) + 1
        raise Bounds(f"{where}: q1t row_ptr[{r}] (byte {base + 4 * r}) = {int(row_ptr[r])} is below row_ptr[{r - 1}] = {int(row_ptr[r - 1])}")
    if buf.size != ptr_end + 4 * nnz:
        raise Bounds(f"{where}: q1t payload is {buf.size} bytes, row_ptr[{rows}] = {nnz} implies {ptr_end + 4 * nnz}")
    tiles = buf[:base].reshape(g, 9)
    entries = buf[ptr_end:].reshape(nnz, 4)
    return {
        "scales": tiles[:, :2].view("<f2")[:, 0],
        "codes": tiles[:, 2:],
        "row_ptr": row_ptr,
        "col": entries[:, :2].view("<u2")[:, 0],
        "value": entries[:, 2:].view("<f2")[:, 0],
    }


_TERN_VALUES = np.array([0.0, 1.0, -1.0], np.float32)  # base-3 code 0 -> 0, 1 -> +s, 2 -> -s
# byte -> the values of its five base-3 codes.
_TERN_LUT = _byte_table(_TERN_VALUES[(np.arange(256)[:, None] // 3 ** np.arange(5)) % 3])


def _q1t_decode(buf, shape, where):
    p = _q1t_parts(buf, shape, where)
    rows, cols = shape
    bad = np.flatnonzero(p["col"] >= cols)
    if bad.size:
        j = int(bad[0])
        off = 9 * _groups(shape) + 4 * (rows + 1) + 4 * j
        raise Bounds(f"{where}: q1t overlay entry {j} (byte {off}) has col {int(p['col'][j])}, rows have {cols}")
    vals = _expand(_TERN_LUT, p["codes"])[:, :GROUP]
    vals *= p["scales"].astype(np.float32)[:, None]
    out = _finish(vals, shape)
    row = np.repeat(np.arange(rows), np.diff(p["row_ptr"].astype(np.int64)))
    out[row, p["col"]] = p["value"].astype(np.float32)
    return out


Q1T_THRESHOLD = 0.7  # ternary threshold as a fraction of the group's mean |w| (TWN rule)


def _enc_q1t(w, outliers=Q1_OUTLIERS):
    """Per group: |w| <= 0.7 * mean|w| -> code 0, else sign codes with s = mean |w| of those
    elements; then the `outliers` fraction of largest-error elements go to the overlay (their
    base code is 0)."""
    w = np.asarray(w, dtype=np.float32)
    rows, cols = _q1t_rows_cols(w.shape, "q1t encoder")
    n = w.size
    wg = _group_pad(w)
    count = np.clip(n - GROUP * np.arange(wg.shape[0]), 1, GROUP)
    delta = Q1T_THRESHOLD * np.abs(wg).sum(axis=1) / count
    big = np.abs(wg) > delta[:, None]
    scale = _round_f16(np.where(big, np.abs(wg), 0).sum(axis=1) / np.maximum(big.sum(axis=1), 1))
    code = np.where(big, np.where(wg > 0, 1, 2), 0).astype(np.uint8)
    recon = _TERN_VALUES[code] * scale.astype(np.float32)[:, None]
    flat = w.reshape(-1)
    idx = _top_errors(np.abs(recon.reshape(-1)[:n] - flat), outliers)
    code.reshape(-1)[idx] = 0
    padded = np.zeros((wg.shape[0], 35), np.uint8)
    padded[:, :GROUP] = code
    packed = (padded.reshape(-1, 7, 5).astype(np.uint16) * 3 ** np.arange(5, dtype=np.uint16)).sum(axis=2)
    tiles = np.empty((wg.shape[0], 9), np.uint8)
    tiles[:, :2] = scale.astype("<f2").view(np.uint8).reshape(-1, 2)
    tiles[:, 2:] = packed
    row, col = np.divmod(idx, cols)
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(row, minlength=rows))]).astype("<u4")
    entries = np.empty((idx.size, 4), np.uint8)
    entries[:, :2] = col.astype("<u2").view(np.uint8).reshape(-1, 2)
    entries[:, 2:] = flat[idx].astype("<f2").view(np.uint8).reshape(-1, 2)
    return _to_bytes(tiles, row_ptr, entries)


# ---------------------------------------------------------------- the table


def _reserved(id_: int, name: str) -> DType:
    return DType(id_, name, False, _no_size, None, None)


DTYPES: dict[int, DType] = {
    dt.id: dt
    for dt in (
        DType(0, "f32", True, _plain(4), _f32_parts, _float_decode(_f32_parts), _enc_f32),
        DType(1, "f16", True, _plain(2), _f16_parts, _float_decode(_f16_parts), _enc_f16),
        DType(2, "bf16", True, _plain(2), _bf16_parts, _bf16_decode, _enc_bf16),
        DType(3, "q8_row", True, _q8_row_size, _q8_row_parts, _q8_row_decode, _enc_q8_row),
        DType(4, "q4_block", True, _q4_size, _q4_block_parts, _q4_decode(_q4_block_parts), _enc_q4_block),
        _reserved(5, "mix8_4"),
        DType(6, "u8", True, _no_size, _u8_parts, _u8_decode),
        _reserved(7, "q4_col"),
        DType(8, "vbit", True, _no_size, _vbit_parts, _vbit_decode(_vbit_parts), _enc_vbit, _vbit_check),
        DType(9, "q8_2f", True, _q8_2f_size, _q8_2f_parts, _q8_2f_decode, _enc_q8_2f),
        DType(10, "vbit_ro", True, _no_size, _vbit_ro_parts, _vbit_decode(_vbit_ro_parts), _enc_vbit_ro, _vbit_ro_check),
        DType(11, "q4_tiled", True, _q4_size, _q4_tiled_parts, _q4_decode(_q4_tiled_parts), _enc_q4_tiled),
        DType(12, "q1", True, _q1_size, _q1_parts, _q1_decode, _enc_q1),
        DType(13, "q1s", True, _no_size, _q1s_parts, _q1s_decode, _enc_q1s),
        DType(14, "q1t", True, _no_size, _q1t_parts, _q1t_decode, _enc_q1t),
        DType(15, "q4tp", True, _tp_size(16, "q4tp"), _q4tp_parts, _q4tp_decode, _enc_q4tp),
        DType(16, "q2tp", True, _tp_size(8, "q2tp"), _q2tp_parts, _q2tp_decode, _enc_q2tp),
    )
}

_BY_NAME = {dt.name: dt for dt in DTYPES.values()}


def dtype_for_id(id_: int, where: str = "") -> DType:
    """The DType of a directory id; an id the table does not know is `Parse` (spec §1.2)."""
    try:
        return DTYPES[id_]
    except KeyError:
        raise Parse(f"{where or 'tensor'}: unknown dtype id {id_} (known: 0..{max(DTYPES)})") from None


def dtype_by_name(name: str) -> DType:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise Parse(f"unknown dtype name {name!r} (known: {', '.join(_BY_NAME)})") from None
