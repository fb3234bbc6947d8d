"""Pieces shared by every decoder family: weights intake, norms, RoPE, attention, the KV cache.

Written for two readers: a person checking the maths against Hugging Face, and
`torch.jit.trace` + coremltools. For the second, forward passes take every size from
`ModelArgs` (never `tensor.shape` turned into a Python int), RMSNorm is spelled out, GQA is
an explicit expand + reshape, and the KV cache is plain tensors in and out.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.ground.cmf.masks import TaskMask
from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.halves import as_dtype
from pipeline.ground.models.args import ModelArgs
from pipeline.ground.models.errors import ContextOverflow, ModelConfigError
from pipeline.ground.models.rope import rope_inv_freq
from pipeline.ground.models.weights import WeightLedger


class Weights(WeightLedger):
    """The ledger handing tensors out as float32 torch tensors."""

    def take(self, name: str, shape: tuple) -> torch.Tensor:
        """The tensor as float32; `None` in `shape` accepts any size on that axis."""
        value = self.entry(name)
        if isinstance(value, torch.Tensor):
            tensor = value.detach().to(torch.float32).clone()
        else:
            array = np.asarray(value, dtype=np.float32)
            # A writable float32 array (a bundle's copy-on-write map, a freshly decoded tensor) is
            # taken as it is; a read-only one (a CMF's own map, closed after loading) is copied.
            tensor = torch.from_numpy(array) if array.flags.writeable else torch.tensor(array)
        self.claim(name, tuple(tensor.shape), shape)
        return tensor

    def optional(self, name: str, shape: tuple) -> torch.Tensor | None:
        return self.take(name, shape) if self.has(name) else None


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _mask_buffer(bits: np.ndarray | None) -> torch.Tensor | None:
    """A float 0/1 multiplier, or None when every bit is set (the dense path stays op-free)."""
    if bits is None or bits.all():
        return None
    return torch.tensor(bits, dtype=torch.float32)


# Bytes of a weight an fp16 linear widens to float32 at a time (`half_linear`): a bounded copy,
# never the whole weight (Gemma 3's tied head would be 671 MB).
HALF_BLOCK_BYTES = 32 << 20


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = _frozen(weight)
        self.bias = None if bias is None else _frozen(bias)

    def forward(self, x):
        if x.dtype == torch.float16:
            return half_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A linear of fp16 operands under the op-boundary model (pipeline.ground.models.fp16):
    float32 sums, rounded once to fp16. ATen's Half GEMM on the CPU is that model too, but a
    scalar loop: 1.1-4.9x float32's time at SmolLM2's shapes (its head on 320 rows: 4.4 s
    against 0.9 s). So the weight is widened a block of output rows at a time (exact) and
    multiplied in float32; each output is rounded once as it is written. Only the summation
    order can differ from ATen's, which the fp16 bounds allow (numerics.fp16_logits_bound)."""
    x32 = x.float()
    step = max(1, HALF_BLOCK_BYTES // (4 * weight.shape[1]))
    blocks = []  # out of place: scoring runs this under torch.vmap
    for start in range(0, weight.shape[0], step):
        rows = slice(start, start + step)
        wide = torch.from_numpy(as_dtype(weight[rows].numpy(), np.float32))
        blocks.append(F.linear(x32, wide, None if bias is None else bias[rows].float()).half())
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.matmul`; of fp16 operands, in float32 rounded once to fp16, as `half_linear`
    computes (ATen's Half batched GEMM is the same scalar loop)."""
    if a.dtype == torch.float16:
        return torch.matmul(a.float(), b.float()).half()
    return torch.matmul(a, b)


def linear(weights: Weights, prefix: str, out_features: int | None, in_features: int | None) -> Linear:
    """`{prefix}.weight` with its optional `{prefix}.bias` (capability by presence)."""
    weight = weights.take(f"{prefix}.weight", (out_features, in_features))
    return Linear(weight, weights.optional(f"{prefix}.bias", (weight.shape[0],)))


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, style: str):
        super().__init__()
        self.weight = _frozen(weight)
        self.eps = eps
        # Gemma stores w - 1 (spec §2: "gemma" means x_hat * (1 + w)).
        self.offset = style == "gemma"

    def forward(self, x):
        scale = self.weight + 1.0 if self.offset else self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * scale


def rotate_half(x, half: int):
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Multi-head attention with GQA; q/k/v/o biases and q/k norms by tensor presence, the
    query scale and a sliding window by the arch."""

    def __init__(self, args: ModelArgs, weights: Weights, prefix: str, head_bits: np.ndarray | None,
                 sliding: bool = False):
        super().__init__()
        heads, kv_heads, dim, hidden = args.num_attention_heads, args.num_kv_heads, args.head_dim, args.hidden_size
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim
        self.scale = dim**-0.5 if args.query_pre_attn_scalar is None else args.query_pre_attn_scalar**-0.5
        self.sliding = sliding
        self.q_proj = linear(weights, f"{prefix}.q_proj", heads * dim, hidden)
        self.k_proj = linear(weights, f"{prefix}.k_proj", kv_heads * dim, hidden)
        self.v_proj = linear(weights, f"{prefix}.v_proj", kv_heads * dim, hidden)
        self.o_proj = linear(weights, f"{prefix}.o_proj", hidden, heads * dim)
        q_norm = weights.optional(f"{prefix}.q_norm.weight", (dim,))
        k_norm = weights.optional(f"{prefix}.k_norm.weight", (dim,))
        self.q_norm = None if q_norm is None else RMSNorm(q_norm, args.rms_norm_eps, args.norm_style)
        self.k_norm = None if k_norm is None else RMSNorm(k_norm, args.rms_norm_eps, args.norm_style)
        self.head_mask = _mask_buffer(head_bits)
        # What masked scores become; a finite value is an fp16 mitigation (pipeline.ground.models.fp16).
        self.mask_value = float("-inf")
        # A no-op the preflight hooks to see q . k as the matmul gives it (before the scale).
        self.score_probe = nn.Identity()
        # Added to the rotated keys, a module of the positions (float32) or None: where k's bias
        # is moved past RoPE, an fp16 mitigation (pipeline.ground.models.fp16.RopeKeyOffset).
        self.key_offset = None

    def _heads(self, x, count: int, norm: RMSNorm | None):
        x = x.view(1, -1, count, self.head_dim)
        return (x if norm is None else norm(x)).transpose(1, 2)

    def _rope(self, x, cos, sin):
        return x * cos + rotate_half(x, self.head_dim // 2) * sin

    def _repeat_kv(self, x):
        """[1, kv, S, D] -> [1, heads, S, D]; query head h reads kv head h // (heads / kv)."""
        repeat = self.heads // self.kv_heads
        x = x[:, :, None].expand(1, self.kv_heads, repeat, -1, self.head_dim)
        return x.reshape(1, self.heads, -1, self.head_dim)

    def forward(self, x, cos, sin, step: "CacheStep", key_cache, value_cache):
        q = self._rope(self._heads(self.q_proj(x), self.heads, self.q_norm), cos, sin)
        k = self._rope(self._heads(self.k_proj(x), self.kv_heads, self.k_norm), cos, sin)
        if self.key_offset is not None:
            k = k + self.key_offset(step.positions).to(k.dtype)
        v = self._heads(self.v_proj(x), self.kv_heads, None)
        keys, values = step.write(key_cache, k), step.write(value_cache, v)
        seen_keys, seen_values = step.attended(key_cache, k, keys), step.attended(value_cache, v, values)
        scores = self.score_probe(matmul(q, self._repeat_kv(seen_keys).transpose(2, 3))) * self.scale
        if step.bias is not None:
            scores = scores + step.bias
        scores = scores.masked_fill(~(step.attend_sliding if self.sliding else step.attend), self.mask_value)
        out = matmul(torch.softmax(scores, dim=-1), self._repeat_kv(seen_values))
        if self.head_mask is not None:
            out = out * self.head_mask.view(1, self.heads, 1, 1)
        out = out.transpose(1, 2).reshape(1, -1, self.heads * self.head_dim)
        return self.o_proj(out), keys, values


ACTIVATION_FNS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    """down(act(gate x) * up x): SwiGLU or GeGLU. The width comes from the tensors (pruned files)."""

    def __init__(self, args: ModelArgs, weights: Weights, prefix: str, neuron_bits: np.ndarray | None):
        super().__init__()
        hidden = args.hidden_size
        self.gate_proj = linear(weights, f"{prefix}.gate_proj", None, hidden)
        width = self.gate_proj.weight.shape[0]
        self.up_proj = linear(weights, f"{prefix}.up_proj", width, hidden)
        self.down_proj = linear(weights, f"{prefix}.down_proj", hidden, width)
        self.act = ACTIVATION_FNS[args.hidden_act]
        if neuron_bits is not None and len(neuron_bits) != width:
            raise ModelConfigError(
                f"{prefix}: a neuron mask of {len(neuron_bits)} bits cannot address a pruned FFN of width {width}"
            )
        self.neuron_mask = _mask_buffer(neuron_bits)

    def forward(self, x):
        h = self.act(self.gate_proj(x)) * self.up_proj(x)
        if self.neuron_mask is not None:
            h = h * self.neuron_mask
        return self.down_proj(h)


class DecoderLayer(nn.Module):
    """A pre-norm layer; with `pre_feedforward_layernorm` present, a sandwich-norm one (Gemma 2/3),
    whose `post_attention_layernorm` then norms the attention output before the residual add
    instead of the FFN input, and whose `post_feedforward_layernorm` (by presence) norms the
    FFN output before its residual add."""

    def __init__(self, args: ModelArgs, attn: Attention, mlp: nn.Module, weights: Weights, prefix: str, active: bool):
        super().__init__()
        hidden, eps, style = args.hidden_size, args.rms_norm_eps, args.norm_style

        def norm(name: str) -> RMSNorm:
            return RMSNorm(weights.take(f"{prefix}.{name}.weight", (hidden,)), eps, style)

        def optional_norm(name: str) -> RMSNorm | None:
            return norm(name) if weights.has(f"{prefix}.{name}.weight") else None

        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = norm("input_layernorm")
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.pre_feedforward_layernorm = optional_norm("pre_feedforward_layernorm")
        # Without the pre-FFN norm a post-FFN one has no layout here: left untaken, it is refused.
        sandwich = self.pre_feedforward_layernorm is not None
        self.post_feedforward_layernorm = optional_norm("post_feedforward_layernorm") if sandwich else None
        self.active = active

    def forward(self, h, cos, sin, step: "CacheStep", key_cache, value_cache):
        if not self.active:
            # A gated-off layer leaves the residual stream alone (spec §5); its cache slots
            # are never read by an active layer, so they stay as they were.
            return h, key_cache, value_cache
        attn_out, keys, values = self.self_attn(self.input_layernorm(h), cos, sin, step, key_cache, value_cache)
        if self.pre_feedforward_layernorm is None:
            h = h + attn_out
            h = h + self.mlp(self.post_attention_layernorm(h))
            return h, keys, values
        h = h + self.post_attention_layernorm(attn_out)
        ffn_out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.post_feedforward_layernorm is not None:
            ffn_out = self.post_feedforward_layernorm(ffn_out)
        return h + ffn_out, keys, values


def _axis_index(x):
    """0, 1, ..., n-1 along a 1-D tensor as float32, without reading n as a Python int,
    so a traced graph keeps the length symbolic."""
    return torch.cumsum(torch.ones_like(x, dtype=torch.float32), dim=0) - 1


class CacheStep:
    """Where a chunk of T tokens at absolute positions sits in a cache of S slots.

    The write is a 0/1 matrix product instead of an indexed copy: exact in float32 (every
    product is by 0 or 1), and free of data-dependent indexing for tracing.

    With `rows_apart`, each of the T tokens is a one-token chunk of its own at its position, and
    the cache given is the one the last of them left: the reference checking a package's
    consecutive single-token calls in one forward (`TorchBackend.single_steps`). Slot =
    position, so the slots before a token's position are the cache its call read; it attends
    to those and to its own K/V, never to the slot the package wrote for it. That is each
    call's arithmetic, summation order aside: a masked score's weight is exactly 0.

    `bias` [1, 1, T, S] (or None) is added to every head's scores before the causal and window
    masks: a package's loader may pass an additive mask of its own (`coreml.interfaces`), which can
    mask more than causality does but never less, as the masks after it still hold.
    """

    def __init__(self, ids, position, slots_axis, sliding_window: int | None = None, rows_apart: bool = False,
                 bias=None):
        self.bias = bias
        self.positions = position.to(torch.float32).reshape(1) + _axis_index(ids[0])  # [T]
        self.rows_apart = rows_apart
        slots = _axis_index(slots_axis)  # [S]
        # In the cache's dtype: 0 and 1 are exact in fp16 too (the fp16 reference's cache).
        self.place = (slots[None, :] == self.positions[:, None]).to(slots_axis.dtype)  # [T, S]
        self.keep = (1.0 - self.place.sum(0))[:, None]  # [S, 1]
        # A slot at or after position + T is later than every query, so causality alone
        # keeps stale or empty slots out of the output.
        seen = slots[None, :] < self.positions[:, None] if rows_apart else slots[None, :] <= self.positions[:, None]
        self.attend = self._mask(seen)
        self.attend_sliding = None
        if sliding_window is not None:
            # transformers' sliding window: query i sees key j iff i - window < j <= i. The cache
            # holds every position for every layer (slot = position) and the window is this mask
            # alone; a ring buffer of `window` slots for the sliding layers is a Core ML cache
            # design choice, not the reference's.
            recent = slots[None, :] > self.positions[:, None] - sliding_window
            self.attend_sliding = self._mask(seen & recent)

    def _mask(self, seen):
        """[1, 1, T, S]; rows apart, [1, 1, T, S + T]: each row also sees its own token."""
        if self.rows_apart:
            seen = torch.cat([seen, torch.eye(len(self.positions), dtype=torch.bool)], dim=1)
        return seen[None, None]

    def write(self, cache, new):
        """cache [1, kv, S, D] with slots position.. replaced by new [1, kv, T, D]."""
        return cache * self.keep + matmul(self.place.transpose(0, 1), new)

    def attended(self, cache, new, written):
        """The K or V the chunk's queries attend over (`attend` says which of them each may):
        the written cache, or rows apart, the cache given followed by the chunk's own."""
        return torch.cat([cache, new], dim=2) if self.rows_apart else written


def _cos_sin(step: CacheStep, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin [T, head_dim] at the step's positions, as transformers builds them."""
    freqs = step.positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Decoder(nn.Module):
    """Embedding, decoder layers, final norm and LM head under HF tensor names.

    Families override `embed_scale` and `make_ffn`. `state_dict()` keys are the HF names
    (plus `lm_head.weight` only when untied).
    """

    def __init__(self, args: ModelArgs, weights: Weights, masks: TaskMask | None = None):
        super().__init__()
        for index, layer_type in enumerate(args.layer_types):
            if layer_type not in ("FullAttention", "SlidingAttention"):
                raise UnsupportedModel(f"{weights.source}: layer {index} has layer type {layer_type!r}; "
                                       "the reference decoder runs only FullAttention and SlidingAttention layers")
        self.args = args
        hidden, vocab = args.hidden_size, args.vocab_size
        self.model = nn.Module()
        self.model.embed_tokens = Linear(weights.take("model.embed_tokens.weight", (vocab, hidden)))
        layers = []
        for i in range(args.num_layers):
            prefix = f"model.layers.{i}"
            attn = Attention(args, weights, f"{prefix}.self_attn", None if masks is None else masks.heads[i],
                             sliding=args.layer_types[i] == "SlidingAttention")
            mlp = self.make_ffn(args, weights, f"{prefix}.mlp", i, masks)
            active = True if masks is None else bool(masks.layer_gates[i])
            layers.append(DecoderLayer(args, attn, mlp, weights, prefix, active))
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = RMSNorm(weights.take("model.norm.weight", (hidden,)), args.rms_norm_eps, args.norm_style)
        tied = args.tie_word_embeddings and not weights.has("lm_head.weight")
        self.lm_head = None if tied else Linear(weights.take("lm_head.weight", (vocab, hidden)))
        self.register_buffer("inv_freq", torch.from_numpy(rope_inv_freq(args)), persistent=False)
        sliding = "SlidingAttention" in args.layer_types
        self.sliding_window = args.sliding_window if sliding else None
        # Sliding layers with a RoPE base of their own (Gemma 3's local base); otherwise they share inv_freq.
        local = sliding and args.rope_local_base_freq is not None
        self.register_buffer("sliding_inv_freq", torch.from_numpy(rope_inv_freq(args, "SlidingAttention"))
                             if local else None, persistent=False)
        weights.refuse_leftovers()

    def embed_scale(self) -> torch.Tensor | None:
        return None

    def make_ffn(self, args: ModelArgs, weights: Weights, prefix: str, index: int, masks: TaskMask | None):
        return GatedMLP(args, weights, prefix, None if masks is None else masks.ffn[index])

    def forward_with_cache_tensors(self, ids, position, key_cache, value_cache, attention_bias=None,
                                   compute_dtype=None):
        """One chunk through the model with explicit cache tensors (the Core ML converter's entry).

        ids [1, T] int; position: int tensor of one element, the absolute position of ids[0, 0];
        key_cache / value_cache [layers, 1, kv_heads, context, head_dim]; `attention_bias`: an
        additive [1, 1, T, context] on the scores (`CacheStep`); `compute_dtype`: as
        `layers_with_cache_tensors`. Returns logits [1, T, vocab] and the caches with slots
        position..position+T-1 written, in the caches' dtype. The inputs are never modified.
        """
        hidden, keys, values = self.hidden_with_cache_tensors(ids, position, key_cache, value_cache,
                                                              attention_bias=attention_bias,
                                                              compute_dtype=compute_dtype)
        return self.logits_of(hidden), torch.stack(keys), torch.stack(values)

    def hidden_with_cache_tensors(self, ids, position, key_cache, value_cache, rows_apart: bool = False,
                                  attention_bias=None, token_rows=None, compute_dtype=None):
        """`forward_with_cache_tensors` short of the head: the final-normed hidden states, and
        each layer's written caches as lists (stacked after the head, the converted program's
        op order stays what it was). `rows_apart`: each token a chunk of its own (`CacheStep`).
        `token_rows`: what reads the ids' table rows in place of `self.token_rows` (a head in parts)."""
        hidden, keys, values = self.layers_with_cache_tensors(ids, position, key_cache, value_cache,
                                                              (0, self.args.num_layers), rows_apart, attention_bias,
                                                              token_rows, compute_dtype)
        return self.model.norm(hidden), keys, values

    def token_rows(self, ids):
        """The embedding table's rows of `ids` [1, T]: [1, T, hidden]."""
        return F.embedding(ids, self.model.embed_tokens.weight)

    def layers_with_cache_tensors(self, x, position, key_cache, value_cache, layers: tuple[int, int],
                                  rows_apart: bool = False, attention_bias=None, token_rows=None,
                                  compute_dtype=None):
        """Layers start..stop-1 of `hidden_with_cache_tensors`, before the final norm: what one piece
        of a model cut at layer boundaries computes (`coreml.split`). `x` is the token ids [1, T]
        where start is 0 (embedded here, by `token_rows` if given), else the hidden states [1, T, hidden]
        layer start - 1 gave; the caches hold these layers' alone [stop - start, 1, kv_heads,
        context, head_dim]. Pieces run in turn compute what the whole does, op for op.

        `compute_dtype`: caches held in another dtype than the arithmetic's (a stateful package's
        fp16 state under float32 layers, a check's fp16 noise prefix) are read into it a layer at
        a time, and each layer's written caches go back to the caches' dtype as the layer is
        done. The values are those of casting the whole cache in and the stacked result back,
        without a float32 copy of the whole cache, of every layer's written cache and of their
        stack at once: 1.1 GB at SmolLM2's context 8192 (docs/MEMORY.md). A converted FP32
        program still reads a state through one cast of the whole (coremltools' torch frontend;
        the MIL executor slices before it casts, `Executor._slice_before_casts`); an fp16 one
        has no cast."""
        start, stop = layers
        held = key_cache.dtype
        if compute_dtype is None or compute_dtype == held:
            def read(cache):
                return cache

            def kept(cache):
                return cache
        else:
            def read(cache):
                return cache.to(compute_dtype)

            def kept(cache):
                return cache.to(held)
        tokens = x if start == 0 else x[:, :, 0]  # [1, T]: the step counts the chunk's positions from it
        slots_axis = read(key_cache[0, 0, 0, :, 0])
        step = CacheStep(tokens, position, slots_axis, self.sliding_window, rows_apart, attention_bias)
        full = _cos_sin(step, self.inv_freq)
        rope = {"FullAttention": full,
                "SlidingAttention": full if self.sliding_inv_freq is None else _cos_sin(step, self.sliding_inv_freq)}
        h = (token_rows or self.token_rows)(x) if start == 0 else x
        if slots_axis.dtype == torch.float64:
            h = h.double()  # the float64 side of `noise.rounding_noise`: its layers are widened as they run
        elif h.dtype != torch.float32:
            # fp16 weights (pipeline.ground.models.fp16): positions and RoPE angles stay float32,
            # as integers past 2048 and angles of hundreds of radians are not exact in fp16;
            # cos and sin enter the fp16 path rounded once.
            rope = {kind: (cos.to(h.dtype), sin.to(h.dtype)) for kind, (cos, sin) in rope.items()}
        scale = self.embed_scale() if start == 0 else None
        if scale is not None:
            h = h * scale
        new_keys, new_values = [], []
        for i in range(start, stop):
            h, keys, values = self.model.layers[i](h, *rope[self.args.layer_types[i]], step,
                                                   read(key_cache[i - start]), read(value_cache[i - start]))
            new_keys.append(kept(keys))
            new_values.append(kept(values))
        return h, new_keys, new_values

    @property
    def head(self) -> Linear:
        """The LM head: the embedding table where tied, else `lm_head`."""
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    @property
    def head_name(self) -> str:
        """The HF name of the head's weight."""
        return "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF name -> weight, as this model computes with it (a package converted from it stores
        these values, each rounded once to the package's float dtype)."""
        return {name: parameter.detach() for name, parameter in self.named_parameters()}

    def logits_of(self, hidden):
        return self.head(hidden)

    def forward_branches(self, suffixes: list[torch.Tensor], positions: list[int], key_caches, value_caches,
                         last_only: bool = False):
        """Each branch i: suffix i (int [T_i]) run after its own cache at positions[i]
        (key_caches / value_caches [B, layers, 1, kv_heads, context, head_dim]; an expanded
        view shares one), as one batch (`hidden_branches`). Returns the logits [T_i, vocab]
        of each branch (with `last_only`, of its last token alone [1, vocab]) and the caches
        [B, ...] each wrote. The head, a fifth of SmolLM2's weights, runs once on the wanted
        rows of every branch, never on padding."""
        rows, keys, values = self.hidden_branches(suffixes, positions, key_caches, value_caches, last_only)
        logits = self.logits_of(torch.cat(rows)).split([len(r) for r in rows])
        return list(logits), keys, values

    def hidden_branches(self, suffixes: list[torch.Tensor], positions: list[int], key_caches, value_caches,
                        last_only: bool = False):
        """`forward_branches` short of the head: each branch's final-normed hidden rows.
        The branches run as one batch (torch.func.vmap of `hidden_with_cache_tensors`): a
        few-token chunk is bound by reading the weights, which the batch reads once for all
        its branches. Suffixes are right-padded to the longest; causality keeps the padding
        out of every real row, and the slots it wrote lie past the branch's position + T_i,
        where every later query masks them (the dirty-tail invariant)."""
        width = max(len(s) for s in suffixes)
        batch = torch.stack([F.pad(s, (0, width - len(s))) for s in suffixes])[:, None]  # [B, 1, width]
        at = torch.tensor(positions, dtype=torch.int64)[:, None]  # [B, 1]

        def branch(ids, position, keys, values):
            hidden, new_keys, new_values = self.hidden_with_cache_tensors(ids, position, keys, values)
            return hidden[0], torch.stack(new_keys), torch.stack(new_values)

        hidden, keys, values = torch.func.vmap(branch)(batch, at, key_caches, value_caches)
        rows = [hidden[i, len(s) - 1 if last_only else 0:len(s)] for i, s in enumerate(suffixes)]
        return rows, keys, values

    def hidden(self, ids):
        """The final-normed hidden states [T, hidden] of one sequence from position 0 (ids [T]
        or [1, T]): `forward` short of the head."""
        ids = ids.reshape(1, -1)
        cache = KVCache.empty(self.args, ids.shape[1])
        return self.hidden_with_cache_tensors(ids, torch.zeros(1, dtype=torch.int64), cache.keys, cache.values)[0][0]

    def forward(self, ids):
        """Logits [T, vocab] of one sequence from position 0 (ids [T] or [1, T])."""
        ids = ids.reshape(1, -1)
        cache = KVCache.empty(self.args, ids.shape[1])
        return self.forward_cached(ids, cache)

    def forward_cached(self, ids, cache: "KVCache"):
        """Logits [T, vocab] of ids run after the cache's tokens; the cache advances by T."""
        return self.logits_of(self.hidden_cached(ids, cache))

    def hidden_cached(self, ids, cache: "KVCache"):
        """`forward_cached` short of the head: the final-normed hidden states [T, hidden]."""
        ids = ids.reshape(1, -1)
        count = ids.shape[1]
        if cache.position + count > cache.context:
            raise ContextOverflow(
                f"KV cache: {count} tokens at position {cache.position} exceed the context of {cache.context}"
            )
        position = torch.tensor([cache.position], dtype=torch.int64)
        hidden, keys, values = self.hidden_with_cache_tensors(ids, position, cache.keys, cache.values)
        cache.keys, cache.values = torch.stack(keys), torch.stack(values)
        cache.position += count
        return hidden[0]


class CachedStep(nn.Module):
    """`forward_with_cache_tensors` as a module's forward, for `torch.jit.trace`."""

    def __init__(self, model: Decoder):
        super().__init__()
        self.model = model
        self.eval()

    def forward(self, ids, position, key_cache, value_cache):
        return self.model.forward_with_cache_tensors(ids, position, key_cache, value_cache)


@dataclass
class KVCache:
    """Keys and values [layers, 1, kv_heads, context, head_dim] and the count of tokens held.

    A forward replaces the tensors rather than writing into them, so `snapshot()` is free and
    a snapshot never changes when the cache it came from moves on.
    """

    keys: torch.Tensor
    values: torch.Tensor
    position: int = 0

    @classmethod
    def empty(cls, args: ModelArgs, context: int, dtype: torch.dtype = torch.float32) -> "KVCache":
        shape = (args.num_layers, 1, args.num_kv_heads, context, args.head_dim)
        return cls(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), 0)

    @property
    def context(self) -> int:
        return self.keys.shape[3]

    def snapshot(self) -> "KVCache":
        return KVCache(self.keys, self.values, self.position)
