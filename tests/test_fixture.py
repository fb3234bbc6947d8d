"""The committed fixture: a valid CMF that transformers' Llama agrees with, far better than a
unigram model on held-out text, frozen reference logits that still reproduce, and build
scripts that reproduce the committed tokenizer and scoring set byte for byte."""

import json
import math

import numpy as np
import pytest
import torch
from pipeline.ground.models.numerics import gamma, model_logits_bound
from _one_thread import one_thread  # noqa: F401 (autouse fixture)

from fixtures.corpus import BOTCHAN, corpus_lines, split_lines
from fixtures.make_reference import OUT as REFERENCE
from fixtures.make_scoring_set import OUT as CLOZE
from fixtures.make_scoring_set import build_items
from fixtures.make_tokenizer import TOKENIZER_JSON, TOKENIZER_MODEL, convert_to_tokenizer_json, train_sentencepiece
from fixtures.train_fixture import (
    CMF_PATH,
    SEED,
    TOKENIZER_CONFIG,
    fixture_tokenizer,
    heldout_windows,
    token_stream,
    transformers_model,
)
from manifests.identity import sha256_file
from pipeline.ground.cmf import open_cmf, verify_cmf
from pipeline.ground.models import KVCache
from pipeline.ground.reference import load_reference


@pytest.fixture(scope="module")
def frozen():
    with np.load(REFERENCE / "logits.npz", allow_pickle=False) as data:
        return dict(data)


@pytest.fixture(scope="module")
def hf_model():
    return transformers_model(CMF_PATH)


@pytest.fixture(scope="module")
def bound():
    """Max |Δ logit| of two float32 evaluations of the fixture over its 128-token context (any
    kernels, any CPU: pipeline/ground/models/numerics.py). The frozen logits came from another machine."""
    return model_logits_bound(load_reference(CMF_PATH)[0], 128)


def test_cmf_is_valid_small_f32_llama_with_its_tokenizer():
    assert CMF_PATH.stat().st_size < 5 * 2**20
    assert verify_cmf(CMF_PATH).ok
    with open_cmf(CMF_PATH) as cmf:
        arch = cmf.arch
        assert (arch["arch_name"], arch["norm_style"], arch["num_layers"]) == ("llama", "qwen", 4)
        assert (arch["num_attention_heads"], arch["num_kv_heads"], arch["head_dim"]) == (4, 2, 32)
        assert (arch["max_position_embeddings"], arch["rope_theta"], arch["tie_word_embeddings"]) == (128, 1e4, True)
        assert {t.dtype.name for t in cmf.tensors.values()} == {"f32"}
        assert "lm_head.weight" not in cmf.tensors
        parameters = sum(math.prod(t.shape) for t in cmf.tensors.values())
        provenance = cmf.header["provenance"]
        assert parameters == provenance["parameters"] and 0.8e6 < parameters < 1.2e6
        assert provenance["data_sha256"] == sha256_file(BOTCHAN) and provenance["seed"] == SEED
        assert cmf.vocab == TOKENIZER_JSON.read_bytes()
        assert cmf.tokenizer_config == TOKENIZER_CONFIG


def test_held_out_perplexity_far_below_unigram(hf_model, bound):
    tokenizer = fixture_tokenizer()
    train, held = split_lines(corpus_lines())
    windows = heldout_windows(token_stream(tokenizer, held), tokenizer.bos_id)
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(input_ids=windows).logits[:, :-1].double(), dim=-1)
    targets = windows[:, 1:]
    model_ppl = math.exp(-logp.gather(-1, targets[..., None]).mean().item())
    counts = np.bincount(token_stream(tokenizer, train), minlength=tokenizer.vocab_size) + 1.0
    unigram_ppl = math.exp(-np.log(counts[targets.numpy()] / counts.sum()).mean())
    with open_cmf(CMF_PATH) as cmf:
        recorded = cmf.header["provenance"]
    # The recorded figure came from another CPU's float32 logits: log_softmax moves by at most
    # 2 max|Δ logit|, so log(ppl) by at most 2 * bound, plus the recording's float32 mean of
    # N positive NLLs (gamma_N relative).
    slack = 2 * bound + gamma(targets.numel()) * math.log(model_ppl)
    assert abs(math.log(model_ppl / recorded["heldout_ppl"])) <= slack
    # The same float64 formula on integer counts: N * 2^-53 relative at most, far under 1e-6.
    assert unigram_ppl == pytest.approx(recorded["unigram_ppl"], rel=1e-6)
    assert model_ppl < unigram_ppl / 3
    print(f"held-out ppl {model_ppl:.2f}, unigram ppl {unigram_ppl:.2f}")


def test_index_names_this_checkpoint_and_tokenizer():
    index = json.loads((REFERENCE / "index.json").read_text())
    assert index["checkpoint"] == {"file": CMF_PATH.name, "sha256": sha256_file(CMF_PATH), "format": "cmf",
                                   "version": 2}
    assert index["tokenizer"]["sha256"] == sha256_file(TOKENIZER_JSON)
    assert {k: v["tokens"] for k, v in index["cases"].items()} == {
        "short": 16, "long": 128, "right_pad": 32, "changed_future": 32}


def test_frozen_logits_agree_with_transformers(frozen, hf_model, bound):
    with torch.no_grad():
        for case in ("short", "long", "changed_future"):
            ids = torch.as_tensor(frozen[f"{case}.input_ids"])[None]
            expected = hf_model(input_ids=ids).logits[0].numpy()
            np.testing.assert_allclose(frozen[f"{case}.logits"], expected, rtol=0, atol=bound, err_msg=case)


def test_frozen_logits_reproduce_with_the_reference_model(frozen, bound):
    model, args, _ = load_reference(CMF_PATH)
    with torch.no_grad():
        for case in ("short", "long", "right_pad", "changed_future"):
            logits = model(torch.as_tensor(frozen[f"{case}.input_ids"])).numpy()
            np.testing.assert_allclose(logits, frozen[f"{case}.logits"], rtol=0, atol=bound, err_msg=case)
        cache = KVCache.empty(args, 128)
        ids = torch.as_tensor(frozen["long.input_ids"])
        stepped = torch.cat([model.forward_cached(ids[i : i + 1], cache) for i in range(len(ids))]).numpy()
    np.testing.assert_allclose(stepped, frozen["long_kv_step_logits"], rtol=0, atol=bound)


def test_frozen_cases_are_causally_consistent(frozen, bound):
    # Rows of one position computed at different lengths (other shapes, other kernel blocking)
    # by whatever CPU froze them: two float32 evaluations apart.
    short = frozen["short.logits"]
    pad = frozen["right_pad.input_ids"]
    assert int(frozen["right_pad.valid_prefix"]) == 16 and (pad[16:] == TOKENIZER_CONFIG["pad_token_id"]).all()
    np.testing.assert_array_equal(frozen["changed_future.input_ids"][:16], frozen["short.input_ids"])
    assert not np.array_equal(frozen["changed_future.input_ids"][16:], pad[16:])
    for case in ("right_pad", "changed_future"):
        np.testing.assert_allclose(frozen[f"{case}.logits"][:16], short, rtol=0, atol=bound, err_msg=case)
    np.testing.assert_allclose(frozen["long_kv_step_logits"], frozen["long.logits"], rtol=0, atol=bound)


def test_tokenizer_rebuilds_byte_for_byte():
    model = train_sentencepiece(split_lines(corpus_lines())[0])
    assert model == TOKENIZER_MODEL.read_bytes()
    assert convert_to_tokenizer_json(model) + "\n" == TOKENIZER_JSON.read_text(encoding="utf-8")


def test_scoring_set_rebuilds_byte_for_byte_from_held_out_text_only():
    train, held = split_lines(corpus_lines())
    words = " ".join(held).split()
    items = build_items(words, fixture_tokenizer(), np.random.default_rng(SEED))
    assert "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items) == CLOZE.read_text(encoding="utf-8")
    held_text, train_text = " ".join(held), " ".join(train)
    for item in items:
        passage = item["context"] + item["candidates"][item["gold"]]
        assert passage in held_text and passage not in train_text, item["id"]
