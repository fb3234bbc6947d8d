"""fp16 numerics of the reference decoder: the mitigations that keep it finite, the fp16
reference a package is compared with, and the preflight that measures where fp16 overflows.

    findings = preflight_findings(model, args, windows)       # peaks per layer, FP32 and fp16
    mitigations = choose_mitigations(findings)                 # or Fp16Unsafe
    safe = mitigated_model(model, args, mitigations)           # FP32 function kept, fp16-safe
    check_mitigated(preflight_findings(safe, args, windows))   # finite, peaks under the limit
    TorchBackend(fp16_reference(safe), args, cache_dtype=np.float16, numerics=...)

What fp16 numerics means here (the "op-boundary" model): every weight and every op output
is a float16, while an op's own arithmetic (a matmul's or a reduction's sum, softmax's
exp and sum) runs in float32 and is rounded once at its output. torch's CPU half kernels do
exactly that: matmul/linear go through ATen's cpublas gemm, which accumulates Half in
`opmath_type<Half>` = float (aten/src/ATen/native/cpu/BlasKernel.cpp); reductions accumulate
in `acc_type<Half>` = float (ATen/AccumulateType.h); softmax and the pointwise kernels
convert a vector to float, compute and convert back (aten/src/ATen/native/cpu/SoftMaxKernel.cpp,
Vectorized<Half>). `tests/test_fp16.py` checks this on the machine it runs on: each half op
equals the float32 op on the same half inputs, rounded once, up to one fp16 step where the
float32 summation order differs. It is also the model the MIL executor emulates for an
fp16-typed program, so both sides of an fp16 gate round at the same places. The decoder's
linears and matmuls follow it in float32 GEMM instead of ATen's slow Half loop
(`base.half_linear`, `base.matmul`).

The overflow hazards (fp16's largest finite value is 65504):
- the residual stream: massive activations on a few tokens (BOS, the first delimiter) reach
  1e4 to 1e5 in real models; the residual add then overflows to inf;
- RMSNorm's square: x * x overflows once |x| > 255.9, and the norm's output then silently
  becomes x * rsqrt(inf) = 0 (or NaN where x is inf);
- q . k before the attention scale, the MLP's gate * up, and the logits.

The mitigations (`Fp16Mitigations`), each keeping the FP32 function:
- `residual_scale` alpha, a power of two: the residual stream is carried as alpha * h by
  weights alone (no op added). Whatever writes into the stream is scaled by alpha (the
  embedding table, and o_proj/down_proj rows, or a sandwich layer's post-norm gains), and
  every norm that reads the stream has its eps scaled by alpha**2, as
  norm(alpha h; alpha**2 eps) = norm(h; eps) exactly. A tied head reads the scaled
  embedding, so the final norm's gain is divided by alpha (its output times alpha E is
  the original logit); Gemma's constant embedding scale sqrt(hidden) then stays as it is.
  A power of two makes every one of these scalings exact in float32 and in fp16 (outside
  the subnormal range): the mitigated model computes alpha times the same numbers, bit for
  bit up to rsqrt's implementation. Gemma's (1 + w) gains become plain gains fl(1 + w) * alpha,
  the value the original computes before multiplying. eps * alpha**2 is exact as well; in
  fp16 an eps under 2**-24 flushes to zero, which changes a norm's output by at most
  eps / (2 mean(x**2)) relative, and the unmitigated fp16 program already drops any eps
  under mean(x**2) * 2**-12 when it adds it.
- `rmsnorm = "max_scaled"`: x_hat = (x / m) * rsqrt(mean((x / m)**2) + (sqrt(eps) / m)**2)
  with m = max(max|x|, floor). For any m > 0 this is x * rsqrt(mean(x**2) + eps): the
  function is unchanged, and every intermediate is bounded (|x / m| <= 1, the mean <= 1,
  the eps term <= 1 since floor >= sqrt(eps)), so no square overflows whatever |x| is.
  Chosen over the `layer_norm([x, -x])` form because its safety follows from the
  op-boundary model with elementary ops alone, where layer_norm's would rest on how a fused
  op computes its variance inside (not documented for the Neural Engine). coremltools 9
  lowers torch's `rms_norm` the same way but adds eps to the scaled mean (eps * m**2 in
  effect) and has no floor (0 / 0 on a zero row); the eps term here keeps the function.
- `mask_value`: a finite mask (e.g. -65504) instead of -inf. Under the op-boundary model
  -inf is exact (no row is ever fully masked: a query always sees its own slot), so the
  preflight does not choose it; it is there for a compiler whose handling of infinities is
  not documented. It keeps the function where every row's largest visible score exceeds
  mask_value + 104: softmax subtracts the row max inside the op, and exp of anything under
  -103.9 is exactly 0 in float32, as exp(-inf) is.
- `key_bias = "rope_offset"`: k's bias b moved past RoPE, less itself. The keys become
  k' = RoPE_j(W x_j) + (R_j - I) b instead of RoPE_j(W x_j + b), so every score of a query row
  is q . k - q . b: the same constant off for every key of the row, which softmax removes
  exactly. (R_j - I) b is a function of the position alone (positional, float32, rounded once
  where it meets the keys), and small where b is large: Qwen2.5's biases (up to 211) sit in
  RoPE's lowest frequencies, which turn by ~1e-6 rad a position. Without it, q . b sets the
  fp16 step of the scores (Qwen2.5-0.5B's layer 0: q . k ~ 11,800, a step of 8, 0.5 after the
  1/8 scale) and of the cached keys (145: a step of 0.125), and those roundings, not the
  head or the residual stream, cost it 2 % of its top-1 (docs/FP16.md). Adds a sub-graph of
  positional ops and one add per layer; drops the bias add of k_proj.
- Softmax with the max subtracted needs no rewrite: torch's softmax kernel subtracts the row
  max, `torch.softmax` converts to MIL's one `softmax` op (the executor's subtracts it too,
  coreml/mil/ops.py), and under the op-boundary model that subtraction is inside the op.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np
import torch
from torch import nn

from pipeline.ground.errors import CmfdeployError
from pipeline.ground.models.args import ModelArgs
from pipeline.ground.models.base import Decoder, GatedMLP, RMSNorm, rotate_half
from pipeline.ground.scratch import ScratchFile

FP16_MAX = 65504.0
# fp16's smallest normal number: the floor of a max-scaled norm's divisor, so a zero row
# divides by it (no 0 / 0) and a tiny row keeps full precision.
FP16_TINY = 2.0**-14
RMSNORM_FORMS = ("plain", "max_scaled")
KEY_BIAS_FORMS = ("plain", "rope_offset")
# A declared margin, not a derived one: the preflight sees a few windows, and an input it
# did not see may peak higher. Every mitigated peak must stay under FP16_MAX / HEADROOM.
HEADROOM = 4.0
# Quantities measured per layer, and model-wide ones. "norm_square" is the largest x * x a
# norm reading the residual stream forms; "branch_norm_square" that of the norms reading a
# branch (q, k, a sandwich layer's attention or FFN output), which alpha does not scale.
LAYER_QUANTITIES = ("residual", "attention_logits", "mlp_intermediate", "norm_square", "branch_norm_square")
MODEL_QUANTITIES = ("embedding", "final_norm_square", "logits")


class Fp16Unsafe(CmfdeployError):
    """A quantity overflows fp16 (or leaves no headroom) and no mitigation makes it safe."""

    def __init__(self, where: str, layer: int | None, quantity: str, value: float, reason: str):
        self.layer, self.quantity, self.value = layer, quantity, value
        at = "the model" if layer is None else f"layer {layer}"
        super().__init__(f"{where}: {at}: {quantity} peaks at {value:.6g}, {reason}")


class Fp16MitigationError(CmfdeployError):
    """A mitigations record that cannot be applied (unknown key, bad value)."""


def _power_of_two(value: float) -> bool:
    return value > 0 and math.frexp(value)[0] == 0.5


@dataclass(frozen=True)
class Fp16Mitigations:
    """What `mitigated_model` applies; the record a package's manifest carries."""

    residual_scale: float = 1.0  # alpha, a power of two <= 1
    rmsnorm: str = "plain"  # or "max_scaled"
    mask_value: float | None = None  # None: -inf
    headroom: float = field(default=HEADROOM, compare=False)  # the margin the choice kept
    key_bias: str = "plain"  # or "rope_offset"

    def __post_init__(self):
        if not (_power_of_two(self.residual_scale) and self.residual_scale <= 1.0):
            raise Fp16MitigationError(f"fp16 mitigations: residual_scale {self.residual_scale!r} is not a power of two "
                                      "<= 1 (only those scale the stream exactly)")
        if self.rmsnorm not in RMSNORM_FORMS:
            raise Fp16MitigationError(f"fp16 mitigations: rmsnorm {self.rmsnorm!r} is not one of {RMSNORM_FORMS}")
        if self.key_bias not in KEY_BIAS_FORMS:
            raise Fp16MitigationError(f"fp16 mitigations: key_bias {self.key_bias!r} is not one of {KEY_BIAS_FORMS}")
        if self.mask_value is not None and not (math.isfinite(self.mask_value) and -FP16_MAX <= self.mask_value < 0):
            raise Fp16MitigationError(f"fp16 mitigations: mask_value {self.mask_value!r} is not a finite negative "
                                      f"fp16 value (>= {-FP16_MAX})")

    @classmethod
    def none(cls) -> "Fp16Mitigations":
        return cls()

    @property
    def is_none(self) -> bool:
        return self == Fp16Mitigations()

    def to_record(self) -> dict:
        """The fields; `key_bias` only where it is not plain, so the records (and the gates'
        quality identities holding them) of every package converted before it existed stay
        what they were, and read back as they mean: plain."""
        record = asdict(self)
        if self.key_bias == "plain":
            del record["key_bias"]
        return record

    @classmethod
    def of_package(cls, manifest: dict, where: object) -> "Fp16Mitigations":
        """The mitigations an uncompressed fp16 package's conversion applied, as its manifest
        records them (`numerics.mitigations`; none recorded: none applied)."""
        record = manifest.get("numerics", {}).get("mitigations")
        return cls() if record is None else cls.from_record(record["record"], f"{where}: field 'numerics.mitigations.record'")

    @classmethod
    def from_record(cls, record: dict, where: str = "fp16 mitigations") -> "Fp16Mitigations":
        if not isinstance(record, dict):
            raise Fp16MitigationError(f"{where}: {record!r} is not an object")
        unknown = sorted(set(record) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise Fp16MitigationError(f"{where}: unknown key {unknown[0]!r} (known: "
                                      f"{', '.join(cls.__dataclass_fields__)})")
        return cls(**record)


# -- the mitigated decoder


class MaxScaledRMSNorm(RMSNorm):
    """RMSNorm over x / max|x| with the eps term scaled alike: the same function, no overflow
    (see the module docstring)."""

    def __init__(self, norm: RMSNorm):
        super().__init__(norm.weight.data, norm.eps, "gemma" if norm.offset else "qwen")
        self.root_eps = math.sqrt(norm.eps)
        self.floor = max(FP16_TINY, self.root_eps)

    def scaled(self, x):
        """(x / m, sqrt(eps) / m)."""
        m = x.abs().amax(-1, keepdim=True).clamp_min(self.floor)
        return x / m, self.root_eps / m

    def forward(self, x):
        y, t = self.scaled(x)
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + t * t) * _gain(self)


class RopeKeyOffset(nn.Module):
    """(R_pos - I) b for a key bias b [kv_heads * head_dim], per position: what the keys of a
    k_proj without its bias need added after RoPE (module docstring, `key_bias`). Its buffers
    stay float32 in the fp16 reference, as the RoPE angles do (`Fp16Reference`): the offset is
    positional and enters the fp16 path rounded once."""

    def __init__(self, bias: torch.Tensor, inv_freq: torch.Tensor, kv_heads: int, head_dim: int):
        super().__init__()
        self.half_dim = head_dim // 2
        self.register_buffer("bias", bias.detach().float().reshape(kv_heads, 1, head_dim).clone(), persistent=False)
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)

    def forward(self, positions):
        """[1, kv_heads, T, head_dim]. cos - 1 is written -2 sin^2(angle / 2): no cancellation
        where the angle is ~1e-6 rad, the low frequencies the large biases sit in."""
        freqs = positions[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        turned = rotate_half(self.bias, self.half_dim) * torch.sin(angles)
        return (self.bias * (-2 * torch.sin(angles / 2) ** 2) + turned)[None]


def _offset_key_bias(model: Decoder) -> None:
    """Move every attention's k bias past RoPE (`key_bias = "rope_offset"`)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.k_proj.bias is None:
            continue
        local = attn.sliding and model.sliding_inv_freq is not None
        attn.key_offset = RopeKeyOffset(attn.k_proj.bias, model.sliding_inv_freq if local else model.inv_freq,
                                        attn.kv_heads, attn.head_dim)
        attn.k_proj.bias = None  # the copy's own Linear: the source model keeps its bias


def squares(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The tensor a norm squares: x, or x / m for a max-scaled one."""
    return (norm.scaled(x)[0] if isinstance(norm, MaxScaledRMSNorm) else x).pow(2)


def _gain(norm: RMSNorm) -> torch.Tensor:
    """The multiplier the norm applies, computed as its forward computes it (float32)."""
    return norm.weight + 1.0 if norm.offset else norm.weight


def _set_gain(norm: RMSNorm, gain: torch.Tensor) -> None:
    norm.weight.data = gain
    norm.offset = False


def _scaled(tensor: torch.Tensor, alpha: float, scratch: ScratchFile) -> torch.Tensor:
    """tensor * alpha, made in a scratch file's map (pipeline.ground.scratch) rather than the
    process's memory: Gemma 3's scaled tied table alone is 671 MB."""
    out = torch.from_numpy(scratch.empty(tuple(tensor.shape), tensor.detach().numpy().dtype))
    return torch.mul(tensor, alpha, out=out)


def _scale_rows(linear, alpha: float, scratch: ScratchFile) -> None:
    linear.weight.data = _scaled(linear.weight.data, alpha, scratch)
    if linear.bias is not None:
        linear.bias.data = _scaled(linear.bias.data, alpha, scratch)


def _scale_ffn_output(mlp: nn.Module, alpha: float, scratch: ScratchFile) -> None:
    """Scale what an FFN adds: a dense FFN's down_proj, or every expert's (and the shared one's)."""
    if isinstance(mlp, GatedMLP):
        _scale_rows(mlp.down_proj, alpha, scratch)
        return
    for expert in [*mlp.experts, *([mlp.shared_expert] if mlp.shared_expert is not None else [])]:
        _scale_rows(expert.down_proj, alpha, scratch)


def _residual_norms(layer) -> list[RMSNorm]:
    """The norms of a layer that read the residual stream."""
    sandwich = layer.pre_feedforward_layernorm is not None
    return [layer.input_layernorm, layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm]


def moved_gains(model: Decoder) -> dict[str, tuple[RMSNorm, float]]:
    """The norms whose gains carry the residual scale: HF weight name -> (the norm, the power
    of alpha its gain is multiplied by). The final norm of a tied head (its head reads the
    scaled table), and in a sandwich layer the post-attention and post-FFN norms, which write
    into the stream. Each becomes a plain gain (`_set_gain`), which a package stores as it is."""
    names = {id(module): name for name, module in model.named_modules()}
    moved = [(model.model.norm, -1.0)] if model.lm_head is None else []
    for layer in model.model.layers:
        if layer.pre_feedforward_layernorm is not None:
            moved.append((layer.post_attention_layernorm, 1.0))
        if layer.post_feedforward_layernorm is not None:
            moved.append((layer.post_feedforward_layernorm, 1.0))
    return {f"{names[id(norm)]}.weight": (norm, power) for norm, power in moved}


def _scale_residual(model: Decoder, alpha: float, weights_scaled: bool, scratch: ScratchFile) -> None:
    for norm in [model.model.norm, *(n for layer in model.model.layers for n in _residual_norms(layer))]:
        norm.eps = norm.eps * alpha**2
    if weights_scaled:
        # The weights are a mitigated package's: its moved gains are the plain ones, alpha in them.
        for norm, _ in moved_gains(model).values():
            norm.offset = False
        return
    model.model.embed_tokens.weight.data = _scaled(model.model.embed_tokens.weight.data, alpha, scratch)
    for norm, power in moved_gains(model).values():
        _set_gain(norm, _gain(norm).detach() * alpha**power)
    for layer in model.model.layers:
        if layer.pre_feedforward_layernorm is None:
            _scale_rows(layer.self_attn.o_proj, alpha, scratch)
        if layer.post_feedforward_layernorm is None:
            _scale_ffn_output(layer.mlp, alpha, scratch)


def _norm_slots(model: Decoder):
    """(parent module, attribute name) of every RMSNorm in the decoder."""
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, RMSNorm):
                yield parent, name


def mitigated_model(model: Decoder, args: ModelArgs, mitigations: Fp16Mitigations,
                    weights_scaled: bool = False) -> Decoder:
    """A copy of `model` with `mitigations` applied: the same interface (forward,
    forward_cached, CachedStep traces it), the FP32 function kept (module docstring).
    `weights_scaled`: the weights already carry alpha (a mitigated package's own decoded
    weights, every one the residual scale changes among them: the moved gains as the plain
    gains the package stores, `moved_gains`): only the eps, the norm forms and the mask are
    applied.
    The residual scale and a finite mask change weights and constants only: the traced
    graph has the same op kinds. The max-scaled norm adds abs, a max reduction, the floor
    (clamp_min), the division and a reciprocal (sqrt(eps) / m) per norm; the key-bias offset
    a positional sub-graph (the angles, sin, pow, mul, add) and an add per layer with a k bias."""
    if model.args != args:
        raise Fp16MitigationError(f"mitigated_model: the args given are not the model's ({args.arch_name})")
    # The copy shares every weight it does not scale: each rescaling binds a new tensor to the
    # copy's own Parameter, never writes into one. So a mitigated model costs the weights it
    # scales (Gemma 3's tied table, 670 MB), not a second model (1.07 GB), and those lie in a
    # scratch file's map, not in the process's memory.
    safe = copy.deepcopy(model, memo={id(p): nn.Parameter(p.data, requires_grad=False) for p in model.parameters()})
    if mitigations.residual_scale != 1.0:
        _scale_residual(safe, mitigations.residual_scale, weights_scaled, ScratchFile())
    if mitigations.rmsnorm == "max_scaled":
        for parent, name in list(_norm_slots(safe)):
            setattr(parent, name, MaxScaledRMSNorm(getattr(parent, name)))
    if mitigations.mask_value is not None:
        for layer in safe.model.layers:
            layer.self_attn.mask_value = float(mitigations.mask_value)
    if mitigations.key_bias == "rope_offset":
        _offset_key_bias(safe)
    return safe.eval()


# -- the fp16 reference


class Fp16Reference(nn.Module):
    """`decoder` in float16 under the op-boundary model (module docstring), behind the
    Decoder's interface: float32 logits and K/V caches out (holding fp16 values, which
    float32 holds exactly), so `TorchBackend(..., cache_dtype=np.float16)` runs it as any
    reference. Position and RoPE-angle arithmetic stays float32 (the RoPE buffers are kept),
    and cos/sin enter the fp16 path rounded once (base.Decoder.hidden_with_cache_tensors)."""

    forward = Decoder.forward
    hidden = Decoder.hidden
    forward_cached = Decoder.forward_cached
    hidden_cached = Decoder.hidden_cached

    def __init__(self, decoder: Decoder):
        super().__init__()
        self.args = decoder.args
        # Parameters copied straight to fp16 (a float32 copy first would hold the model twice),
        # each held in a scratch file as it is made (pipeline.ground.scratch): no memory of the process.
        scratch = ScratchFile()
        halves = {id(p): nn.Parameter(torch.from_numpy(scratch.hold(p.detach().half().numpy())), requires_grad=False)
                  for p in decoder.parameters()}
        self.decoder = copy.deepcopy(decoder, memo=halves)
        offsets = {f"{owner}.{name}" for owner, module in self.decoder.named_modules()
                   if isinstance(module, RopeKeyOffset) for name, _ in module.named_buffers()}
        keep = {name: buffer for name, buffer in self.decoder.named_buffers()
                if name.endswith("inv_freq") or name in offsets}
        self.decoder.half()
        for name, buffer in keep.items():
            owner, _, attribute = name.rpartition(".")
            setattr(self.decoder.get_submodule(owner) if owner else self.decoder, attribute, buffer)
        self.eval()

    def _half(self, *tensors):
        return [t.to(torch.float16) for t in tensors]

    def _checked(self, logits):
        if logits.dtype != torch.float16:  # a float32 leak would silently make this an FP32 reference
            raise TypeError(f"fp16 reference: the {self.args.arch_name} decoder computed {logits.dtype} logits")
        return logits.float()

    def forward_with_cache_tensors(self, ids, position, key_cache, value_cache):
        logits, keys, values = self.decoder.forward_with_cache_tensors(ids, position, *self._half(key_cache, value_cache))
        return self._checked(logits), keys.float(), values.float()

    def forward_branches(self, suffixes, positions, key_caches, value_caches, last_only: bool = False):
        logits, keys, values = self.decoder.forward_branches(suffixes, positions, *self._half(key_caches, value_caches),
                                                             last_only=last_only)
        return [self._checked(rows) for rows in logits], keys.float(), values.float()

    def hidden_branches(self, suffixes, positions, key_caches, value_caches, last_only: bool = False):
        """The fp16 hidden rows (`logits_of` takes them) and the float32-held caches."""
        rows, keys, values = self.decoder.hidden_branches(suffixes, positions, *self._half(key_caches, value_caches),
                                                          last_only=last_only)
        return rows, keys.float(), values.float()

    def hidden_with_cache_tensors(self, ids, position, key_cache, value_cache, rows_apart: bool = False):
        hidden, keys, values = self.decoder.hidden_with_cache_tensors(ids, position, *self._half(key_cache, value_cache),
                                                                      rows_apart=rows_apart)
        return hidden, [k.float() for k in keys], [v.float() for v in values]

    def logits_of(self, hidden):
        return self._checked(self.decoder.logits_of(hidden))

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The decoder's weights in fp16, as this reference computes with them."""
        return self.decoder.named_weights()


def fp16_reference(model: Decoder) -> Fp16Reference:
    """The fp16 numerics an fp16 package intends for `model` (apply the same mitigations first)."""
    return Fp16Reference(model)


# -- the preflight measurement


def _per_token(x: torch.Tensor, axis: int) -> torch.Tensor:
    """max |x| per token position (float32; inf and NaN kept), without a copy of x."""
    x = x.detach().movedim(axis, 0)
    x = x.reshape(x.shape[0], -1)
    return torch.maximum(x.amax(-1), -x.amin(-1)).float()


class _Recorder:
    """Forward hooks that keep, per (layer, quantity), the peak over every window and where
    it was, and, per window, the first (layer, quantity) in forward order whose values are
    not finite (where fp16 broke) with the count of those it spread to."""

    def __init__(self, decoder: Decoder):
        self.peaks: dict[tuple, dict] = {}
        self.events: list[dict] = []
        self.window = ""
        self.handles = []
        hook = self._hook
        layers = decoder.model.layers
        self.handles.append(layers[0].register_forward_pre_hook(
            lambda module, args: hook(None, "embedding", args[0], 1)))
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_hook(
                partial(lambda i, module, args, out: hook(i, "residual", out[0], 1), i)))
            sandwich = layer.pre_feedforward_layernorm is not None
            mid = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
            self.handles.append(mid.register_forward_pre_hook(
                partial(lambda i, module, args: hook(i, "residual", args[0], 1), i)))
            residual_norms = set(map(id, _residual_norms(layer)))
            attn = layer.self_attn
            branch = [n for n in (attn.q_norm, attn.k_norm, layer.post_feedforward_layernorm) if n is not None]
            if sandwich:
                branch.append(layer.post_attention_layernorm)
            for norm in [*_residual_norms(layer), *branch]:
                quantity = "norm_square" if id(norm) in residual_norms else "branch_norm_square"
                self.handles.append(norm.register_forward_pre_hook(
                    partial(lambda i, q, module, args: hook(i, q, squares(module, args[0]), 1), i, quantity)))
            self.handles.append(attn.score_probe.register_forward_hook(
                partial(lambda i, module, args, out: hook(i, "attention_logits", out, 2), i)))
            for down in [m for m in layer.mlp.modules() if isinstance(m, GatedMLP)]:
                self.handles.append(down.down_proj.register_forward_pre_hook(
                    partial(lambda i, module, args: hook(i, "mlp_intermediate", args[0], 1), i)))
        self.handles.append(decoder.model.norm.register_forward_pre_hook(
            lambda module, args: hook(None, "final_norm_square", squares(module, args[0]), 1)))

    def _hook(self, layer: int | None, quantity: str, x: torch.Tensor, axis: int) -> None:
        self.record(layer, quantity, _per_token(x, axis))

    def record(self, layer: int | None, quantity: str, per_token: torch.Tensor) -> None:
        bad = ~torch.isfinite(per_token)
        if bool(bad.any()):
            # Past the first, the inf or NaN has spread: later events count, the first says where.
            if self.events and self.events[-1]["window"] == self.window:
                self.events[-1]["spread_to"] += 1
            else:
                self.events.append({"window": self.window, "layer": layer, "quantity": quantity,
                                    "position": int(bad.nonzero()[0, 0]), "value": str(float(per_token[bad][0])),
                                    "spread_to": 0})
        finite = torch.where(bad, torch.zeros_like(per_token), per_token)
        position = int(finite.argmax())
        peak = self.peaks.get((layer, quantity))
        if peak is None or float(finite[position]) > peak["value"]:
            self.peaks[(layer, quantity)] = {"value": float(finite[position]), "window": self.window,
                                             "position": position}

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


# The logits' peaks are taken a block of rows at a time: the longest window's whole logits are
# 1 GB on a 262k vocabulary (a float32 copy of the fp16 side's as well), for one number a row.
LOGITS_BLOCK_BYTES = 64 * 2**20


def _measure(model: nn.Module, decoder: Decoder, windows: dict[str, np.ndarray]) -> dict:
    recorder = _Recorder(decoder)
    try:
        with torch.no_grad():
            for name, ids in windows.items():
                recorder.window = name
                hidden = model.hidden(torch.as_tensor(np.asarray(ids, dtype=np.int64)))
                rows = max(1, LOGITS_BLOCK_BYTES // (4 * decoder.args.vocab_size))
                recorder.record(None, "logits", torch.cat([_per_token(model.logits_of(hidden[at:at + rows])[None], 1)
                                                           for at in range(0, len(hidden), rows)]))
    finally:
        recorder.close()
    args = decoder.args
    layers = [{"layer": i, **{q: recorder.peaks.get((i, q)) for q in LAYER_QUANTITIES}}
              for i in range(args.num_layers)]
    return {"layers": layers, "model": {q: recorder.peaks.get((None, q)) for q in MODEL_QUANTITIES},
            "nonfinite": recorder.events}


def preflight_findings(model: Decoder, args: ModelArgs, windows: dict[str, np.ndarray]) -> dict:
    """Per-layer abs-max peaks of `model` over `windows` (name -> token ids, BOS included
    where the model has one), in FP32 (the function) and in the fp16 reference of the same
    model (where it overflows: `nonfinite` lists, per window, the first (layer, quantity)
    in forward order with an inf or NaN, its first token position, and how many
    measured quantities after it were not finite either), and whether any attention adds a
    bias to its keys (`key_bias`, what `choose_mitigations` moves past RoPE). A peak is
    {value, window, position}; None where the quantity does not exist (a layer without
    q/k or sandwich norms has no branch_norm_square)."""
    if model.args != args:
        raise Fp16MitigationError(f"preflight: the args given are not the model's ({args.arch_name})")
    half = fp16_reference(model)
    return {"windows": {name: len(ids) for name, ids in windows.items()},
            "key_bias": any(layer.self_attn.k_proj.bias is not None for layer in model.model.layers),
            "fp32": _measure(model, model, windows), "fp16": _measure(half, half.decoder, windows)}


def _peaks(measured: dict):
    """(layer or None, quantity, peak) of every measured quantity."""
    for row in measured["layers"]:
        for quantity in LAYER_QUANTITIES:
            if row[quantity] is not None:
                yield row["layer"], quantity, row[quantity]
    for quantity in MODEL_QUANTITIES:
        if measured["model"][quantity] is not None:
            yield None, quantity, measured["model"][quantity]


def choose_mitigations(findings: dict, headroom: float = HEADROOM, where: str = "model") -> Fp16Mitigations:
    """The mitigations that bring every FP32 peak under FP16_MAX / headroom, or Fp16Unsafe
    naming the first quantity none of them can bring there.

    alpha is the largest power of two putting the residual stream (embedding included) under
    the limit; the norms reading it then square alpha * x, and the max-scaled form is chosen
    when one of those squares, or a branch norm's, would still pass the limit. q . k, the MLP
    intermediate and the logits read normed inputs, which alpha does not change: over the
    limit they are refused. A model whose keys have a bias gets it moved past RoPE
    (`key_bias = "rope_offset"`), for the scores' precision rather than their range and
    whatever the peaks: it keeps the function exactly (a constant per query row) and takes
    the term q . b, which sets the scores' fp16 step, out of them. Moved, q . b is out of the
    scores' range too, so their FP32 peak here (the unmitigated model's) no longer says whether
    they fit: `check_mitigated` judges the mitigated model's (Qwen2.5-Coder-1.5B's layer 0:
    144,167 plain, 1,146 moved)."""
    limit = FP16_MAX / headroom
    moved_key_bias = bool(findings.get("key_bias"))
    peaks = list(_peaks(findings["fp32"]))
    stream = max(p["value"] for _, q, p in peaks if q in ("residual", "embedding"))
    alpha = 1.0 if stream <= limit else 2.0 ** -math.ceil(math.log2(stream / limit))
    scaled = {"norm_square": alpha**2, "final_norm_square": alpha**2, "branch_norm_square": 1.0}
    norm_form = "plain"
    for layer, quantity, peak in peaks:
        if quantity in scaled and peak["value"] * scaled[quantity] > limit:
            norm_form = "max_scaled"
        elif quantity == "attention_logits" and moved_key_bias:
            continue
        elif quantity in ("attention_logits", "mlp_intermediate", "logits") and peak["value"] > limit:
            raise Fp16Unsafe(where, layer, quantity, peak["value"],
                             f"over fp16's {FP16_MAX:g} / headroom {headroom:g} = {limit:g} (window "
                             f"{peak['window']!r}, token {peak['position']}), and no mitigation here rescales it")
    return Fp16Mitigations(residual_scale=alpha, rmsnorm=norm_form, headroom=headroom,
                           key_bias="rope_offset" if moved_key_bias else "plain")


def check_mitigated(findings: dict, headroom: float = HEADROOM, where: str = "model") -> None:
    """Fp16Unsafe unless the fp16 forward of the mitigated model was finite everywhere and
    every peak stayed under FP16_MAX / headroom."""
    measured = findings["fp16"]
    if measured["nonfinite"]:
        first = measured["nonfinite"][0]
        raise Fp16Unsafe(where, first["layer"], first["quantity"], float(first["value"]),
                         f"in the mitigated fp16 forward (window {first['window']!r}, token {first['position']})")
    limit = FP16_MAX / headroom
    for layer, quantity, peak in _peaks(measured):
        if peak["value"] > limit:
            raise Fp16Unsafe(where, layer, quantity, peak["value"],
                             f"over {limit:g} in the mitigated fp16 forward (window {peak['window']!r}, "
                             f"token {peak['position']})")


__all__ = ["FP16_MAX", "Fp16Mitigations", "Fp16Reference", "Fp16Unsafe", "check_mitigated",
           "choose_mitigations", "fp16_reference", "mitigated_model", "preflight_findings"]


def mitigated_from_record(model: Decoder, args: ModelArgs, record: dict) -> Decoder:
    """`mitigated_model` from a manifest's or preflight report's mitigations record: the
    conversion's transform (`coreml.kinds.export.Conversion`, "module:function" with JSON)."""
    return mitigated_model(model, args, Fp16Mitigations.from_record(record, "mitigations record"))
