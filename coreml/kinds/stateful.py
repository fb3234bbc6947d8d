"""The stateful package: an fp16 K/V cache held as Core ML state, prefill and decode functions."""

import numpy as np

from coreml.kinds.base import PackageKind, register_kind


@register_kind
class Stateful(PackageKind):
    name = "stateful"
    description = ("Stateful decoder: fp16 KV cache as Core ML state; prefill (1..context tokens) "
                   "and decode (1 token)")
    cache_dtype = np.float16
