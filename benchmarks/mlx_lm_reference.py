"""mlx-lm's own quantization of a bundle's weights, for benchmarks that put it beside ours.

    runner = MlxLm(bundle, work_dir)              # a transformers-format folder, written once
    logits = runner.logits(window, bits=4)        # mlx-lm q4 g64; bits=None: mlx-lm unquantized

The folder is written offline from the bundle (its safetensors under HF names, a
transformers config.json rebuilt from the CMF arch); mlx-lm loads it with its own model
file (`mlx_lm.utils.load_model`) and quantizes it with its own `quantize_model` at its
default group of 64, after casting the matrices to the dtype `mlx_lm.convert` would
(`--mlx-dtype`, bfloat16 by default: Gemma 3 and SmolLM2 ship in bf16), so its scales and
biases are what a converted model stores. Everything is then computed in float32 (mlx on
x86 runs float32; the codes are unchanged, bf16 scales widen exactly).
"""

import json
import shutil
from pathlib import Path

import numpy as np

GROUP = 64  # mlx-lm's default group size for affine quantization


def hf_config(arch: dict, special: dict) -> dict:
    """A transformers config.json for `arch` (llama and gemma3, the families benchmarked)."""
    common = {
        "hidden_size": arch["hidden_size"], "intermediate_size": arch["intermediate_size"],
        "num_hidden_layers": arch["num_layers"], "num_attention_heads": arch["num_attention_heads"],
        "num_key_value_heads": arch["num_kv_heads"], "head_dim": arch["head_dim"], "vocab_size": arch["vocab_size"],
        "rms_norm_eps": arch["rms_norm_eps"], "rope_theta": arch["rope_theta"],
        "max_position_embeddings": arch["max_position_embeddings"],
        "tie_word_embeddings": arch["tie_word_embeddings"], "bos_token_id": special.get("bos_token_id"),
        "rope_scaling": arch.get("rope_scaling"),
    }
    if arch["arch_name"] == "gemma3":
        full = [i for i, t in enumerate(arch["layer_types"]) if t == "FullAttention"]
        return {**common, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
                "hidden_activation": arch["hidden_act"], "sliding_window": arch["sliding_window"],
                "sliding_window_pattern": full[0] + 1, "rope_local_base_freq": arch["rope_local_base_freq"],
                "query_pre_attn_scalar": arch["query_pre_attn_scalar"],
                "final_logit_softcapping": arch["final_logit_softcapping"],
                "attn_logit_softcapping": arch["attn_logit_softcapping"]}
    if arch["arch_name"] == "llama":
        return {**common, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": arch["hidden_act"]}
    raise ValueError(f"mlx-lm benchmark: arch {arch['arch_name']!r} has no config mapping here")


class MlxLm:
    """mlx-lm's model of a bundle, unquantized or quantized by mlx-lm itself."""

    def __init__(self, bundle: Path, work: Path, dtype: str = "bfloat16"):
        bundle_config = json.loads((bundle / "config.json").read_text())
        self.folder = work / "mlx-lm-hf"
        self.folder.mkdir(parents=True, exist_ok=True)
        config = hf_config(bundle_config["arch"], bundle_config.get("tokenizer_config") or {})
        (self.folder / "config.json").write_text(json.dumps(config, indent=1))
        target = self.folder / "model.safetensors"
        if not target.exists():
            shutil.copyfile(bundle / "weights.safetensors", target)
        self.dtype = dtype
        self.model = self.bits = None

    def load(self, bits: int | None) -> dict:
        """Load the folder with mlx-lm and quantize it to `bits` (None: leave it float32);
        returns mlx-lm's size figures (bits per weight as stored)."""
        import mlx.core as mx
        from mlx.utils import tree_flatten, tree_map
        from mlx_lm.utils import load_model, quantize_model

        self.model = None
        model, config = load_model(self.folder)
        if bits is not None:
            stored = getattr(mx, self.dtype)
            model.update(tree_map(lambda v: v.astype(stored) if mx.issubdtype(v.dtype, mx.floating) else v,
                                  model.parameters()))
            model, config = quantize_model(model, config, GROUP, bits)
        params = tree_flatten(model.parameters())
        stored_bytes = sum(v.nbytes for _, v in params)
        count = sum(v.size for k, v in params if not k.endswith((".scales", ".biases")))
        if bits is not None:  # packed uint32 words hold 32 / bits codes each
            count += sum(v.size * (32 // bits - 1) for k, v in params if k.endswith(".weight") and v.dtype == mx.uint32)
        model.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v,
                              model.parameters()))
        mx.eval(model.parameters())
        self.model, self.bits = model, bits
        return {"bpw": 8 * stored_bytes / count, "parameters": count, "stored_bytes": stored_bytes}

    def logits(self, window: np.ndarray) -> np.ndarray:
        import mlx.core as mx

        out = self.model(mx.array(np.asarray(window, np.int32))[None])
        return np.array(out[0].astype(mx.float32))
