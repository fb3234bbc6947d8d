"""SmolLM2-135M-Instruct (conftest's session-cached f32 import) converted to a Core ML
package at the gates' context, run through the MIL executor against the torch reference.

Only the stateless kind is converted here: it is the cheapest (one trace, one conversion)
and exercises every weight and op of the decoder. The chunk-KV and stateful kinds of the
same model are converted, timed and measured in benchmarks/coreml_bench.py.
"""

import os

import numpy as np
import pytest
import torch

from coreml.convert import export_coreml
from coreml.package import open_package
from pipeline.stages.bundle import export_bundle
from pipeline.ground.models.numerics import model_logits_bound
from pipeline.ground.reference import load_reference
from pipeline.ground.tokenizer import tokenizer_from_artifact

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")
BOTCHAN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "botchan.txt")
CONTEXT = 128
EXCERPT_TOKENS = 64


@pytest.fixture(scope="module")
def converted(smollm2_cmf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-coreml")
    export_bundle(smollm2_cmf, out / "bundle")
    manifests = export_coreml(out / "bundle", out / "coreml", kinds=("stateless",), context=CONTEXT)
    return out / "coreml" / "stateless", manifests["stateless"]


def test_stateless_package_matches_reference_on_botchan(converted, smollm2_cmf):
    package_dir, manifest = converted
    text = open(BOTCHAN, encoding="utf-8").read()[:2000]
    ids = np.asarray(tokenizer_from_artifact(smollm2_cmf).encode(text)[:EXCERPT_TOKENS], dtype=np.int32)
    assert len(ids) == EXCERPT_TOKENS

    model, args, _ = load_reference(smollm2_cmf)  # the CMF itself, not the bundle converted from it
    with torch.no_grad():
        expected = model(torch.from_numpy(ids).long()).numpy()
    package = open_package(package_dir, backend="executor")
    got = package.predict({"input_ids": ids[None]})["logits"]

    assert got.shape == (1, EXCERPT_TOKENS, args.vocab_size)
    delta = float(np.abs(got[0] - expected).max())
    print(f"SmolLM2 stateless package (executor) vs torch reference, {EXCERPT_TOKENS} tokens: max |Δ| {delta:.3g}")
    # float32 package vs float32 reference: only summation order differs; the probable form of
    # the derived bound (the worst case is as wide as the logits' spread; pipeline/ground/models/numerics.py).
    assert delta <= model_logits_bound(model, EXCERPT_TOKENS, probable=True)
    assert np.array_equal(got[0].argmax(-1), expected.argmax(-1))


def test_manifest_records_the_context_and_every_weight(converted, smollm2_cmf):
    _, manifest = converted
    block = manifest["package"]
    assert block["context"] == CONTEXT and block["dims"] == {"T": [1, CONTEXT]}
    model, _, _ = load_reference(smollm2_cmf)
    # Every reference tensor is one package constant, bit for bit (the tied head once).
    named = {name for names in block["weights"].values() for name in names}
    assert named == set(model.state_dict())
