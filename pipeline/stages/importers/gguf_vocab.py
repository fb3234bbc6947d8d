"""A GGUF file's vocabulary rebuilt as a Hugging Face tokenizer.json, and its CMF `tokenizer_config`.

Two kinds:
  - `gpt2`, byte-level BPE: the file's merges, llama.cpp's pre-tokenizer split for its
    `tokenizer.ggml.pre` (the GPT-2 split, that split after isolating digits, or a whole
    regex of its own such as qwen2's), its control tokens as special tokens and its
    user-defined ones as added tokens;
  - `llama` (SentencePiece), for gemma3: the tokenizer transformers' GGUF loader builds, so
    that both encode alike. That is transformers' GemmaTokenizer (BPE with byte fallback,
    spaces as "▁"), whose merges the file does not list: they are cut from the vocabulary,
    best first in the order the tokens appear in the file (Gemma's scores do not follow its
    merge order). Tokens of two or more spaces are stored as real spaces, renamed to "▁"s.
Any other kind, pre-tokenizer or tokenizer key this module does not map is refused by name.
"""

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from pipeline.ground.errors import UnsupportedModel
from pipeline.stages.importers.gguf_fields import GgufFields

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) for the `tokenizer.ggml.pre` values
# handled here: every one ends in the GPT-2 split, which ByteLevel(use_regex=True) applies;
# some isolate each numeric character first.
_GPT2_PRE = ("gpt2", "mpt", "olmo", "jais")
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
# Pre-tokenizers whose whole split is a regex other than GPT-2's: the regex isolates each piece,
# then ByteLevel(use_regex=False) only maps bytes, as in the model's own tokenizer.json and as
# transformers' GGUF loader builds it. qwen2 (LLAMA_VOCAB_PRE_TYPE_QWEN2 in llama-vocab.cpp, and
# Qwen2Tokenizer's PRETOKENIZE_REGEX): GPT-2's split with case-insensitive contractions, a
# letter run taking one leading non-letter/non-digit (not a newline), and single digits.
_REGEX_PRE = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+",
}
_KNOWN_PRE = _GPT2_PRE + _DIGIT_SPLIT_PRE + tuple(_REGEX_PRE)
_CONTROL, _USER_DEFINED = 3, 4
# The keys a gemma3 SentencePiece vocabulary may carry. Others (merges, a precompiled charsmap)
# would change how it tokenizes, so they are refused rather than ignored.
_SENTENCEPIECE_KEYS = {f"tokenizer.ggml.{key}" for key in (
    "model", "pre", "tokens", "scores", "token_type", "bos_token_id", "eos_token_id", "unknown_token_id",
    "padding_token_id", "eot_token_id", "add_bos_token", "add_eos_token", "add_sep_token", "add_space_prefix")
} | {"tokenizer.chat_template"}  # fmt: skip


def gguf_vocab(fields: GgufFields, architecture: str, path: Path) -> tuple[bytes, dict]:
    """(tokenizer.json bytes, CMF tokenizer_config) rebuilt from the GGUF vocabulary."""
    kind = fields.get("tokenizer.ggml.model")
    if architecture == "gemma3":
        if kind != "llama":
            raise UnsupportedModel(f"{path}: tokenizer.ggml.model is {kind!r}; a gemma3 vocabulary is rebuilt "
                                   f"from 'llama' (SentencePiece) only")
        tokenizer = _gemma_sentencepiece(fields, path)
    else:
        if kind != "gpt2":
            raise UnsupportedModel(f"{path}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) is rebuilt")
        tokenizer = _byte_level_bpe(fields, path)
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise UnsupportedModel(f"{path}: rebuilt vocabulary has {tokenizer.get_vocab_size()} tokens, the file {len(tokens)}")

    eos = [fields.get("tokenizer.ggml.eos_token_id")]
    eot = fields.optional("tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos:
        eos.append(eot)
    config = {
        "chat_template": fields.optional("tokenizer.chat_template"),
        "eos_token_ids": eos,
        "bos_token_id": fields.optional("tokenizer.ggml.bos_token_id"),
        "pad_token_id": fields.optional("tokenizer.ggml.padding_token_id"),
    }
    return tokenizer.to_str().encode("utf-8"), config


def _byte_level_bpe(fields: GgufFields, path: Path) -> Tokenizer:
    pre = fields.get("tokenizer.ggml.pre")
    if pre not in _KNOWN_PRE:
        raise UnsupportedModel(f"{path}: tokenizer.ggml.pre is {pre!r}; known: {sorted(_KNOWN_PRE)}")
    tokens = fields.get("tokenizer.ggml.tokens")
    types = fields.get("tokenizer.ggml.token_type")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    outside = next((t for t, kind in zip(tokens, types) if kind != _CONTROL and not set(t) <= alphabet), None)
    if outside is not None:
        raise UnsupportedModel(f"{path}: token {outside!r} is not spelled in the byte-level alphabet")

    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, dropout=None,
                                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))  # fmt: skip
    if pre in _REGEX_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
            if pre in _DIGIT_SPLIT_PRE else byte_level
        )  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    _add_marked_tokens(tokenizer, tokens, types)
    return tokenizer


def _gemma_sentencepiece(fields: GgufFields, path: Path) -> Tokenizer:
    unknown = sorted(key for key in fields.keys() if key.startswith("tokenizer.") and key not in _SENTENCEPIECE_KEYS)
    if unknown:
        raise UnsupportedModel(f"{path}: tokenizer key {unknown[0]!r} is not one a gemma3 vocabulary is rebuilt from")
    # transformers' GemmaTokenizer splits no words and adds neither a prefix space nor EOS; a
    # file asking for them tokenizes differently in llama.cpp, so neither reference would hold.
    for key, wanted in (("tokenizer.ggml.pre", "default"), ("tokenizer.ggml.add_space_prefix", False),
                        ("tokenizer.ggml.add_eos_token", False)):
        if fields.optional(key, wanted) != wanted:
            raise UnsupportedModel(f"{path}: {key} is {fields.optional(key)!r}; a gemma3 vocabulary needs {wanted!r}")
    stored = fields.get("tokenizer.ggml.tokens")
    tokens = [("\u2581" * len(t) if " " in t and not t.strip() else t) for t in stored]
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    if tokens[unk] != "<unk>":
        raise UnsupportedModel(f"{path}: tokenizer.ggml.unknown_token_id {unk} is {tokens[unk]!r}, not '<unk>'")
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges_in_file_order(tokens, vocab), dropout=None,
                                     unk_token="<unk>", fuse_unk=True, byte_fallback=True))  # fmt: skip
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_marked_tokens(tokenizer, stored, fields.get("tokenizer.ggml.token_type"), vocab)
    return tokenizer


def _merges_in_file_order(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ordered as transformers' `generate_merges` ranks
    them: by the merged token's place in the file, then the longer left part first."""
    return [(token[:cut], token[cut:]) for token in tokens for cut in range(len(token) - 1, 0, -1)
            if token[:cut] in vocab and token[cut:] in vocab]


def _add_marked_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int], vocab: dict | None = None) -> None:
    """Control tokens as special tokens and user-defined ones as plain added tokens, so both
    stay whole in any text (llama.cpp matches them before tokenizing). `vocab`, when given,
    leaves out the user-defined tokens it does not spell (Gemma's runs of spaces, renamed)."""
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
                          if kind == _USER_DEFINED and (vocab is None or t in vocab)])
