"""transformers reading a GGUF file, the independent peer every real-model import and runtime
test compares with, and the held-out text they are compared on."""

from pathlib import Path

from conftest import ROOT
from pipeline.ground.text_roles import held_out

BOTCHAN = ROOT / "fixtures" / "botchan.txt"


def held_out_text() -> str:
    """Botchan's held-out lines (`text_roles.held_out`): no calibration reads them."""
    return "\n".join(held_out(BOTCHAN.read_text(encoding="utf-8").splitlines()))


def transformers_model(folder: Path, name: str):
    """transformers' own model read from the GGUF `folder/name` (its dequantizing loader), in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                local_files_only=True).eval()


def transformers_tokenizer(folder: Path, name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
