"""The dtype table against the independent conformance vectors, plus encoder round trips.

Payloads are sliced straight from the container bytes using each case's JSON,
so these tests depend only on pipeline.ground.cmf.dtypes, not on the reader.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.ground.cmf.dtypes import DTYPES, dtype_by_name, dtype_for_id
from pipeline.ground.cmf.errors import Bounds, Parse
from pipeline.ground.models.numerics import gamma

CONF = Path("/work/shared/cmf-conformance")


def _decodable_cases():
    index = json.loads((CONF / "index.json").read_text())
    return [c["case"] for c in index if c["expected_npz"]]


def _payloads(case: str):
    """(tensor record, uint8 payload) for every tensor of an opening case."""
    meta = json.loads((CONF / f"{case}.json").read_text())
    files = {}
    if "shards" in meta:
        for sh in meta["shards"]:
            files[sh["shard"]["no"]] = (CONF / sh["file"], sh["envelope"]["data_off"])
    else:
        files[None] = (CONF / meta["open"], meta["envelope"]["data_off"])
    blobs = {k: (np.fromfile(path, np.uint8), off) for k, (path, off) in files.items()}
    for t in meta["tensors"]:
        data, data_off = blobs[t.get("shard_no")]
        start = data_off + t["off"]
        yield meta, t, data[start : start + t["nbytes"]]


@pytest.mark.parametrize("case", _decodable_cases())
def test_decode_matches_conformance(case):
    with np.load(CONF / f"{case}.expected.npz", allow_pickle=False) as npz:
        expected = {k: npz[k] for k in npz.files}
    checked = 0
    for meta, t, buf in _payloads(case):
        dt = DTYPES[t["dtype_id"]]
        assert dt.name == t["dtype"]
        dt.check_payload(buf, tuple(t["shape"]))
        if not t["decodable"]:
            assert not dt.decodable
            with pytest.raises(Parse, match=dt.name):
                dt.decode(buf, tuple(t["shape"]), where=t["name"])
            continue
        got = dt.decode(buf, tuple(t["shape"]))
        want = expected[t["npz_key"]]
        assert got.dtype == np.float32 and got.shape == want.shape, t["name"]
        if meta["comparison"][t["name"]] == "exact":
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=t["name"])
        else:
            assert meta["comparison"][t["name"]] == "rtol=1e-5"
            np.testing.assert_array_equal(got == 0, want == 0, err_msg=t["name"])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=0, err_msg=t["name"])
        checked += 1
    assert checked == len(expected)


# ---------------------------------------------------------------- encoders: round trips

import torch  # noqa: E402  (independent bf16 rounding reference)
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

F16 = np.float16


def _weights(shape, seed, amp=1.0, zero_rows=0):
    """Gaussian weights whose per-row amplitude spreads over 3 decades, some rows all zero."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * np.float32(amp)
    if len(shape) == 2:
        w *= (10 ** rng.uniform(-2, 1, size=(shape[0], 1))).astype(np.float32)
        w[: min(zero_rows, shape[0])] = 0
    return w


def _f(x):
    return np.asarray(x, dtype=np.float64)


def _roundtrip(name, w, **opts):
    dt = dtype_by_name(name)
    payload = dt.encode(w, **opts)
    assert payload.dtype == np.uint8 and payload.ndim == 1
    dt.check_payload(payload, w.shape)
    out = dt.decode(payload, w.shape)
    assert out.dtype == np.float32 and out.shape == w.shape
    return dt.parts(payload, w.shape), out


def _absmax_bound(wg, s, top):
    """Worst error of round-to-nearest onto {..., top} * s: half a step, or the clipped excess."""
    s = _f(s)
    return np.maximum(s / 2, np.abs(_f(wg)).max(axis=-1) - top * s) * (1 + 1e-6) + 1e-30


def _pad32(x):
    flat = _f(x).reshape(-1)
    return np.concatenate([flat, np.zeros(-flat.size % 32)]).reshape(-1, 32)


def test_float_encoders_match_numpy_and_torch():
    w = np.array([0.0, -0.0, 1.0, 1 / 3, 65504.0, 7e4, 1e-8, -3.14159, np.inf, -np.inf, np.nan], np.float32)
    w = np.concatenate([w, _weights((64,), 0)])
    np.testing.assert_array_equal(_roundtrip("f32", w)[1].view(np.uint32), w.view(np.uint32))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(_roundtrip("f16", w)[1], w.astype(np.float16).astype(np.float32))
    want = torch.from_numpy(w).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(_roundtrip("bf16", w)[1], want)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.integers(1, 70), st.integers(0, 2**31), st.integers(0, 2))
def test_q8_row_within_half_step(rows, cols, seed, zero_rows):
    w = _weights((rows, cols), seed, zero_rows=zero_rows)
    p, out = _roundtrip("q8_row", w)
    np.testing.assert_array_equal(p["scale"], (np.abs(w).max(axis=1) / 127).astype(F16))
    bound = _absmax_bound(w, p["scale"].astype(np.float32), 127)
    assert np.all(np.abs(_f(out) - _f(w)) <= bound[:, None])


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.integers(1, 70), st.integers(0, 2**31), st.integers(0, 2))
@example(8, 31, 8, 0)  # a column RMS next to an fp16 rounding boundary
def test_q8_2f_within_half_step(rows, cols, seed, zero_rows):
    w = _weights((rows, cols), seed, zero_rows=zero_rows)
    p, out = _roundtrip("q8_2f", w)
    # The encoder's float32 RMS of a column errs by at most gamma_{rows+3} of the exact one (a
    # sum of squares, a division, a root); its fp16 is the rounding of some value in that
    # interval: between the fp16 roundings of the interval's ends (a value next to an fp16
    # rounding boundary may land either side).
    rms = np.maximum(np.sqrt(np.mean(_f(w) ** 2, axis=0)), 6.104e-5)
    slack = gamma(rows + 3)
    assert np.all(((rms * (1 - slack)).astype(F16) <= p["col"]) & (p["col"] <= (rms * (1 + slack)).astype(F16)))
    col = p["col"]
    wc = _f(w) / _f(col)
    # Error in the column-normalised domain, mapped back through col; the slack covers the
    # float32 roundings of w / col and of the decoder's product.
    bound = _absmax_bound(wc, p["row"], 127)[:, None] * _f(col) + 1e-6 * np.abs(_f(w))
    assert np.all(np.abs(_f(out) - _f(w)) <= bound)


_flat_shapes = st.lists(st.integers(1, 13), min_size=0, max_size=4).map(tuple)


@settings(max_examples=40, deadline=None)
@given(_flat_shapes, st.integers(0, 2**31), st.sampled_from(["q4_block", "q4_tiled"]))
def test_q4_flattened_within_half_step(shape, seed, name):
    w = _weights(shape, seed)
    p, out = _roundtrip(name, w)
    wg = _pad32(w)
    np.testing.assert_array_equal(p["scales"], (np.abs(wg).max(axis=1) / 7).astype(F16))
    bound = _absmax_bound(wg, p["scales"].astype(np.float32), 7)
    assert np.all(np.abs(_pad32(out) - wg) <= bound[:, None])


def test_q4_tiled_holds_q4_block_values():
    w = _weights((5, 77), 3)
    block, tiled = dtype_by_name("q4_block"), dtype_by_name("q4_tiled")
    np.testing.assert_array_equal(tiled.decode(tiled.encode(w), w.shape), block.decode(block.encode(w), w.shape))
    # Element 2k is the low nibble of byte k: read the planes by hand.
    p = block.parts(block.encode(w), w.shape)
    q = np.empty((p["nibbles"].shape[0], 32), np.int64)
    q[:, 0::2], q[:, 1::2] = p["nibbles"] & 15, p["nibbles"] >> 4
    by_hand = ((q - 8) * p["scales"].astype(np.float32)[:, None]).astype(np.float32).reshape(-1)[: w.size]
    np.testing.assert_array_equal(block.decode(block.encode(w), w.shape).reshape(-1), by_hand)


def _ref_ladder_row(lo, step):
    """The spec's ladder, one scalar at a time: t0 = exp2(lo), t[c] = t[c-1] * exp2(step) in float32."""
    mult = np.float32(2.0 ** float(np.float32(step)))  # float64 exp2 rounded once: a correctly rounded exp2f
    t = [np.float32(2.0 ** float(np.float32(lo)))]
    for _ in range(31):
        t.append(np.float32(t[-1] * mult))
    return t


def _ref_tp_decode(payload, rows, cols, plane_bytes):
    """Straightforward per-row, per-group decode of q4tp (plane_bytes 16) or q2tp (8)."""
    gpr = cols // 32
    cb = -(-gpr * 5 // 8)
    buf = payload.tobytes()
    params_at = rows * gpr * plane_bytes
    codes_at = params_at + 4 * rows
    out = np.zeros((rows, cols), np.float32)
    for r in range(rows):
        lo, step = np.frombuffer(buf, "<f2", 2, params_at + 4 * r)
        t = _ref_ladder_row(lo, step)
        code_bits = int.from_bytes(buf[codes_at + cb * r : codes_at + cb * (r + 1)], "little")
        for g in range(gpr):
            c = (code_bits >> (5 * g)) & 31
            plane = buf[(r * gpr + g) * plane_bytes : (r * gpr + g + 1) * plane_bytes]
            for e in range(32):
                if plane_bytes == 16:
                    q = (plane[e // 2] >> (4 * (e % 2))) & 15
                    out[r, 32 * g + e] = np.float32(q - 8) * t[c]
                else:
                    q = (plane[e // 4] >> (2 * (e % 4))) & 3
                    out[r, 32 * g + e] = 0.0 if c == 0 else np.float32(q - 1.5) * t[c - 1]
    return out


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31), st.integers(0, 1))
def test_q4tp_encode_decodes_like_an_independent_decoder(rows, gpr, seed, zero_rows):
    w = _weights((rows, 32 * gpr), seed, zero_rows=zero_rows)
    w[-1, :32] = 0  # an all-zero group inside a live row
    p, out = _roundtrip("q4tp", w)
    ref = _ref_tp_decode(dtype_by_name("q4tp").encode(w), rows, 32 * gpr, 16)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=0)
    np.testing.assert_array_equal(out == 0, ref == 0)
    # Each group errs by at most half its rung, or by what a too-small rung clips.
    wg = _f(w).reshape(rows, gpr, 32)
    rung = np.abs(_f(out).reshape(rows, gpr, 32)).max(axis=2)
    nib = p["nibbles"]
    q_abs = np.maximum(np.abs((nib & 15).astype(int) - 8), np.abs((nib >> 4).astype(int) - 8)).max(axis=2)
    t = np.where(q_abs > 0, rung / np.maximum(q_abs, 1), 0)
    err = np.abs(_f(out).reshape(rows, gpr, 32) - wg).max(axis=2)
    live = q_abs > 0
    assert np.all(err[live] <= _absmax_bound(wg, t, 7)[live])
    assert np.all(err[~live] <= np.abs(wg).max(axis=2)[~live])  # whole group rounded to zero


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31), st.integers(0, 1))
def test_q2tp_encode_decodes_like_an_independent_decoder(rows, gpr, seed, zero_rows):
    w = _weights((rows, 32 * gpr), seed, zero_rows=zero_rows)
    w[-1, :32] = 0
    _, out = _roundtrip("q2tp", w)
    ref = _ref_tp_decode(dtype_by_name("q2tp").encode(w), rows, 32 * gpr, 8)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=0)
    np.testing.assert_array_equal(out == 0, ref == 0)
    assert np.all(out[-1, :32] == 0) and np.all(out[:zero_rows] == 0)
    # 2-bit values are +-0.5s and +-1.5s: the group's largest |value| is 1.5 s.
    wg = _f(w).reshape(rows, gpr, 32)
    s = np.abs(_f(out).reshape(rows, gpr, 32)).max(axis=2) / 1.5
    live = s > 0
    err = np.abs(_f(out).reshape(rows, gpr, 32) - wg).max(axis=2)
    # Levels are 1 s apart; beyond +-1.5 s a rung below absmax/1.5 clips.
    assert np.all(err[live] <= _absmax_bound(wg, s, 1.5)[live])


def _ref_vbit_decode(payload, rows, cols, with_offsets):
    """Bit-by-bit reader of the MSB-first rows."""
    buf = payload.tobytes()
    gpr = cols // 32
    bits = list(buf[:rows])
    scales = np.frombuffer(buf, "<f2", rows * gpr, rows).reshape(rows, gpr)
    at = rows + 2 * rows * gpr + (4 * (rows + 1) if with_offsets else 0)
    out = np.zeros((rows, cols), np.float32)
    for r, b in enumerate(bits):
        nbytes = -(-cols * b // 8)
        stream = "".join(f"{byte:08b}" for byte in buf[at : at + nbytes])
        for i in range(cols):
            u = int(stream[i * b : (i + 1) * b], 2)
            out[r, i] = np.float32(u - (2 ** (b - 1) - 1)) * np.float32(scales[r, i // 32])
        at += nbytes
    return out


@pytest.mark.parametrize("name", ["vbit", "vbit_ro"])
@pytest.mark.parametrize("b", [3, 4, 5, 6, 8])
def test_vbit_fixed_width_within_half_step(name, b):
    w = _weights((5, 96), b, zero_rows=1)
    p, out = _roundtrip(name, w, bits=b)
    assert np.all(p["bits"] == b)
    L = 2 ** (b - 1) - 1
    wg = _f(w).reshape(5, 3, 32)
    np.testing.assert_array_equal(p["scales"], (np.abs(wg).max(axis=2) / L).astype(F16))
    bound = _absmax_bound(wg, p["scales"], L)
    assert np.all(np.abs(_f(out).reshape(5, 3, 32) - wg) <= bound[..., None])
    np.testing.assert_array_equal(out, _ref_vbit_decode(dtype_by_name(name).encode(w, bits=b), 5, 96, name == "vbit_ro"))


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**31))
def test_vbit_width_rule_is_smallest_meeting_the_target(rows, gpr, seed):
    rng = np.random.default_rng(seed)
    # Heavy- and light-tailed rows, so different rows need different widths.
    w = (rng.standard_t(rng.uniform(1, 30, (rows, 1)), (rows, 32 * gpr))).astype(np.float32)
    dt = dtype_by_name("vbit")
    payload = dt.encode(w, rel_rmse=0.05)
    bits = dt.parts(payload, w.shape)["bits"]
    np.testing.assert_array_equal(
        dtype_by_name("vbit_ro").decode(dtype_by_name("vbit_ro").encode(w, rel_rmse=0.05), w.shape),
        dt.decode(payload, w.shape),
    )
    rms = np.sqrt(np.mean(_f(w) ** 2, axis=1))
    widths = [3, 4, 5, 6, 8]
    for r in range(rows):
        def rmse(b):
            row = w[r : r + 1]
            got = dt.decode(dt.encode(row, bits=b), row.shape)
            return np.sqrt(np.mean((_f(got) - _f(row)) ** 2))

        b = int(bits[r])
        assert b == 8 or rmse(b) <= 0.05 * rms[r]
        if b != 3:
            assert rmse(widths[widths.index(b) - 1]) > 0.05 * rms[r]


@settings(max_examples=30, deadline=None)
@given(_flat_shapes, st.integers(0, 2**31))
def test_q1_is_sign_times_mean_abs(shape, seed):
    w = _weights(shape, seed)
    p, out = _roundtrip("q1", w)
    # Summed in float32 as the encoder sums (`_pad32` widens to float64, whose sum rounded to
    # fp16 lands on the other side of a tie for some inputs: seed 19091003, shape (8, 9, 12)).
    wg = _pad32(w).astype(np.float32)
    count = np.clip(w.size - 32 * np.arange(wg.shape[0]), 1, 32)
    np.testing.assert_array_equal(p["scales"], (np.abs(wg).sum(axis=1) / count).astype(F16))
    s = np.repeat(p["scales"].astype(np.float32), 32)[: w.size]
    np.testing.assert_array_equal(out.reshape(-1), np.where(w.reshape(-1) >= 0, s, -s))


@settings(max_examples=30, deadline=None)
@given(_flat_shapes, st.integers(0, 2**31), st.sampled_from([0.0, 0.01, 0.1]))
def test_q1s_overlays_the_largest_errors(shape, seed, fraction):
    w = _weights(shape, seed)
    q1 = dtype_by_name("q1")
    base = q1.decode(q1.encode(w), w.shape).reshape(-1)
    p, out = _roundtrip("q1s", w, outliers=fraction)
    idx = p["index"].astype(np.int64)
    assert idx.size == round(fraction * w.size)
    flat, got = w.reshape(-1), out.reshape(-1)
    np.testing.assert_array_equal(got[idx], flat[idx].astype(F16).astype(np.float32))
    rest = np.setdiff1d(np.arange(w.size), idx)
    np.testing.assert_array_equal(got[rest], base[rest])
    if idx.size and rest.size:
        assert np.abs(base[rest] - flat[rest]).max() <= np.abs(base[idx] - flat[idx]).min()


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 8), st.integers(1, 80), st.integers(0, 2**31), st.sampled_from([0.0, 0.02]))
def test_q1t_ternary_with_overlay(rows, cols, seed, fraction):
    w = _weights((rows, cols), seed)
    p, out = _roundtrip("q1t", w, outliers=fraction)
    flat, got = _f(w).reshape(-1), _f(out).reshape(-1)
    row = np.repeat(np.arange(rows), np.diff(p["row_ptr"].astype(np.int64)))
    idx = row * cols + p["col"]
    assert idx.size == round(fraction * w.size)
    np.testing.assert_array_equal(got[idx], flat[idx].astype(F16))
    # Off the overlay every value is 0 or +-s of its group, by the 0.7 * mean|w| threshold.
    wg, og = _pad32(w), _pad32(out)
    count = np.clip(w.size - 32 * np.arange(wg.shape[0]), 1, 32)
    delta = 0.7 * np.abs(wg).sum(axis=1) / count
    s = _f(p["scales"])[:, None]
    on_overlay = np.zeros(wg.size, bool)
    on_overlay[idx] = True
    on_overlay = on_overlay.reshape(wg.shape)
    want = np.where(np.abs(wg) > delta[:, None], np.sign(wg) * s, 0)
    np.testing.assert_array_equal(og[~on_overlay], want[~on_overlay])


# ---------------------------------------------------------------- bad payloads, planes, lookups


def test_planes_are_zero_copy_views():
    w = _weights((4, 64), 7)
    for dt in DTYPES.values():
        if dt.encode is None:
            continue
        payload = dt.encode(w)
        for name, plane in dt.parts(payload, w.shape).items():
            assert np.shares_memory(plane, payload), (dt.name, name)


def test_f32_decode_is_the_payload_itself():
    w = _weights((4, 64), 7)
    payload = dtype_by_name("f32").encode(w)
    payload.flags.writeable = False  # as the reader's views over its read-only mmap are
    out = dtype_by_name("f32").decode(payload, w.shape)
    assert np.shares_memory(out, payload) and not out.flags.writeable
    np.testing.assert_array_equal(out, w)


def test_vbit_bad_width_and_length_are_bounds():
    dt = dtype_by_name("vbit")
    payload = dt.encode(_weights((3, 32), 1), bits=4).copy()
    payload[1] = 7
    with pytest.raises(Bounds, match="row 1 .* width 7"):
        dt.check_payload(payload, (3, 32), where="m.cmf: t")
    good = dt.encode(_weights((3, 32), 1), bits=4)
    with pytest.raises(Bounds, match="needs 48"):
        dt.check_payload(good[:-1], (3, 32))
    ro = dtype_by_name("vbit_ro")
    payload = ro.encode(_weights((3, 32), 1), bits=4).copy()
    offsets_at = 3 + 2 * 3
    payload[offsets_at + 4] = 15  # offsets[1] should be 16
    with pytest.raises(Bounds, match=r"offsets\[1\] = 15"):
        ro.check_payload(payload, (3, 32))


def test_overlay_indices_out_of_range_are_bounds():
    q1s = dtype_by_name("q1s")
    payload = q1s.encode(_weights((40,), 2), outliers=0.1).copy()
    at = 6 * 2 + 4  # first record's index
    payload[at : at + 4] = np.array([40], "<u4").view(np.uint8)
    with pytest.raises(Bounds, match="index 40"):
        q1s.decode(payload, (40,))
    with pytest.raises(Bounds, match="count"):
        q1s.decode(payload[:-1], (40,))
    q1t = dtype_by_name("q1t")
    payload = q1t.encode(_weights((2, 32), 2), outliers=0.1).copy()
    at = 9 * 2 + 4 * 3
    payload[at : at + 2] = np.array([32], "<u2").view(np.uint8)
    with pytest.raises(Bounds, match="col 32"):
        q1t.decode(payload, (2, 32))
    payload = q1t.encode(_weights((3, 32), 2), outliers=0.1).copy()
    ptr_at = 9 * 3
    payload[ptr_at + 4 : ptr_at + 8] = np.array([11], "<u4").view(np.uint8)  # above row_ptr[3] = 10
    with pytest.raises(Bounds, match=r"row_ptr\[2\] .* below row_ptr\[1\] = 11"):
        q1t.decode(payload, (3, 32))


def test_reserved_unknown_and_misshapen():
    for id_, name in [(5, "mix8_4"), (7, "q4_col")]:
        dt = dtype_for_id(id_)
        assert not dt.decodable and dt.fixed_nbytes((4, 4)) is None and dt.encode is None
        with pytest.raises(Parse, match=name):
            dt.decode(np.zeros(16, np.uint8), (4, 4), where="f.cmf: t")
    with pytest.raises(Parse, match="unknown dtype id 17"):
        dtype_for_id(17, "f.cmf: tensor x")
    with pytest.raises(Parse, match="2-D"):
        dtype_by_name("q8_row").fixed_nbytes((2, 2, 2))
    with pytest.raises(Parse, match="in % 32"):
        dtype_by_name("q4tp").fixed_nbytes((2, 48))
    with pytest.raises(Bounds, match="needs 36"):
        dtype_by_name("q4_block").decode(np.zeros(35, np.uint8), (40,))
    with pytest.raises(Bounds, match="needs 5"):
        dtype_by_name("u8").decode(np.zeros(4, np.uint8), (5,))
    assert [DTYPES[i].name for i in range(17)] == [
        "f32", "f16", "bf16", "q8_row", "q4_block", "mix8_4", "u8", "q4_col", "vbit",
        "q8_2f", "vbit_ro", "q4_tiled", "q1", "q1s", "q1t", "q4tp", "q2tp",
    ]  # fmt: skip


@pytest.mark.parametrize("dt", [dt for dt in DTYPES.values() if dt.encode is not None], ids=lambda dt: dt.name)
def test_empty_tensors_round_trip(dt):
    flattened = dt.name in ("f32", "f16", "bf16", "q4_block", "q4_tiled", "q1", "q1s")
    for shape in [(0, 64), (3, 0)] + ([(0,)] if flattened else []):
        w = np.zeros(shape, np.float32)
        assert dt.decode(dt.encode(w), shape).shape == shape
