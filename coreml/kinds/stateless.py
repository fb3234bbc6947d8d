"""The stateless package: input_ids [1, T] -> logits over the whole sequence."""

from coreml.kinds.base import PackageKind, register_kind


@register_kind
class Stateless(PackageKind):
    name = "stateless"
    description = "Stateless decoder: input_ids -> logits over the whole sequence"
    cache_dtype = None
