"""Core ML itself (macOS) against the numpy executor on the same saved packages.

This is the check that the executor's MIL semantics are Core ML's: both engines run every
variant from tests/_mil_modules.py. Linux cannot run Core ML, so the module is skipped there,
visibly. The tolerance is an fp32 one (Core ML may fuse and reorder fp32 arithmetic); it has not
yet been measured on a Mac.
"""

import sys

import numpy as np
import pytest

import _mil_modules as mm
from coreml.package import open_package

pytestmark = [
    pytest.mark.macos,
    pytest.mark.skipif(sys.platform != "darwin", reason="Core ML prediction needs macOS; the executor tests cover Linux"),
]

TOL = 1e-3


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return mm.build_packages(tmp_path_factory.mktemp("mil-macos"))["paths"]


def _ids(T, seed):
    return np.random.default_rng(seed).integers(0, mm.VOCAB, size=(1, T), dtype=np.int32)


def _pair(path, **kw):
    mac, ref = open_package(path, backend="macos", **kw), open_package(path, backend="executor", **kw)
    assert mac.backend == "coreml-macos" and ref.backend == "coreml-executor"
    assert mac.spec_inputs.keys() == ref.spec_inputs.keys()
    return mac, ref


@pytest.mark.parametrize("name", ["stateless", *mm.COMPRESSED])
def test_stateless_and_compressed_agree(paths, name):
    mac, ref = _pair(paths[name])
    for T in (1, 9, 64):
        feed = {"ids": _ids(T, T)}
        assert np.abs(mac.predict(feed)["logits"] - ref.predict(feed)["logits"]).max() <= TOL


def test_kv_agrees(paths):
    mac, ref = _pair(paths["kv"])
    cache = np.zeros(mm.cache_shape(), np.float32)
    feed = {"ids": _ids(6, 0), "position": np.array([2], np.int32), "k_cache": cache, "v_cache": cache}
    a, b = mac.predict(feed), ref.predict(feed)
    for key in ("logits", "k_out", "v_out"):
        assert np.abs(a[key] - b[key]).max() <= TOL


def test_kv_batch_prediction_agrees(paths):
    """Core ML's batch prediction (scoring's branches) against the executor's `run_batch`."""
    mac, ref = _pair(paths["kv"])
    cache = np.zeros(mm.cache_shape(), np.float32)
    feeds = [{"ids": _ids(T, T), "position": np.array([pos], np.int32), "k_cache": cache, "v_cache": cache}
             for pos, T in ((0, 5), (3, 1), (7, 9))]
    for a, b in zip(mac.predict_batch(feeds), ref.predict_batch(feeds)):
        for key in ("logits", "k_out", "v_out"):
            assert a[key].shape == b[key].shape and np.abs(a[key] - b[key]).max() <= TOL


def test_stateful_agrees(paths):
    mac, ref = _pair(paths["stateful"])
    mac_state, ref_state = mac.make_state(), ref.make_state()
    for step, (pos, T) in enumerate(((0, 5), (5, 1), (6, 4))):
        feed = {"ids": _ids(T, step), "position": np.array([pos], np.int32)}
        a = mac.predict(feed, state=mac_state)["logits"]
        b = ref.predict(feed, state=ref_state)["logits"]
        assert np.abs(a - b).max() <= TOL
    for name in ("k_cache", "v_cache"):
        assert np.abs(mac_state.read_state(name).astype(np.float32) - ref_state.read_state(name)).max() <= TOL


def test_multifunction_agrees(paths):
    mac, ref = _pair(paths["multi"], function_name="prefill")
    feed = {"ids": _ids(7, 3)}
    assert np.abs(mac.predict(feed)["logits"] - ref.predict(feed)["logits"]).max() <= TOL
