"""GPTQ palettes (`coreml.codes.gptq_palette`, the `palette4-gptq-*` recipes): the output error
they minimise against k-means palettes of the same LUTs, the LUT refit against an independent
least-squares solution, the package's constexpr op against the numpy decoding, the bits the
package stores against arithmetic on its shapes, and what the manifest records."""

import json

import numpy as np
import pytest

from _coreml_models import FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, make_bundle, random_weights
from coreml import codes
from coreml.ane import ane_report
from coreml.bits import bits_per_weight
from coreml.calibration import HESSIAN_WINDOWS, WINDOW, Calibration
from coreml.convert import export_coreml
from coreml.kinds.export import Conversion
from coreml.manifest import verify_package
from coreml.mil.executor import Executor
from coreml.mil.loader import load_program
from coreml.recipes import EMBEDDING, RECIPES, WEIGHT_THRESHOLD, RecipePrecondition, compress_package

ROUNDING = 2.0 ** -53
# A test-model layer's weights: q, k, v, o, gate, up, down.
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
LAYER_SHAPES = [(Q, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, Q), (FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)]


def _problem(rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A t(4)-tailed weight and the second moments of correlated inputs of unequal energy, as a
    real layer's are."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1024, cols)) @ rng.normal(size=(cols, cols)) * 0.1 + rng.normal(size=cols)
    return (rng.standard_t(4, size=(rows, cols)) * 0.02).astype(np.float32), x.T @ x / len(x)


def _row_errors(decoded: np.ndarray, w: np.ndarray, hessian: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's (w - w_hat) H (w - w_hat)^T, and the float64 rounding it may carry: the sum of
    cols^2 products errs by at most gamma_{cols^2 + 2} of the sum of their magnitudes."""
    e = np.asarray(decoded, np.float64) - w
    n = hessian.shape[0] ** 2 + 2
    return (np.einsum("ij,jk,ik->i", e, hessian, e),
            n * ROUNDING / (1 - n * ROUNDING) * np.einsum("ij,jk,ik->i", np.abs(e), np.abs(hessian), np.abs(e)))


@pytest.mark.parametrize("group", [(32, 32), (8, 128), (16, 64)])
def test_gptq_palette_errs_less_on_the_outputs_than_k_means_palettes_of_the_same_luts(group):
    """GPTQ minimises the layer's output error tr((W - W_hat) H (W - W_hat)^T), not the weights'
    own: on correlated inputs it must beat both the plain k-means palette and the one weighted by
    H_jj (SKM), which spend the same bits, for each geometry, LUTs in fp16."""
    w, h = _problem(64, 128, seed=1)
    gptq = codes.gptq_palette(w, h, 4, group)
    plain, skm = codes.kmeans_tiles(w, 4, group), codes.kmeans_tiles(w, 4, group, np.diag(h))
    error = {name: _row_errors(p.decode(), w, h)[0].sum() for name, p in
             {"gptq": gptq, "plain": plain, "skm": skm}.items()}
    assert error["gptq"] < error["plain"] and error["gptq"] < error["skm"], error
    assert gptq.lut.shape == (64 // group[0], 128 // group[1], 16) and gptq.lut.dtype == np.float16
    assert gptq.indices.dtype == np.uint8 and gptq.indices.max() <= 15
    assert gptq.bits() == plain.bits() == 64 * 128 * 4 + gptq.lut.size * 16


def test_no_band_errs_more_than_its_weighted_k_means_start():
    """Each band keeps the least output error of what it made, the H_jj-weighted k-means palette
    it started from among them, on the damped Hessian GPTQ works with."""
    w, h = _problem(48, 96, seed=2)
    damped = h + codes.GPTQ_DAMP * np.mean(np.diag(h)) * np.eye(len(h))
    for group in ((8, 96), (16, 32)):
        start = codes.kmeans_tiles(w, 4, group, np.diag(damped))
        got = codes.gptq_palette(w, h, 4, group, rounds=1)
        (mine, slack), (theirs, their_slack) = (_row_errors(p.decode(), w, damped) for p in (got, start))
        band = group[0]
        assert np.all(mine.reshape(-1, band).sum(1) <= theirs.reshape(-1, band).sum(1)
                      + slack.reshape(-1, band).sum(1) + their_slack.reshape(-1, band).sum(1))


@pytest.mark.parametrize("row_scale", [False, True])
def test_the_refit_is_the_least_squares_lut_of_the_codes(row_scale):
    """The refit's LUTs minimise the output error for the codes they are given: against the
    least-squares solution by numpy's lstsq on the explicit problem (each row's error through
    the Cholesky factor of H, every weight one equation in the entry its code names, times its
    row's scale where the palette has them), the refit's error is no larger than that optimum
    but for the float32 rounding of its products (2^-24 relative a product, entering the
    optimum's error at second order), and smaller than the k-means LUTs' it starts from."""
    w, h = _problem(16, 48, seed=3)
    w *= np.geomspace(0.1, 3.0, 16, dtype=np.float32)[:, None]  # rows of unequal ranges
    group = (8, 48)
    factor = codes.GptqFactor.of(h)
    weight = factor.live(w)
    assigned = codes.gptq_palette(w, h, 4, group, refit=False, row_scale=row_scale)
    refit = codes._refit_luts(factor.hessian, weight, assigned, group)
    lower = np.linalg.cholesky(factor.hessian)  # H = L L^T: e H e^T = |e L|^2
    scale = np.ones((16, 1)) if assigned.row_scale is None else assigned.row_scale.astype(np.float64)
    assert (assigned.row_scale is not None) == row_scale

    band = np.arange(16)[:, None] // 8

    def error(lut):  # float64 LUTs [bands, 1, 16], unrounded: what the refit solves for
        return _row_errors(lut[band, 0, assigned.indices] * scale, w, factor.hessian)[0].sum()

    optimum = np.empty_like(refit)
    for band in range(2):
        rows = slice(8 * band, 8 * band + 8)
        design = np.concatenate([(scale[i] * np.eye(16)[assigned.indices[i]].T @ lower).T
                                 for i in range(rows.start, rows.stop)])
        target = np.concatenate([weight[i] @ lower for i in range(rows.start, rows.stop)])
        optimum[band, 0] = np.linalg.lstsq(design, target, rcond=None)[0]
    assert error(refit) <= error(optimum) * (1 + 48 * 2.0 ** -24)
    assert error(refit) < error(assigned.lut.astype(np.float64))


def test_gptq_palette_codes_bands_in_row_blocks_each_as_on_its_own(monkeypatch):
    """A band's LUTs and codes depend on its own rows alone, so rows go through a block of whole
    bands at a time (bounded memory on a 262k-row head): each block is the same rows coded alone."""
    w, h = _problem(48, 64, seed=4)
    monkeypatch.setattr(codes, "GPTQ_ROW_BYTES", 16 * 8 * 64)  # two bands of 8 rows a block
    whole = codes.gptq_palette(w, h, 4, (8, 32))
    for first in (0, 16, 32):
        alone = codes.gptq_palette(w[first:first + 16], h, 4, (8, 32))
        assert np.array_equal(whole.indices[first:first + 16], alone.indices)
        assert np.array_equal(whole.lut[first // 8:first // 8 + 2], alone.lut)


def test_a_row_scale_lets_rows_of_different_ranges_share_a_palette():
    """Rows whose ranges differ (a table's tokens, a layer's output channels) share one LUT of
    their values over their max |w| (coremltools' palette with per-channel scale): for 16 bits
    more a row, the output error falls below the unscaled palette's of the same LUTs. Each
    weight decodes to its entry times its row's scale, rounded once to fp16 (numpy's fp16
    product), the scale being the row's max |w| in fp16; and no band errs more than its
    k-means start, weighted by H_jj times its row's scale squared."""
    w, h = _problem(64, 128, seed=5)
    w *= np.geomspace(0.05, 4.0, 64, dtype=np.float32)[np.random.default_rng(5).permutation(64), None]
    damped = h + codes.GPTQ_DAMP * np.mean(np.diag(h)) * np.eye(len(h))
    for group in ((16, 128), (8, 32)):
        plain = codes.gptq_palette(w, h, 4, group)
        scaled = codes.gptq_palette(w, h, 4, group, row_scale=True)
        assert scaled.bits() == plain.bits() + 64 * 16
        assert np.array_equal(scaled.row_scale, np.abs(w).max(axis=1, keepdims=True).astype(np.float16))
        rows, cols = np.arange(64)[:, None] // group[0], np.arange(128)[None, :] // group[1]
        entries = scaled.lut[rows, cols, scaled.indices]
        assert np.array_equal(scaled.decode(), (entries * scaled.row_scale).astype(np.float32))
        errors = {name: _row_errors(p.decode(), w, h)[0].sum() for name, p in (("plain", plain), ("scaled", scaled))}
        assert errors["scaled"] < 0.8 * errors["plain"], errors
        s = scaled.row_scale.astype(np.float64)
        start = codes.kmeans_tiles((w / s).astype(np.float32), 4, group, np.diag(damped)[None, :] * s * s)
        (mine, slack), (theirs, their_slack) = (_row_errors(decoded, w, damped) for decoded in
                                                (scaled.decode(), start.decode() * s))
        band = group[0]
        assert np.all(mine.reshape(-1, band).sum(1) <= theirs.reshape(-1, band).sum(1)
                      + slack.reshape(-1, band).sum(1) + their_slack.reshape(-1, band).sum(1))


@pytest.fixture(scope="module")
def palettes(tmp_path_factory):
    """The test model's fp16 stateless package (the precision the Neural Engine computes in),
    compressed by palette4-gptq-g8-head6."""
    root = tmp_path_factory.mktemp("palette_gptq")
    report = root / "preflight.json"
    report.write_text(json.dumps({"stand_in": "a report the conversion binds, not read"}))
    source = export_coreml(make_bundle(root, seed=1), root / "packages", kinds=("stateless",),
                           conversion=Conversion("fp16", preflight=str(report)))["stateless"]
    ids = np.random.default_rng(8).integers(0, VOCAB, WINDOW * 16).astype(np.int64)
    made = compress_package(source.path, "palette4-gptq-g8-head6", root / "g8-head6", calibration_ids=ids)
    return source, ids, made


def test_the_recipes_are_registered_and_refuse_without_calibration(palettes, tmp_path):
    source, _, _ = palettes
    names = list(RECIPES)
    assert names[-8:] == ["palette4-gptq-gc32", "palette4-gptq-gc32-emb8x32", "palette4-gptq-g8-head6",
                          "palette6-gptq-g16", "mixed-palette", "mixed-palette-6", "palette4-gptq-g32-pcs",
                          "palette6-gptq-g16-pcs"]
    for name in names[-8:]:
        assert RECIPES[name].params_record()["calibration"] is True
    with pytest.raises(RecipePrecondition, match="calibration_ids"):
        compress_package(source.path, "palette4-gptq-gc32", tmp_path / "none")


def test_each_weight_decodes_through_its_lut_op_to_the_numpy_palette_of_its_hessian(palettes):
    """Every compressed constant, decoded by the MIL executor's constexpr ops from the saved
    package, equals `codes.gptq_palette`'s palette of the weight on the recipe's own Hessian
    (gathered again here the way the recipe gathers it), decoded in numpy: 4 bits per 8 rows
    across all columns for the layers, 6 bits per 16 rows for the tied embedding/head; and the
    manifest says so for each."""
    source, ids, made = palettes
    hessians = Calibration.from_package(source.path, verify_package(source.path, hashes=False).data, ids,
                                        HESSIAN_WINDOWS).input_hessians()
    # An fp16 program holds each weight rounded to fp16: that is the value the recipe codes.
    original = {n: w.astype(np.float16).astype(np.float32) for n, w in random_weights(seed=1).items()}
    constants = Executor(load_program(made.path / "model.mlpackage")).constants
    entries = [e for e in made["selection"]["weights"].values() if e["compressed"]]
    assert len(entries) == 5 * LAYERS + 1  # k and v, of WEIGHT_THRESHOLD elements, stay as they are
    for entry in entries:
        name = entry["hf_names"][0]
        nbits, rows = (6, 16) if name == EMBEDDING else (4, 8)
        want = codes.gptq_palette(original[name], hessians[name], nbits, (rows, original[name].shape[1]))
        assert np.array_equal(np.asarray(constants[entry["compressed_as"]], np.float32), want.decode()), name
        assert entry["chain"] == ["constexpr_lut_to_dense"]  # fp16 entries: the program's own dtype
        assert f"nbits={nbits},tile=[{rows}, {original[name].shape[1]}]" in entry["how"] and "gptq=" in entry["how"]
        assert "rounds=2" in entry["how"] and "least squares" in entry["how"]


def test_the_package_stores_the_bits_its_shapes_say_and_the_neural_engine_reads_its_luts(palettes):
    """bits per weight off the package's weight file equal the arithmetic: 4 bits a layer weight
    and a 16-entry fp16 LUT per 8 rows, 6 bits an embedding weight and a 64-entry fp16 LUT per 16
    rows, 16 bits each norm weight and each matrix of at most WEIGHT_THRESHOLD elements (fp16, as
    the program keeps them); and the Neural Engine's static check passes the scalar LUTs."""
    _, _, made = palettes
    layer_bits = sum(r * c * 4 + r // 8 * 16 * 16 if r * c > WEIGHT_THRESHOLD else 16 * r * c for r, c in LAYER_SHAPES)
    embedding_bits = VOCAB * HIDDEN * 6 + VOCAB // 16 * 64 * 16
    norms = (2 * LAYERS + 1) * HIDDEN
    parameters = LAYERS * sum(r * c for r, c in LAYER_SHAPES) + VOCAB * HIDDEN + norms
    counted = bits_per_weight(made.path)
    assert counted["parameters"] == parameters
    assert counted["bits_per_weight"] == (LAYERS * layer_bits + embedding_bits + 16 * norms) / parameters
    report = ane_report(made.path / "model.mlpackage")
    checks = {c["check"]: c for f in report["functions"].values() for c in f["checks"]}
    assert checks["weight_compression"]["verdict"] == "pass", checks["weight_compression"]
    assert "constexpr_lut_to_dense" in checks["weight_compression"]["detail"]
    assert report["compute_units"] == ["cpu", "gpu", "ane"], checks


def test_a_row_scaled_palette_decodes_through_its_lut_and_scale_ops_and_claims_the_neural_engine(palettes, tmp_path):
    """palette4-gptq-g32-pcs on the same fp16 package: each compressed constant is a LUT op then
    a per-channel shift-scale op, and decodes (by the MIL executor, from the saved package) to
    `codes.gptq_palette`'s row-scaled palette of the recipe's Hessian: 4 bits per 32 rows for
    the layers, per 32 x 32 tile for the tied embedding/head. The bits are the arithmetic's (a
    16-entry fp16 LUT per band or tile and an fp16 scale per row), and the Neural Engine's static check
    passes the scale, whose one wide axis is the rows'."""
    source, ids, _ = palettes
    made = compress_package(source.path, "palette4-gptq-g32-pcs", tmp_path / "g32-pcs", calibration_ids=ids)
    hessians = Calibration.from_package(source.path, verify_package(source.path, hashes=False).data, ids,
                                        HESSIAN_WINDOWS).input_hessians()
    original = {n: w.astype(np.float16).astype(np.float32) for n, w in random_weights(seed=1).items()}
    constants = Executor(load_program(made.path / "model.mlpackage")).constants
    entries = [e for e in made["selection"]["weights"].values() if e["compressed"]]
    assert len(entries) == 5 * LAYERS + 1
    for entry in entries:
        name = entry["hf_names"][0]
        group = (32, 32) if name == EMBEDDING else (32, original[name].shape[1])
        want = codes.gptq_palette(original[name], hessians[name], 4, group, row_scale=True)
        assert np.array_equal(np.asarray(constants[entry["compressed_as"]], np.float32), want.decode()), name
        assert entry["chain"] == ["constexpr_lut_to_dense", "constexpr_blockwise_shift_scale"]
        assert "row_scale=max |w| per row" in entry["how"]
    layer_bits = sum(r * c * 4 + r // 32 * 16 * 16 + 16 * r if r * c > WEIGHT_THRESHOLD else 16 * r * c
                     for r, c in LAYER_SHAPES)
    embedding_bits = VOCAB * HIDDEN * 4 + VOCAB // 32 * (HIDDEN // 32) * 16 * 16 + 16 * VOCAB
    norms = (2 * LAYERS + 1) * HIDDEN
    counted = bits_per_weight(made.path)
    assert counted["bits_per_weight"] == (LAYERS * layer_bits + embedding_bits + 16 * norms) / counted["parameters"]
    report = ane_report(made.path / "model.mlpackage")
    checks = {c["check"]: c for f in report["functions"].values() for c in f["checks"]}
    assert checks["weight_compression"]["verdict"] == "pass", checks["weight_compression"]
    assert "constexpr_blockwise_shift_scale" in checks["weight_compression"]["detail"]
    assert report["compute_units"] == ["cpu", "gpu", "ane"], checks
