"""The cmf-native recipe: a q4_block / q8_row CMF's own codes and scales in the Core ML
package, decoded by the executor's constexpr ops to exactly the CMF's values, and logits
that match the torch reference of that CMF; refusals when the CMF is out of reach.
"""

import shutil

import numpy as np
import pytest
import torch

from _coreml_models import ARCH, VOCAB, random_weights
from coreml.convert import export_coreml
from coreml.mil.executor import Executor
from coreml.mil.loader import load_program
from coreml.package import open_package
from coreml.recipes import RecipePrecondition, compress_package
from pipeline.stages.bundle import export_bundle
from pipeline.ground.cmf import open_cmf, write_cmf
from pipeline.ground.reference import load_reference

# The package computes in fp32 like the torch reference; 1e-4 is the FP32 conversion's own
# bound on these O(1) logits (tests/test_coreml_recipes.py TOLERANCE).
TOLERANCE = 1e-4


def _package(root, dtype):
    cmf = root / f"tiny-{dtype}.cmf"
    write_cmf(cmf, arch=ARCH, tensors=[(n, w, dtype if w.ndim == 2 else "f32") for n, w in random_weights(2).items()])
    export_bundle(cmf, root / "bundle")
    return cmf, export_coreml(root / "bundle", root / "packages", kinds=("stateless",))["stateless"]


@pytest.fixture(scope="module", params=["q4_block", "q8_row"])
def native(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"native-{request.param}")
    cmf, package = _package(root, request.param)
    return request.param, cmf, package, compress_package(package.path, "cmf-native", root / "native")


def test_package_constants_decode_bitwise_to_the_cmf(native):
    dtype, cmf_path, _, manifest = native
    constants = Executor(load_program(manifest.path / "model.mlpackage")).constants
    carried = {e["hf_names"][0]: e for e in manifest["selection"]["weights"].values() if e["compressed"]}
    with open_cmf(cmf_path) as cmf:
        matrices = [n for n, i in cmf.tensors.items() if len(i.shape) == 2 and np.prod(i.shape) > 2048]
        assert sorted(carried) == sorted(matrices)
        for name, entry in carried.items():
            assert entry["cmf_dtype"] == dtype and entry["chain"] == ["constexpr_blockwise_shift_scale"]
            got = np.asarray(constants[entry["compressed_as"]])
            # Bitwise by construction: int4/int8 codes times an fp16 scale widened to fp32 have at
            # most 8 + 11 significant bits, so the op's fp32 product and the CMF decoder's are exact.
            assert got.dtype == np.float32
            np.testing.assert_array_equal(got.view(np.uint32), cmf.decode(name).view(np.uint32))


def test_logits_match_the_torch_reference_of_the_cmf(native):
    _, cmf_path, _, manifest = native
    model, _, _ = load_reference(cmf_path)
    ids = np.random.default_rng(4).integers(0, VOCAB, 40).astype(np.int32)
    logits = open_package(manifest.path, backend="executor").predict({"input_ids": ids[None]})["logits"][0]
    with torch.no_grad():
        want = model(torch.tensor(ids, dtype=torch.long)).numpy()
    assert np.abs(logits - want).max() <= TOLERANCE


def test_what_stays_fp32_is_recorded_and_the_package_is_smaller(native):
    dtype, _, package, manifest = native
    weights = manifest["selection"]["weights"]
    carried = [e for e in weights.values() if e["compressed"]]
    assert len(carried) == sum(1 for e in weights.values() if e["hf_names"])  # every large matrix is quantized

    def stored(shape):  # codes plus fp32 scales: one per 32 (q4_block) or per row (q8_row)
        rows, cols = shape
        return rows * cols // 2 + rows * cols // 32 * 4 if dtype == "q4_block" else rows * cols + rows * 4

    saved = sum(4 * np.prod(e["shape"]) - stored(e["shape"]) for e in carried)
    # weight.bin aligns every blob to 64 bytes behind a 64-byte header: at most 3 blobs and
    # 128 bytes of slack each (codes, scale, and the FP32 blob that is gone).
    assert abs(package["package_bytes"] - manifest["size_bytes"] - saved) <= 3 * 128 * len(carried)


def test_an_f32_cmf_carries_nothing_and_says_why(tmp_path):
    _, package = _package(tmp_path, "f32")
    manifest = compress_package(package.path, "cmf-native", tmp_path / "native")
    reasons = {e["reason"] for e in manifest["selection"]["weights"].values() if not e["compressed"]}
    assert reasons == {"CMF dtype f32: nothing to carry beyond float32"}


def test_refused_when_the_cmf_is_out_of_reach(tmp_path):
    cmf, package = _package(tmp_path, "q4_block")
    shutil.move(cmf, tmp_path / "elsewhere.cmf")
    with pytest.raises(RecipePrecondition, match="does not reach a CMF file"):
        compress_package(package.path, "cmf-native", tmp_path / "native")
    assert not (tmp_path / "native").exists()
