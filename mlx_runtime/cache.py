"""Preallocated KV cache with trim, snapshot and restore.

Keys and values live per layer in buffers [kv_heads, capacity, head_dim] that grow in
steps of `STEP` slots up to the model's context. Writes are functional (`mx.slice_update`
returns a new buffer, done in place by MLX when nothing else holds the old one), so a
snapshot is just the tuple of current buffers and never changes when the cache moves on:
the first write after a snapshot copies, later writes are in place again.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from pipeline.ground.models.errors import ContextOverflow

STEP = 256


@dataclass(frozen=True)
class Snapshot:
    keys: tuple[mx.array, ...]
    values: tuple[mx.array, ...]
    position: int
    context: int


class KVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, context: int, capacity: int = STEP):
        self.context = context
        self.position = 0
        capacity = min(max(capacity, 1), context)
        shape = (kv_heads, capacity, head_dim)
        self.keys = [mx.zeros(shape, mx.float32) for _ in range(num_layers)]
        self.values = [mx.zeros(shape, mx.float32) for _ in range(num_layers)]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values))

    def reserve(self, count: int) -> None:
        """Room for `count` more tokens: grows every buffer to a multiple of STEP, or refuses."""
        need = self.position + count
        if need > self.context:
            raise ContextOverflow(
                f"KV cache: {count} tokens at position {self.position} exceed the context of {self.context}"
            )
        if need <= self.capacity:
            return
        grown = min(self.context, -(-need // STEP) * STEP)
        pad = ((0, 0), (0, grown - self.capacity), (0, 0))
        self.keys = [mx.pad(k, pad) for k in self.keys]
        self.values = [mx.pad(v, pad) for v in self.values]

    def write(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store keys/values [kv_heads, T, head_dim] at the current position (after `reserve(T)`);
        returns every key and value held so far, [kv_heads, position + T, head_dim]."""
        start = mx.array([self.position])
        self.keys[layer] = mx.slice_update(self.keys[layer], keys, start, axes=(1,))
        self.values[layer] = mx.slice_update(self.values[layer], values, start, axes=(1,))
        end = self.position + keys.shape[1]
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def advance(self, count: int) -> None:
        self.position += count

    def trim(self, count: int) -> None:
        """Forget the last `count` tokens; their slots are overwritten by the next write."""
        self.position = max(0, self.position - count)

    def snapshot(self) -> Snapshot:
        return Snapshot(tuple(self.keys), tuple(self.values), self.position, self.context)

    @classmethod
    def restore(cls, snap: Snapshot) -> KVCache:
        cache = cls.__new__(cls)
        cache.context, cache.position = snap.context, snap.position
        cache.keys, cache.values = list(snap.keys), list(snap.values)
        return cache
