"""What calibration-aware recipes measure on calibration text, through the reference model.

    calib = Calibration.from_package(package_dir, manifest, calibration_ids)
    kl = calib.kl_with({"model.layers.3.mlp.up_proj.weight": w_hat})

The reference model is the package's own upstream (pipeline.ground.reference.load_reference on
the bundle the package was converted from), so a measured error is the error of exactly
the weights the package holds. An fp16 package's is that model with the mitigations its
conversion applied (`pipeline.ground.models.fp16.mitigated_model`, computing in float32), and
its weights are read rounded to fp16 (`Calibration.weight`): the package's own constants, bit
for bit, which a code made from them must equal (`coreml.recipes.base.carried`). Calibration
ids come from `pipeline.ground.text_roles` (`text_roles(lines)["calibration"]`, tokenized),
never from the quality text.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from coreml import codes
from coreml.cache import ResultCache, content_key
from manifests.chain import upstream_path
from pipeline.ground.backend_protocol import kl_rows_against, log_softmax
from pipeline.ground.reference import load_reference
from pipeline.ground.scratch import ScratchFile

# Tokens per calibration window and windows measured:
# 2 x 128 tokens keep one sensitivity forward per (layer, option) at a fraction of a second
# for a 135M model on one core (about a second for Gemma 3 270M, whose head is 262k wide).
WINDOW = 128
WINDOWS = 2
# GPTQ's Hessians take one forward in all: 128 windows give 16384 samples, eight times the
# widest input (2048 on Gemma 3, 1536 on SmolLM2) has dimensions. At 16 windows (2048 samples,
# X^T X barely full rank on Gemma 3's down_proj) GPTQ fitted the calibration text, not the
# model: its layers coded per 32 (4-bit zero points) cost +9.2% perplexity on held-out text, +7.7% at 128
# (docs/COMPRESSION.md); the text has about 370 windows.
HESSIAN_WINDOWS = 128


def logits_with(model: torch.nn.Module, original: dict[str, torch.Tensor], windows: list[np.ndarray],
                weights: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Logits of each window with `weights` (HF names) swapped in, the originals put back.

    Swapped by assignment, never copied into the model's tensors: those are the pages of the
    bundle's map (`pipeline.ground.reference.load_reference`), which a copy would make private,
    one weight at a time, until the process held the whole model twice."""
    model.load_state_dict({n: torch.from_numpy(np.ascontiguousarray(w, np.float32)) for n, w in weights.items()},
                          strict=False, assign=True)
    try:
        with torch.no_grad():
            return [model(torch.as_tensor(w)).numpy() for w in windows]
    finally:
        model.load_state_dict({n: original[n] for n in weights}, strict=False, assign=True)


@dataclass
class Calibration:
    model: torch.nn.Module
    windows: list[np.ndarray]
    original: dict[str, torch.Tensor]
    hessians: dict[str, np.ndarray] | None = None
    # The whole calibration text and the BOS its windows open with (`row_counts` reads them).
    text_ids: np.ndarray | None = None
    bos_id: int | None = None
    # Where Hessians and codes measured on these windows are shared (`coreml.cache`), and the
    # identity of the model's weights they are measured on (its bundle manifest's sha256).
    cache: ResultCache | None = None
    weights_identity: str | None = None
    # The float dtype the package stores its weights in, where narrower than the model's (fp16).
    weight_dtype: type[np.floating] | None = None
    _reference: list[tuple[np.ndarray, np.ndarray]] | None = None

    @property
    def reference(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The model's own next-token distribution on each of the first WINDOWS windows, which
        `kl_with` compares with, as `kl_rows_against` reads it: (probabilities, Σ p log p per
        row), made when first asked for (GPTQ never asks; on Gemma 3 they are 268 MB a window)."""
        if self._reference is None:
            self._reference = []
            for logits in logits_with(self.model, self.original, self.windows[:WINDOWS], {}):
                log_p = log_softmax(logits)
                p = np.exp(log_p)
                self._reference.append((p, np.einsum("...v,...v->...", p, log_p)))
        return self._reference

    @classmethod
    def from_package(cls, package_dir: Path, manifest: dict, calibration_ids: np.ndarray,
                     count: int = WINDOWS, cache: ResultCache | None = None) -> "Calibration":
        """`count` windows of WINDOW tokens, each opened by the model's BOS when it has one
        (`special_tokens.bos_token_id`), as the quality gate's windows are: a model trained
        with BOS first (Gemma) is measured on the inputs it will be judged on. `cache`: where
        its Hessians and codes are shared with other recipes' (`coreml.cache`)."""
        from coreml.precisions import package_precision

        model, args, _ = load_reference(upstream_path(package_dir, manifest["source"]))
        identity, weight_dtype = manifest["source"]["manifest_sha256"], None
        if package_precision(manifest["package"], package_dir).compute_precision == "float16":
            from pipeline.ground.models.fp16 import Fp16Mitigations, mitigated_model

            mitigations = Fp16Mitigations.of_package(manifest, package_dir)
            model = mitigated_model(model, args, mitigations)
            identity = content_key("fp16 package weights", identity, mitigations.to_record())
            weight_dtype = np.float16
        calib = cls.of_model(model.eval(), calibration_ids, count, manifest["special_tokens"]["bos_token_id"])
        calib.cache, calib.weights_identity, calib.weight_dtype = cache, identity, weight_dtype
        return calib

    def cached_code(self, make: Callable[[], object], *inputs) -> object:
        """The code `make()` gives, computed from `inputs` (arrays and parameters, as
        `coreml.cache.content_key` takes them), from the cache when one is shared."""
        if self.cache is None:
            return make()
        arrays, record = self.cache.arrays(content_key("code", *inputs), lambda: codes.code_arrays(make()))
        return codes.code_from_arrays(arrays, record)

    @classmethod
    def of_model(cls, model: torch.nn.Module, calibration_ids: np.ndarray, count: int = WINDOWS,
                 bos_id: int | None = None, original: dict[str, torch.Tensor] | None = None) -> "Calibration":
        """`count` windows of WINDOW tokens of `calibration_ids` (BOS first when `bos_id` is
        given); `original`: the tensors `kl_with` puts back (default: the model's own, which it
        never writes)."""
        ids = np.asarray(calibration_ids, dtype=np.int64)
        text = WINDOW - (bos_id is not None)
        parts = [ids[i * text:(i + 1) * text] for i in range(count)]
        windows = [np.concatenate([[bos_id], part]).astype(np.int64) if bos_id is not None else part
                   for part in parts if len(part) > 1]
        if original is None:
            original = dict(model.state_dict(keep_vars=True))
        return cls(model, windows, original, text_ids=ids, bos_id=bos_id)

    def row_counts(self, rows: int) -> np.ndarray:
        """How often each of `rows` embedding rows is read over the whole calibration text, cut
        into windows as the calibration windows are (each opened by BOS, when the model has one)."""
        counts = np.bincount(self.text_ids, minlength=rows)[:rows].astype(np.int64)
        if self.bos_id is not None:
            counts[self.bos_id] += -(-len(self.text_ids) // (WINDOW - 1))
        return counts

    def kl_with(self, weights: dict[str, np.ndarray]) -> float:
        """Mean KL(reference || model with `weights` substituted) per token over the first
        WINDOWS windows (a Hessian calibration has more; its logits are not kept)."""
        got = logits_with(self.model, self.original, self.windows[:WINDOWS], weights)
        kl = [kl_rows_against(p, p_log_p, logits).mean() for (p, p_log_p), logits in zip(self.reference, got)]
        return float(np.mean(kl))

    def weight(self, name: str) -> np.ndarray:
        """The model's tensor `name` as the package stores it (float32 values)."""
        value = self.original[name].detach().numpy()
        return value if self.weight_dtype is None else value.astype(self.weight_dtype).astype(np.float32)

    def input_moments(self) -> dict[str, np.ndarray]:
        """Weight name -> E[x_j^2] per input column of the linear it feeds, over the windows.

        For a linear y = W x the output error of a perturbation E is sum_j E[x_j^2] |E_:j|^2
        when the inputs' cross terms are dropped (the diagonal the SKM/AWQ literature uses),
        so these moments weight a weight's error by what it does to the outputs. The tied
        embedding gets its head use's moments (its lookup has no input to weight by).
        """
        return self._input_statistics(lambda x: (x * x).sum(0))

    def input_hessians(self) -> dict[str, np.ndarray]:
        """Weight name -> E[x x^T] over the inputs of the linear it feeds (GPTQ's Hessian of
        the output error, cross terms kept), float64 [in, in]; the tied embedding's is its
        head use's. Gathered once per calibration (every GPTQ option of `mixed` reads them)."""
        if self.hessians is None:
            if self.cache is None or self.weights_identity is None:
                self.hessians = self._input_statistics(lambda x: x.T @ x)
            else:
                key = content_key("input_hessians", self.weights_identity, *self.windows)
                self.hessians, _ = self.cache.arrays(key, lambda: (self._input_statistics(lambda x: x.T @ x), {}))
        return self.hessians

    def _input_statistics(self, statistic) -> dict[str, np.ndarray]:
        """Weight name -> the mean over input rows x [rows, in] of every Linear's `statistic(x)`
        (float64), summed per call, over one forward of the windows."""
        from pipeline.ground.models.base import Linear

        # The sums live in a scratch file's map (pipeline.ground.scratch), added to in place:
        # Gemma 3's Hessians are 1 GB of float64, which GPTQ reads while coremltools holds its
        # own copy of the program, and the process's memory need not hold both.
        scratch = ScratchFile()
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}

        # Each window's statistic is a float32 product of its WINDOW rows, summed over windows in
        # float64. A float32 sum of n products errs by at most γ_n = n·u/(1 - n·u) of the sum of
        # their magnitudes (u = 2^-24; 7.6e-6 at n = 128): far below GPTQ's damping, 1% of the
        # mean diagonal, at half a float64 product's cost (on Gemma 3 the float64 Hessians were
        # 86 s of a first GPTQ recipe's 210 s). Linears that read one tensor (q, k and v; gate
        # and up) share its statistic: the hooks see the same tensor one after the other.
        last = {}

        def record(name: str, x: torch.Tensor) -> None:
            if last.get("input") is not x:
                rows = x.detach().reshape(-1, x.shape[-1]).float()
                last.update(input=x, statistic=statistic(rows).double(), rows=rows.shape[0])
            if name in sums:
                sums[name] += last["statistic"]
            else:
                sums[name] = torch.from_numpy(scratch.hold(last["statistic"].numpy()))
            counts[name] = counts.get(name, 0) + last["rows"]

        head = self.model.head
        hooks = [module.register_forward_hook(lambda _module, args, _output, name=f"{module_name}.weight":
                                              record(name, args[0]))
                 for module_name, module in self.model.named_modules() if isinstance(module, Linear) and module is not head]
        try:
            with torch.no_grad():
                for window in self.windows:
                    # The head's inputs are the final hidden states, recorded as they are: its
                    # logits, which nothing reads, are not computed (62% of Gemma 3's forward).
                    record(self.model.head_name, self.model.hidden(torch.as_tensor(window)))
        finally:
            for hook in hooks:
                hook.remove()
        return {name: sums[name].div_(counts[name]).numpy() for name in sums}
