"""The fixture's tokenizer.json encodes exactly like the SentencePiece model it was converted from,
and pipeline.ground.tokenizer wraps it with the ids the CMF tokenizer_config names."""

import numpy as np
import pytest
import sentencepiece as spm

from fixtures.corpus import corpus_lines
from fixtures.make_tokenizer import TOKENIZER_JSON, TOKENIZER_MODEL
from fixtures.train_fixture import TOKENIZER_CONFIG
from pipeline.ground.errors import CmfdeployError
from pipeline.ground.tokenizer import TokenizerError, load_tokenizer

EDGE_CASES = [
    "", " ", "  ", "  leading and   inner  and trailing  ", "\ttab\tseparated", "a\nb\n", "\r\n",
    "12345 67.89", "héllo wörld", "日本語のテキスト", "emoji 🙂🚀 mixed", "\u00a0non-breaking\u2009spaces",
    "ALL CAPS SHOUTING!!!", "Botchan's \"Red Shirt\" -- the teacher, eh?", "x" * 300, "\x00\x01 controls",
    "▁already▁escaped", "<unk-looking text <pad",
]


@pytest.fixture(scope="module")
def sp():
    return spm.SentencePieceProcessor(model_file=str(TOKENIZER_MODEL))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TOKENIZER_JSON.read_bytes(), TOKENIZER_CONFIG, source=str(TOKENIZER_JSON))


def test_identical_to_sentencepiece_on_every_line_of_botchan(sp, tok):
    lines = corpus_lines()
    ours = [tok.encode(line).tolist() for line in lines]
    theirs = sp.encode(lines)
    mismatched = [line for line, a, b in zip(lines, ours, theirs) if a != b]
    assert not mismatched, mismatched[:5]
    assert sum(map(len, theirs)) > 80_000  # the whole book, not an empty corpus


@pytest.mark.parametrize("text", EDGE_CASES)
def test_identical_to_sentencepiece_on_edge_cases(sp, tok, text):
    ids = tok.encode(text)
    assert ids.tolist() == sp.encode(text)
    assert tok.decode(ids) == sp.decode(sp.encode(text))


def test_whole_text_as_one_string(sp, tok):
    text = "\n".join(corpus_lines()[:400])
    assert tok.encode(text).tolist() == sp.encode(text)


def test_special_ids_match_the_sentencepiece_model(sp, tok):
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (sp.bos_id(), (sp.eos_id(),), sp.pad_id())
    assert sp.id_to_piece([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "<pad>"]
    assert tok.vocab_size == sp.get_piece_size() == 1024


def test_control_tokens_written_in_text_are_parsed_as_specials(tok):
    # The one intended difference from SentencePiece (which spells them out): chat templates
    # render "<s>" as text and must get the BOS id back, as Hugging Face tokenizers do.
    assert tok.encode("<s>").tolist() == [tok.bos_id]
    assert tok.encode("</s>").tolist() == list(tok.eos_ids)


def test_add_bos_and_decode_round_trip(tok):
    ids = tok.encode("I was a mischievous boy.", add_bos=True)
    assert ids.dtype == np.int64 and ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
    assert tok.decode(ids) == "I was a mischievous boy."
    assert tok.decode(ids, skip_special=False).startswith("<s>")


def test_unseen_characters_fall_back_to_bytes(sp, tok):
    ids = tok.encode("ðŸ™‚ Ω")
    assert sp.unk_id() not in ids.tolist()
    assert tok.decode(ids) == "ðŸ™‚ Ω"


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"bos_token_id": 5000}, "bos_token_id = 5000"),
        ({"pad_token_id": -1}, "pad_token_id = -1"),
        ({"eos_token_ids": [2, "x"]}, "eos_token_ids = 'x'"),
        ({"eos_token_ids": 2}, "eos_token_ids = 2"),
        ({"bos_token_id": True}, "bos_token_id = True"),
    ],
)
def test_bad_tokenizer_config_is_a_typed_error_naming_field_and_value(config, field):
    with pytest.raises(TokenizerError, match=field) as info:
        load_tokenizer(TOKENIZER_JSON.read_bytes(), config, source="model.cmf")
    assert isinstance(info.value, CmfdeployError) and "model.cmf" in str(info.value)


@pytest.mark.parametrize("blob", [b"not json", b"\xff\xfe", b"{}"])
def test_bad_tokenizer_json_is_a_typed_error(blob):
    with pytest.raises(TokenizerError, match="model.cmf"):
        load_tokenizer(blob, TOKENIZER_CONFIG, source="model.cmf")


def test_add_bos_without_bos_id_is_a_typed_error():
    tok = load_tokenizer(TOKENIZER_JSON.read_bytes(), None, source="model.cmf")
    assert tok.encode("hi").size > 0
    with pytest.raises(TokenizerError, match="bos_token_id"):
        tok.encode("hi", add_bos=True)
