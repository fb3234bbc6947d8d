"""The one tokenizer wrapper every stage uses: a Hugging Face `tokenizer.json` plus the
CMF `tokenizer_config` block (spec §6.1) that says which ids are BOS, EOS and PAD.

BOS is added only when the caller asks (`add_bos=True`), never by the tokenizer.json's
own post-processor, so no stage depends on how a checkpoint configured it.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HfTokenizer

from pipeline.ground.cmf import open_cmf
from pipeline.ground.errors import CmfdeployError


class TokenizerError(CmfdeployError):
    """A tokenizer.json or tokenizer_config block that cannot be used."""


@dataclass(frozen=True)
class Tokenizer:
    hf: HfTokenizer
    bos_id: int | None
    eos_ids: tuple[int, ...]
    pad_id: int | None
    chat_template: str | None
    source: str

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> np.ndarray:
        """Token ids (int64) of `text`, with BOS first when `add_bos`."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError(f"{self.source}: tokenizer_config.bos_token_id is null, cannot add BOS")
            ids = [self.bos_id, *ids]
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)


def load_tokenizer(tokenizer_json_bytes: bytes, tokenizer_config: dict | None, source: str = "tokenizer.json") -> Tokenizer:
    """`source` names the file the bytes came from, for error messages.

    A missing `tokenizer_config` (allowed by the spec) means no BOS, no PAD and no EOS ids.
    """
    try:
        hf = HfTokenizer.from_str(tokenizer_json_bytes.decode("utf-8"))
    except Exception as error:  # tokenizers raises a bare Exception; bad UTF-8 a UnicodeDecodeError
        raise TokenizerError(f"{source}: vocab section is not a valid tokenizer.json ({error})") from error
    config = tokenizer_config or {}
    vocab_size = hf.get_vocab_size(with_added_tokens=True)

    def token_id(field: str, value) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
            raise TokenizerError(
                f"{source}: tokenizer_config.{field} = {value!r} is not a token id below vocab size {vocab_size}"
            )
        return value

    eos = config.get("eos_token_ids", [])
    if not isinstance(eos, list):
        raise TokenizerError(f"{source}: tokenizer_config.eos_token_ids = {eos!r} is not a list")
    template = config.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{source}: tokenizer_config.chat_template = {template!r} is not a string")
    return Tokenizer(
        hf=hf,
        bos_id=token_id("bos_token_id", config.get("bos_token_id")),
        eos_ids=tuple(token_id("eos_token_ids", e) for e in eos),
        pad_id=token_id("pad_token_id", config.get("pad_token_id")),
        chat_template=template,
        source=source,
    )


# Where an artifact folder keeps its tokenizer: beside its manifest (bundles, packages) or in a
# `tokenizer/` folder beside the packages (releases, as Apple's Core AI export bundles do).
TOKENIZER_FOLDERS = (".", "tokenizer")


def tokenizer_from_artifact(path: str | Path) -> Tokenizer:
    """The tokenizer of a CMF file (vocab section + header block) or of an artifact folder
    holding `tokenizer.json` and optionally `tokenizer_config.json` (a bundle or a package),
    or holding them in `tokenizer/` (a release)."""
    path = Path(path)
    if path.is_dir():
        folder = next((path / f for f in TOKENIZER_FOLDERS if (path / f / "tokenizer.json").is_file()), None)
        if folder is None:
            raise TokenizerError(f"{path}: no tokenizer.json in this folder or in its tokenizer/ folder")
        vocab_path = folder / "tokenizer.json"
        config_path = folder / "tokenizer_config.json"
        config = None
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_bytes())
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise TokenizerError(f"{config_path}: not valid JSON ({error})") from None
        return load_tokenizer(vocab_path.read_bytes(), config, source=str(vocab_path))
    cmf = open_cmf(path)
    if cmf.vocab is None:
        raise TokenizerError(f"{path}: the CMF has no vocab section (tokenizer.json)")
    return load_tokenizer(cmf.vocab, cmf.tokenizer_config, source=str(path))
