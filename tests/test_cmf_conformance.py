"""The reader, verifier and mask decoder against every conformance vector (independent implementation)."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.ground.cmf import hash64, open_cmf, verify_cmf
from pipeline.ground.cmf.errors import CmfError
from pipeline.ground.cmf.masks import pack_rows

VECTORS = Path("/work/shared/cmf-conformance")
CASES = [c["case"] for c in json.loads((VECTORS / "index.json").read_text())]
OPENING = [c for c in CASES if json.loads((VECTORS / f"{c}.json").read_text())["expect"]["open_ok"]]
FAILING = [c for c in CASES if c not in OPENING]


def load(case: str) -> dict:
    return json.loads((VECTORS / f"{case}.json").read_text())


@pytest.fixture(params=OPENING)
def opened(request):
    spec = load(request.param)
    with open_cmf(VECTORS / spec["open"]) as cmf:
        yield spec, cmf


def test_every_case_is_covered():
    assert len(CASES) == 48 and len(FAILING) == 16


@pytest.mark.parametrize("case", FAILING)
def test_refused_at_open_with_the_expected_kind(case):
    spec = load(case)
    with pytest.raises(CmfError) as info:
        open_cmf(VECTORS / spec["open"])
    assert info.value.kind == spec["expect"]["error"]
    # Messages name the file they are about.
    assert spec["open"] in str(info.value)


def test_envelope_and_directory(opened):
    spec, cmf = opened
    env = cmf.envelope
    for key, want in spec["envelope"].items():
        if key == "magic_hex":
            assert env.magic.hex() == want
        elif key in ("header_hash", "dir_hash"):
            assert f"{getattr(env, key):016x}" == want
        else:
            assert getattr(env, key) == want, key
    assert cmf.required_features == spec["required_features"]
    assert cmf.arch == spec["arch"]
    assert cmf.header.get("quant_type") == spec["quant_type"]
    got = []
    for info in cmf.tensors.values():
        row = {
            "name": info.name,
            "dtype_id": info.dtype.id,
            "dtype": info.dtype.name,
            "shape": list(info.shape),
            "off": info.off - cmf.envelope_of(info.shard_no).data_off,
            "nbytes": info.nbytes,
            "hash64": f"{info.hash64:016x}",
            "decodable": info.dtype.decodable,
        }
        if "shards" in spec:
            row["shard_no"] = info.shard_no
        got.append(row)
    want = [{k: v for k, v in t.items() if k != "npz_key"} for t in spec["tensors"]]
    assert got == want


def test_verify(opened):
    spec, cmf = opened
    report = verify_cmf(cmf)
    assert report.ok == spec["expect"]["verify_ok"]
    assert [f.as_dict() for f in report.failures] == spec["expect"]["verify_failures"]
    for shard in spec.get("shards", []):
        assert shard["verify_ok"] == all(f.file != shard["file"] for f in report.failures)


def test_decode_matches_expected_arrays(opened):
    spec, cmf = opened
    npz_path = VECTORS / f"{spec['case']}.expected.npz"
    with np.load(npz_path, allow_pickle=False) as npz:
        for t in spec["tensors"]:
            if not t["decodable"]:
                with pytest.raises(CmfError):
                    cmf.decode(t["name"])
                continue
            got, want = cmf.decode(t["name"]), npz[t["npz_key"]]
            assert got.dtype == np.float32 and got.shape == want.shape, t["name"]
            if spec["comparison"][t["name"]] == "exact":
                np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=t["name"])
            else:
                assert spec["comparison"][t["name"]] == "rtol=1e-5"
                assert np.all(np.abs(got - want) <= 1e-5 * np.abs(want)), t["name"]
                assert np.array_equal(got == 0, want == 0), t["name"]


def test_raw_is_a_zero_copy_view(opened):
    spec, cmf = opened
    corrupted = {f["name"] for f in spec["expect"]["verify_failures"] if f["what"] == "tensor"}
    for name, info in cmf.tensors.items():
        raw = cmf.raw(name)
        assert raw.dtype == np.uint8 and raw.size == info.nbytes and not raw.flags.owndata
        assert (hash64(raw) == info.hash64) == (name not in corrupted)


def test_masks(opened):
    spec, cmf = opened
    want = spec["masks"]
    if want is None:
        assert cmf.masks is None
        return
    masks = cmf.masks
    assert masks.meta == want["meta"]
    assert masks.default_task == want["meta"]["default_task"]
    assert hash64(cmf.section_bytes("masks")) == int(want["section_hash64"], 16)
    assert len(masks.tasks) == want["n_masks"]
    for task, dec in zip(masks.tasks, want["decoded"], strict=True):
        assert (task.task_id, task.name) == (dec["task_id"], dec["name"])
        assert [pack_rows(r[None]).hex() for r in task.ffn] == dec["ffn_masks_hex"]
        assert [pack_rows(r[None]).hex() for r in task.heads] == dec["head_masks_hex"]
        assert task.visit_gates.tolist() == dec["layer_gates"]
        experts = [] if task.experts is None else [pack_rows(r[None]).hex() for r in task.experts]
        assert experts == dec["expert_masks_hex"]
        assert task.ffn.sum(axis=1).tolist() == dec["ffn_active_counts"]


def test_sparse_index_vocab_and_chat_bundle(opened):
    spec, cmf = opened
    assert cmf.sparse_index == spec["sparse_index"]
    assert cmf.tokenizer_config == spec["tokenizer_config"]
    if spec["vocab"] is None:
        assert cmf.vocab is None
    else:
        vocab = cmf.vocab
        assert len(vocab) == spec["vocab"]["len"]
        assert f"{hash64(vocab):016x}" == spec["vocab"]["hash64"]
        assert hashlib.sha256(vocab).hexdigest() == spec["vocab"]["sha256"]
    assert (cmf.header.get("section_hashes") or None) == spec["header_section_hashes"]


@pytest.mark.parametrize("no", [1, 2, 3])
def test_any_shard_name_resolves_to_shard_one(no):
    spec = load("model_sharded_a")
    with open_cmf(VECTORS / spec["files"][no - 1]) as cmf:
        assert cmf.path.name == spec["open"]
        assert [p.name for p in cmf.paths] == spec["files"]
        for shard_no, shard in enumerate(spec["shards"], start=1):
            names = [n for n, t in cmf.tensors.items() if t.shard_no == shard_no]
            assert names == shard["tensors"]
            assert cmf.header_of(shard_no)["shard"] == shard["shard"]
