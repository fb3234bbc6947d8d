"""The stateless package: input_ids [1, T] -> logits over the whole sequence, one full forward."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from coreml.kinds.base import PackageKind, register_kind
from coreml.layout import enumerated_lengths

if TYPE_CHECKING:
    from torch import nn

    from coreml.kinds.export import Reference
    from manifests.identity import Manifest


@register_kind
class Stateless(PackageKind):
    name = "stateless"
    description = "Stateless decoder: input_ids -> logits over the whole sequence"
    steps = 3
    runner = None

    def graph(self, ref: Reference) -> nn.Module:
        """`input_ids [1,T]` -> `logits [1,T,vocab]` through the reference model's plain forward
        (`logits_0, ..` [1,T,part] each where the head is split)."""
        from torch import nn

        from coreml.kinds.export import traced_model

        class StatelessGraph(nn.Module):
            def __init__(self, model: nn.Module, vocab: int):
                super().__init__()
                self.model, self.vocab = model, vocab

            def forward(self, input_ids):
                return self.model(input_ids).reshape(1, -1, self.vocab)

        if ref.head_rows is not None:
            return traced_model(ref)  # its forward returns the parts, each [1, T, part]
        return StatelessGraph(ref.model, ref.args.vocab_size)

    def export(self, ref: Reference, package_dir: Path, step: Callable[[str], None]) -> Manifest:
        from coreml.kinds.export import (TRACE_LENGTH, example_ids, save_single, trace_module, check_stateless,
                                         traced_check_record)

        start = time.perf_counter()
        step("stateless: trace and check")
        traced = trace_module(self.graph(ref), (example_ids(ref.args.vocab_size, TRACE_LENGTH, 0),))
        checks = {"traced_vs_reference_max_abs": check_stateless(traced, ref), "tolerance": ref.tolerance}
        checks.update(traced_check_record(ref.precision))
        return save_single(ref, package_dir, step, traced, self.interface(ref), self.description, checks, start)

    def snippet(self, interface: dict) -> list[str]:
        lengths = enumerated_lengths(interface)
        if lengths is None:
            return ["out = model.predict(inputs)"]
        return [f"n = min(n for n in {list(lengths)} if n >= len(ids))  # the next enumerated length: right-pad to it",
                'inputs["input_ids"] = np.array([ids + [0] * (n - len(ids))], dtype=np.int32)  # any token id pads',
                "# a causal model's row i reads tokens 0..i only: the padding's rows are dropped, the others are exact",
                "out = {name: value[:, :len(ids)] for name, value in model.predict(inputs).items()}"]
