"""The rounding noise of a reference itself: its logits and written K/V against the same
decoder evaluated in float64, case by case. The float32 reference's, and the fp16 reference's
(`fp16.Fp16Reference`: its fp16 decoder, mitigations included, whose fp16 weights float64 holds
exactly), each against its own function.

A gate's a-priori bound (`numerics`) is a worst chain of roundings summed over every layer; on
a 30-layer model it sits three decades above what float32 arithmetic actually errs, so a
converter fault of 0.1% in one matrix passes it. The realized error of the reference is
measured instead: float64 carries 29 more bits, so |float32 − float64| is float32's own error
from the exact function to a relative 2^-29. The package is another float32 evaluation of the
same function, whose error is of the same size (`pipeline.stages.gates.exactness.noise_tolerances`
says by how much it may differ); the package never enters the measurement.

The float64 side never holds the model in float64 at once: each layer's weights are widened as
the layer runs and its float32 tensors put back after (the same objects, so a bundle's mapped
pages stay shared), and the head goes a block of its rows at a time. Its extra memory is one
layer in float64 and the activations, not 2x the weights (Gemma 3's would be 2.2 GB).
"""

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

# Bytes of the head's weight widened to float64 at a time.
HEAD_BLOCK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class RoundingNoise:
    """|float32 − float64| of one case: the logits' largest at each compared position, and the
    largest over every layer's written keys and values (the slots the case wrote)."""
    logit_rows: np.ndarray  # (positions,) float64
    cache: float
    largest_rows: np.ndarray  # (positions,) max |logit|: the scale one float32 step of a logit is taken from

    @property
    def logits(self) -> float:
        return float(self.logit_rows.max())

    @property
    def largest_logit(self) -> float:
        return float(self.largest_rows.max())


@contextmanager
def widened(modules: list[nn.Module]):
    """Within: each module's float32 and float16 parameters and buffers are float64 while its
    forward runs, and the tensors themselves again after it (exact both ways)."""
    def widen(module, _inputs):
        module._narrow = {}
        for name, tensor in [*module.named_parameters(recurse=True), *module.named_buffers(recurse=True)]:
            if tensor is not None and tensor.dtype in (torch.float32, torch.float16):
                owner, _, leaf = name.rpartition(".")
                holder = module.get_submodule(owner) if owner else module
                module._narrow[name] = (holder, leaf, tensor)
                widened_tensor = tensor.detach().double()
                if isinstance(tensor, nn.Parameter):
                    holder._parameters[leaf] = nn.Parameter(widened_tensor, requires_grad=False)
                else:
                    holder._buffers[leaf] = widened_tensor

    def narrow(module, _inputs, _output):
        for holder, leaf, tensor in module._narrow.values():
            (holder._parameters if isinstance(tensor, nn.Parameter) else holder._buffers)[leaf] = tensor
        del module._narrow

    handles = [h for m in modules for h in (m.register_forward_pre_hook(widen), m.register_forward_hook(narrow))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def rounding_noise(reference, ids: np.ndarray, prefix: int | None = None) -> RoundingNoise:
    """The noise of `reference` (a float32 `Decoder`, or an `Fp16Reference`) on one sequence `ids`
    from position 0, its logits compared position by position over the first `prefix` (all by
    default) and its caches over every slot written."""
    from pipeline.ground.models.base import KVCache, half_linear
    from pipeline.ground.models.fp16 import Fp16Reference

    decoder = reference.decoder if isinstance(reference, Fp16Reference) else reference
    tokens = torch.from_numpy(np.asarray(ids, np.int64)).reshape(1, -1)
    prefix = tokens.shape[1] if prefix is None else prefix
    start = torch.zeros(1, dtype=torch.int64)

    def run(model, dtype):
        cache = KVCache.empty(decoder.args, tokens.shape[1], dtype)
        hidden, keys, values = model.hidden_with_cache_tensors(tokens, start, cache.keys, cache.values)
        return hidden[0, :prefix], keys, values

    hidden, keys, values = run(reference, torch.float32)
    with widened([*decoder.model.layers, decoder.model.norm]):
        hidden64, keys64, values64 = run(decoder, torch.float64)
    cache = max(float((a.double() - b).abs().max()) for a, b in zip([*keys, *values], [*keys64, *values64]))
    del keys, values, keys64, values64
    weight, bias = decoder.head.weight, decoder.head.bias
    step = max(1, HEAD_BLOCK_BYTES // (8 * weight.shape[1]))
    logits, largest = torch.zeros(prefix, dtype=torch.float64), torch.zeros(prefix, dtype=torch.float64)
    for first in range(0, weight.shape[0], step):
        rows = slice(first, first + step)
        part = None if bias is None else bias[rows]
        # A block of the head's rows is the head's own op (`Linear`: fp16 operands summed in
        # float32 and rounded once), the same dot products in the order the noise is measured for.
        want = half_linear(hidden, weight[rows], part) if hidden.dtype == torch.float16 else \
            torch.nn.functional.linear(hidden, weight[rows], part)
        exact = torch.nn.functional.linear(hidden64, weight[rows].double(), None if part is None else part.double())
        logits = torch.maximum(logits, (want.double() - exact).abs().amax(-1))
        largest = torch.maximum(largest, want.abs().amax(-1).double())
    return RoundingNoise(logits.numpy(), cache, largest.numpy())
