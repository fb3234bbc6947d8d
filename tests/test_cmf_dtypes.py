"""The dtype table against the independent conformance vectors, plus encoder round trips.

Payloads are sliced straight from the container bytes using each case's JSON,
so these tests depend only on pipeline.cmf.dtypes, not on the reader.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.cmf.dtypes import DTYPES, dtype_by_name, dtype_for_id
from pipeline.cmf.errors import Bounds, Parse

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
