"""The chunk-KV package: tokens at an absolute position, the K/V cache passed in and out."""

import numpy as np

from coreml.kinds.base import PackageKind, register_kind


@register_kind
class ChunkKV(PackageKind):
    name = "chunk_kv"
    description = "Chunk-KV decoder: tokens at an absolute position, KV cache passed in and out as float32"
    cache_dtype = np.float32
