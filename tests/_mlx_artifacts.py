"""SmolLM2 artifacts shared by the MLX runtime's real-model tests and its benchmark,
each built once into a temporary sibling and renamed into place."""

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def cached_build(path: Path, build: Callable[[Path], object]) -> Path:
    """`path`, built by `build(tmp)` into a temporary sibling and renamed into place once."""
    if not path.exists():
        tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.unlink(missing_ok=True)
        build(tmp)
        os.replace(tmp, path)
    return path


def save_transformers_fp32(gguf: Path, out: Path) -> None:
    """The GGUF as transformers dequantizes it, saved as a plain FP32 checkpoint folder
    (transformers refuses save_pretrained on a GGUF-loaded model, so config and weights are
    written here). Its dequantizing loader takes minutes, the saved folder seconds."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    del model.config.quantization_config
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    # A tied head shares the embedding's storage: store the embedding, as HF checkpoints do.
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
