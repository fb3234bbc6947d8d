"""The FP32 reference decoder behind the Backend protocol (`pipeline.ground.backend_protocol`).

    backend = TorchBackend(*load_reference("model.cmf")[:2])

It is the peer every runtime is compared with, so it lives with the reference model, below
the runtimes; `pipeline.stages.backends.open_backend` picks it for a CMF file or a bundle.
"""

import numpy as np
import torch

from pipeline.ground.backend_protocol import BackendError, validate_ids
from pipeline.ground.models import Decoder, KVCache, ModelArgs

# The torch cache is [layers, 1, kv, context, head_dim] and attention reads all of it, so the
# default stays far below the long contexts some models declare; `context=` raises it.
DEFAULT_TORCH_CONTEXT = 2048


class TorchBackend:
    """The FP32 reference decoder behind the Backend protocol.

    Snapshots are KVCaches whose tensors the model never writes in place, so holding one
    costs nothing and `extend` branches from it freely. With `chunk`, `logits` feeds the
    sequence through the cache `chunk` tokens at a time (the path a chunked package takes).
    """

    name = "torch-fp32"

    def __init__(self, model: Decoder, args: ModelArgs, context: int | None = None, chunk: int | None = None):
        self.model, self.args = model, args
        self.context = min(args.max_position_embeddings, DEFAULT_TORCH_CONTEXT) if context is None else context
        if chunk is not None and chunk < 1:
            raise BackendError(f"torch backend: chunk {chunk} must be at least 1")
        self.chunk = chunk

    def _ids(self, ids, offset: int = 0) -> torch.Tensor:
        ids = validate_ids(ids, self.name, self.args.vocab_size, self.context, offset)
        return torch.from_numpy(ids)

    @torch.no_grad()
    def logits(self, ids: np.ndarray) -> np.ndarray:
        tokens = self._ids(ids)
        if self.chunk is None:
            return self.model(tokens).numpy()
        cache = KVCache.empty(self.args, tokens.numel())
        return torch.cat([self.model.forward_cached(part, cache) for part in tokens.split(self.chunk)]).numpy()

    @torch.no_grad()
    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, KVCache]:
        cache = KVCache.empty(self.args, self.context)
        logits = self.model.forward_cached(self._ids(ids), cache)
        return logits.numpy(), cache.snapshot()

    def extend(self, snapshot: KVCache, ids: np.ndarray) -> np.ndarray:
        return self.advance(snapshot, ids)[0]

    def prefill_batch(self, prefixes: list[np.ndarray]) -> list[tuple[np.ndarray, KVCache]]:
        empty = KVCache.empty(self.args, self.context)
        return self._branches([(empty, ids) for ids in prefixes], last_only=True)

    def extend_batch(self, branches: list[tuple[KVCache, np.ndarray]]) -> list[np.ndarray]:
        return [logits for logits, _ in self._branches(branches)]

    @torch.no_grad()
    def _branches(self, branches: list[tuple[KVCache, np.ndarray]], last_only: bool = False
                  ) -> list[tuple[np.ndarray, KVCache]]:
        """`advance` of each (snapshot, ids) as one batch (`Decoder.forward_branches`)."""
        tokens = [self._ids(ids, snapshot.position) for snapshot, ids in branches]
        logits, keys, values = self.model.forward_branches(
            tokens, [snapshot.position for snapshot, _ in branches],
            torch.stack([snapshot.keys for snapshot, _ in branches]),
            torch.stack([snapshot.values for snapshot, _ in branches]), last_only=last_only)
        return [(rows.numpy(), KVCache(keys[i], values[i], snapshot.position + len(ids)))
                for i, (rows, (snapshot, ids)) in enumerate(zip(logits, branches))]

    @torch.no_grad()
    def advance(self, snapshot: KVCache, ids: np.ndarray) -> tuple[np.ndarray, KVCache]:
        branch = snapshot.snapshot()
        logits = self.model.forward_cached(self._ids(ids, snapshot.position), branch)
        return logits.numpy(), branch.snapshot()
