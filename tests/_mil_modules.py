"""Tiny Llama-like torch modules and their Core ML conversions, shared by the MIL executor tests.

The modules exercise what a real decoder conversion emits (embedding gather, explicit RMSNorm,
RoPE, GQA repeat, causal mask, softmax attention, SwiGLU, tied head) in three cache flavours:
none, cache tensors passed in and out with an absolute `position`, and Core ML states.
Sequence-length-dependent slicing uses traced tensor ops, never Python ints, so the traced
graph stays valid for every T of the flexible input.
"""

import numpy as np
import torch
from torch import nn

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, MAX_LEN = 96, 64, 4, 2, 16, 128, 128
CACHE_LEN = 64  # KV and stateful variants: fixed cache length (positions + T <= CACHE_LEN)
EPS = 1e-5


def _rope_tables(max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    ang = torch.arange(max_len, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return torch.cat([-x2, x1], dim=-1)


class TinyDecoder(nn.Module):
    """One decoder block plus tied head; `cache` selects how past keys/values are kept."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def w(*shape, scale=0.08):
            return nn.Parameter(torch.randn(*shape, generator=g) * scale)

        self.embed = w(VOCAB, DIM, scale=0.5)
        self.attn_norm = nn.Parameter(1.0 + 0.1 * torch.randn(DIM, generator=g))
        self.mlp_norm = nn.Parameter(1.0 + 0.1 * torch.randn(DIM, generator=g))
        self.final_norm = nn.Parameter(1.0 + 0.1 * torch.randn(DIM, generator=g))
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=True)
        self.k = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.v = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.gate = nn.Linear(DIM, HIDDEN, bias=False)
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        for lin in (self.q, self.k, self.v, self.o, self.gate, self.up, self.down):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g) * 0.08
            if lin.bias is not None:
                lin.bias.data = torch.randn(lin.bias.shape, generator=g) * 0.02
        cos, sin = _rope_tables(MAX_LEN)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        causal = torch.full((MAX_LEN, MAX_LEN), float("-inf")).triu(1)
        self.register_buffer("causal", causal)

    def _norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w

    def _qkv(self, h, cos, sin):
        T = h.shape[1]
        q = self.q(h).view(1, T, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k(h).view(1, T, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v(h).view(1, T, KV_HEADS, HEAD_DIM).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _attend(self, x, q, k, v, mask):
        rep = HEADS // KV_HEADS
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / HEAD_DIM**0.5 + mask
        a = torch.softmax(scores, dim=-1) @ v
        a = a.transpose(1, 2).reshape(1, x.shape[1], HEADS * HEAD_DIM)
        x = x + self.o(a)
        h = self._norm(x, self.mlp_norm)
        x = x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))
        return self._norm(x, self.final_norm) @ self.embed.t()

    def forward(self, ids):
        T = ids.shape[1]
        x = self.embed[ids]
        q, k, v = self._qkv(self._norm(x, self.attn_norm), self.cos[:T], self.sin[:T])
        return self._attend(x, q, k, v, self.causal[:T, :T])


class TinyDecoderKV(TinyDecoder):
    """Past keys/values come in and go out as tensors; `position` is the absolute start."""

    def forward(self, ids, position, k_cache, v_cache):
        T = ids.shape[1]
        pos = position + torch.arange(T, dtype=torch.int32)
        x = self.embed[ids]
        q, k, v = self._qkv(self._norm(x, self.attn_norm), self.cos[pos], self.sin[pos])
        index = pos.long().view(1, 1, T, 1).repeat(1, KV_HEADS, 1, HEAD_DIM)
        k_cache = torch.scatter(k_cache, 2, index, k)
        v_cache = torch.scatter(v_cache, 2, index, v)
        mask = self.causal[pos.long()][:, :CACHE_LEN]
        return self._attend(x, q, k_cache, v_cache, mask), k_cache, v_cache


class TinyDecoderStateful(TinyDecoder):
    """Keys/values live in Core ML states updated in place by slice assignment."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self.register_buffer("k_cache", torch.zeros(1, KV_HEADS, CACHE_LEN, HEAD_DIM, dtype=torch.float16))
        self.register_buffer("v_cache", torch.zeros(1, KV_HEADS, CACHE_LEN, HEAD_DIM, dtype=torch.float16))

    def forward(self, ids, position):
        T = ids.shape[1]
        pos = position + torch.arange(T, dtype=torch.int32)
        x = self.embed[ids]
        q, k, v = self._qkv(self._norm(x, self.attn_norm), self.cos[pos], self.sin[pos])
        end = position[0] + T
        self.k_cache[:, :, position[0]:end] = k.half()
        self.v_cache[:, :, position[0]:end] = v.half()
        mask = self.causal[pos.long()][:, :CACHE_LEN]
        return self._attend(x, q, self.k_cache.float(), self.v_cache.float(), mask)


# ---- conversions ---------------------------------------------------------------------------------
# Imported lazily by the functions below: coremltools is slow to import and noisy.


def _convert(module, example, inputs, outputs, states=None, precision="FLOAT32", target="iOS18"):
    import coremltools as ct

    traced = torch.jit.trace(module, example)
    return ct.convert(
        traced,
        convert_to="mlprogram",
        minimum_deployment_target=getattr(ct.target, target),
        compute_precision=getattr(ct.precision, precision),
        inputs=inputs,
        outputs=outputs,
        states=states,
    )


def _ids_type(max_len: int):
    import coremltools as ct

    return ct.TensorType("ids", shape=(1, ct.RangeDim(1, max_len)), dtype=np.int32)


def convert_stateless(module: TinyDecoder, precision: str = "FLOAT32", target: str = "iOS18"):
    import coremltools as ct

    ids = torch.zeros(1, 5, dtype=torch.int32)
    return _convert(module, ids, [_ids_type(MAX_LEN)], [ct.TensorType("logits")], precision=precision, target=target)


def cache_shape() -> tuple[int, ...]:
    return (1, KV_HEADS, CACHE_LEN, HEAD_DIM)


def convert_kv(module: TinyDecoderKV):
    import coremltools as ct

    ids = torch.zeros(1, 5, dtype=torch.int32)
    pos = torch.tensor([3], dtype=torch.int32)
    cache = torch.zeros(cache_shape())
    inputs = [
        _ids_type(CACHE_LEN),
        ct.TensorType("position", shape=(1,), dtype=np.int32),
        ct.TensorType("k_cache", shape=cache_shape(), dtype=np.float32),
        ct.TensorType("v_cache", shape=cache_shape(), dtype=np.float32),
    ]
    outputs = [ct.TensorType("logits"), ct.TensorType("k_out"), ct.TensorType("v_out")]
    return _convert(module, (ids, pos, cache, cache), inputs, outputs)


def convert_stateful(module: TinyDecoderStateful):
    import coremltools as ct

    ids = torch.zeros(1, 5, dtype=torch.int32)
    pos = torch.tensor([3], dtype=torch.int32)
    inputs = [_ids_type(CACHE_LEN), ct.TensorType("position", shape=(1,), dtype=np.int32)]
    states = [
        ct.StateType(wrapped_type=ct.TensorType(shape=cache_shape(), dtype=np.float16), name=name)
        for name in ("k_cache", "v_cache")
    ]
    return _convert(module, (ids, pos), inputs, [ct.TensorType("logits")], states)


COMPRESSIONS = ("int8", "int4", "pal4", "pal6", "joint", "sparse")
# The same compressors on an iOS16 program emit the older op formats: constexpr_affine_dequantize,
# constexpr_lut_to_dense with a flat LUT and packed uint8 indices, a flat sparse bitmask.
IOS16_COMPRESSIONS = ("affine", "pal4_tensor", "sparse")


def compress(mlmodel, kind: str):
    """Compress with coremltools.optimize.coreml. Palettization uses mode="uniform": kmeans needs
    scikit-learn, which is not a project dependency, and both modes emit the same
    constexpr_lut_to_dense. Constants holding -inf (the causal mask) are left alone: coremltools
    would palettize them into NaNs; per-channel affine quantization also skips constants with a
    constant row (the RoPE tables), whose zero range it divides by."""
    import coremltools.optimize.coreml as cto

    def skipped(value):
        if not (isinstance(value, np.ndarray) and value.dtype.kind == "f"):
            return False
        flat_row = value.ndim == 2 and bool((value.max(axis=1) == value.min(axis=1)).any())
        return not np.isfinite(value).all() or (kind == "affine" and flat_row)

    skip = {
        op.outputs[0].name: None
        for op in mlmodel._mil_program.functions["main"].operations
        if op.op_type == "const" and skipped(op.outputs[0].val)
    }

    def config(global_config):
        return cto.OptimizationConfig(global_config=global_config, op_name_configs=skip)

    def linear(dtype, mode="linear_symmetric", **granularity):
        return config(cto.OpLinearQuantizerConfig(mode=mode, dtype=dtype, weight_threshold=512, **granularity))

    def palette(nbits, **granularity):
        return config(cto.OpPalettizerConfig(nbits=nbits, mode="uniform", weight_threshold=512, **granularity))

    grouped = dict(granularity="per_grouped_channel", group_size=32)
    if kind in ("int8", "int4"):
        return cto.linear_quantize_weights(mlmodel, linear(kind, granularity="per_block", block_size=32))
    if kind == "affine":
        return cto.linear_quantize_weights(mlmodel, linear("uint8", mode="linear", granularity="per_channel"))
    if kind in ("pal4", "pal6"):
        return cto.palettize_weights(mlmodel, palette(int(kind[3:]), **grouped))
    if kind == "pal4_tensor":
        return cto.palettize_weights(mlmodel, palette(4, granularity="per_tensor"))
    if kind == "joint":  # 4-bit palettes whose LUT entries are themselves int8-quantized
        palettized = cto.palettize_weights(mlmodel, palette(4, **grouped))
        return cto.linear_quantize_weights(palettized, linear("int8", granularity="per_tensor"), joint_compression=True)
    if kind == "sparse":
        pruner = cto.OpMagnitudePrunerConfig(target_sparsity=0.5, weight_threshold=512)
        return cto.prune_weights(mlmodel, config(pruner))
    raise ValueError(kind)


def decompressed_weights(mlmodel) -> dict[str, np.ndarray]:
    """coremltools' own decompression of every compressed constant, keyed by the original const
    name: the independent reference for the executor's constexpr ops."""
    out = {}
    for op in mlmodel._mil_program.functions["main"].operations:
        if op.op_type.startswith("constexpr_") and not any(
            c.op_type.startswith("constexpr_") for c in op.outputs[0].child_ops
        ):
            name = op.outputs[0].name
            for suffix in ("_palettized", "_quantized", "_sparsified"):
                name = name.removesuffix(suffix)
            out[name] = np.asarray(_materialize(op.outputs[0]), dtype=np.float32)
    return out


def _materialize(var):
    """Value of a const or constexpr var, chaining coremltools' per-op `decompress` (its own
    materialized_val_inference stops at a constexpr operand, as in joint compression)."""
    if var.val is not None:
        return var.val
    op = var.op
    args = {k: _materialize(op.inputs[k]) if k in op.inputs else None for k in op.input_spec.input_types}
    return type(op).decompress(**args)


def with_weights(module: nn.Module, weights: dict[str, np.ndarray]) -> nn.Module:
    """A copy of `module` whose parameters/buffers are replaced by `weights` (MIL const names,
    i.e. state-dict keys with '.' written as '_')."""
    state = module.state_dict()
    by_const = {key.replace(".", "_"): key for key in state}
    for name, value in weights.items():
        key = by_const[name]
        state[key] = torch.from_numpy(value).to(state[key].dtype).reshape(state[key].shape)
    clone = type(module)()
    clone.load_state_dict(state)
    return clone.eval()


COMPRESSED = (*COMPRESSIONS, *(f"ios16_{k}" for k in IOS16_COMPRESSIONS))  # package names


def build_packages(root) -> dict:
    """Convert every variant once into `root`; returns paths plus the reference decompressed weights."""
    import coremltools as ct
    from pathlib import Path

    root = Path(root)
    paths, weights = {}, {}
    stateless = convert_stateless(TinyDecoder().eval())
    for name, mlmodel in (
        ("stateless", stateless),
        ("kv", convert_kv(TinyDecoderKV().eval())),
        ("stateful", convert_stateful(TinyDecoderStateful().eval())),
        ("fp16", convert_stateless(TinyDecoder().eval(), precision="FLOAT16")),
    ):
        paths[name] = root / f"{name}.mlpackage"
        mlmodel.save(str(paths[name]))
    ios16 = convert_stateless(TinyDecoder().eval(), target="iOS16")
    for name, base, kind in [*((k, stateless, k) for k in COMPRESSIONS), *((f"ios16_{k}", ios16, k) for k in IOS16_COMPRESSIONS)]:
        compressed = compress(base, kind)
        paths[name] = root / f"{name}.mlpackage"
        compressed.save(str(paths[name]))
        weights[name] = decompressed_weights(compressed)
    desc = ct.utils.MultiFunctionDescriptor()
    desc.add_function(str(paths["stateless"]), src_function_name="main", target_function_name="prefill")
    desc.add_function(str(paths["kv"]), src_function_name="main", target_function_name="decode")
    desc.default_function_name = "prefill"
    paths["multi"] = root / "multi.mlpackage"
    ct.utils.save_multifunction(desc, str(paths["multi"]))
    return {"paths": paths, "weights": weights}
