"""`import-hf`: a Hugging Face checkpoint folder to CMF v2.

Reads config.json (through `arch_from_hf_config`, which knows both places transformers
puts rope_theta and both Llama-3 rope_scaling forms), the safetensors weights (one file or a
sharded `model.safetensors.index.json`), tokenizer.json and the chat bundle: the chat
template (chat_template.jinja, chat_template.json or tokenizer_config.json) and the eos/bos/pad ids
(generation_config.json, config.json, and tokenizer_config.json's token strings resolved
through tokenizer.json). Tensor names are kept 1:1. Pickled checkpoints are refused.
"""

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from manifests.identity import read_json, sha256_file
from pipeline.ground.errors import UnsupportedModel
from pipeline.stages.importers.common import write_import
from pipeline.stages.importers.quant_policy import QuantPolicy
from pipeline.ground.models.hf_config import arch_from_hf_config

INDEX_NAME = "model.safetensors.index.json"
SOURCE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# Buffers some checkpoints carry that are derived from the config, never weights.
DERIVED_SUFFIXES = (".rotary_emb.inv_freq",)


def import_hf(folder: str | os.PathLike, out: str | os.PathLike, *, policy: QuantPolicy = QuantPolicy(),
              force: bool = False) -> list[Path]:
    folder = Path(folder)
    config_path = folder / "config.json"
    config = read_json(config_path)
    arch, moe = arch_from_hf_config(config, source=str(config_path))
    files = _weight_files(folder)
    tensors, dropped = {}, []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.endswith(DERIVED_SUFFIXES):
                    dropped.append(name)
                    continue
                if name in tensors:
                    raise UnsupportedModel(f"{folder}: tensor '{name}' is in more than one weights file")
                piece = f.get_slice(name)
                dtype = piece.get_dtype()
                if dtype not in SOURCE_DTYPES:
                    raise UnsupportedModel(f"{file}: tensor '{name}' has dtype {dtype}; readable: {sorted(SOURCE_DTYPES)}")
                tensors[name] = (tuple(piece.get_shape()), _loader(file, name))

    tokenizer_json = (folder / "tokenizer.json").read_bytes() if (folder / "tokenizer.json").exists() else None
    provenance = {
        "importer": "cmfdeploy import-hf",
        "source": folder.name,
        "config_sha256": hashlib.sha256(config_path.read_bytes()).hexdigest(),
        "weights_sha256": {file.name: sha256_file(file) for file in files},
        "tokenizer_sha256": None if tokenizer_json is None else hashlib.sha256(tokenizer_json).hexdigest(),
        "dropped_buffers": dropped,
    }
    return write_import(
        out, source=str(folder), arch=arch, moe=moe, tensors=tensors, policy=policy,
        tokenizer_json=tokenizer_json, tokenizer_config=chat_bundle(folder, config, tokenizer_json),
        provenance=provenance, force=force,
    )  # fmt: skip


def _loader(file: Path, name: str):
    def load() -> np.ndarray:
        # Opened per tensor so only one tensor is ever materialised; safetensors maps the file.
        with safe_open(file, framework="pt") as f:
            return f.get_tensor(name).to(torch.float32).numpy()

    return load


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UnsupportedModel(f"{index}: field 'weight_map' is missing or empty")
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        return files
    if files:
        raise UnsupportedModel(f"{folder}: {len(files)} safetensors files but no {INDEX_NAME} to say which to read")
    pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" ({', '.join(pickled)} are pickles, which are never loaded)" if pickled else ""
    raise UnsupportedModel(f"{folder}: no safetensors weights{hint}")


def chat_bundle(folder: Path, config: dict, tokenizer_json: bytes | None) -> dict | None:
    """The CMF `tokenizer_config` (spec §6.1), or None when the folder describes no chat."""
    tok_config_path = folder / "tokenizer_config.json"
    tok_config = read_json(tok_config_path) if tok_config_path.exists() else {}
    generation_path = folder / "generation_config.json"
    generation = read_json(generation_path) if generation_path.exists() else {}

    # Where transformers has kept the template over the years, newest first.
    template = None
    if (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text()
    elif (folder / "chat_template.json").exists():
        template = read_json(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = tok_config.get("chat_template")
    if isinstance(template, list):  # the named-templates form: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)

    vocab = None if tokenizer_json is None else Tokenizer.from_str(tokenizer_json.decode("utf-8"))

    def token_id(field: str) -> int | None:
        token = tok_config.get(field)
        if isinstance(token, dict):  # a serialised AddedToken
            token = token.get("content")
        if token is None or vocab is None:
            return None
        found = vocab.token_to_id(token)
        if found is None:
            raise UnsupportedModel(f"{tok_config_path}: field {field} is {token!r}, which tokenizer.json does not have")
        return found

    eos: list[int] = []
    for value in (token_id("eos_token"), generation.get("eos_token_id"), config.get("eos_token_id")):
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in eos:
                eos.append(int(token))
    bos = token_id("bos_token")
    bos = bos if bos is not None else config.get("bos_token_id")
    pad = token_id("pad_token")
    pad = pad if pad is not None else config.get("pad_token_id")
    if template is None and not eos:
        return None
    return {"chat_template": template, "eos_token_ids": eos, "bos_token_id": bos, "pad_token_id": pad}
