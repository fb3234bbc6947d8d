"""Bits per weight of a saved package, counted the way mlx-lm and Core ML report it: every
byte the program stores for the model's weights (quantized values, scales, offsets, LUTs,
and the weights left in FP32 or fp16, norms included) times 8, over the parameter count.

Bytes are read from the program itself: a value in the weight file counts its blob entry's
data size (`coreml.mil.loader.BlobStorage.entry`), an inline value its packed width."""

from pathlib import Path

import numpy as np

from coreml.decoded import hot_rows_of, weight_vars
from coreml.mil.loader import BlobStorage, blob_file, mil_dtype, program_spec
from coreml.split import program_views
from manifests.identity import load_manifest


class _StoredBytes:
    """Walks the default function's constants and constexpr ops back from a weight variable."""

    def __init__(self, mlpackage: Path):
        spec_path, model = program_spec(mlpackage)
        self.model_dir, self.where = spec_path.parent, str(spec_path)
        function = model.mlProgram.functions[model.description.defaultFunctionName or "main"]
        block = function.block_specializations[function.opset]
        self.producers = {out.name: op for op in block.operations for out in op.outputs}
        self.returned = dict(zip((f.name for f in model.description.output), block.outputs))
        self.files: dict[str, BlobStorage] = {}
        self.seen: set = set()

    def elements(self, var: str) -> int:
        tensor = self.producers[var].outputs[0].type.tensorType
        return int(np.prod([d.constant.size for d in tensor.dimensions]))

    def _value_bytes(self, value) -> int:
        dtype = mil_dtype(value.type.tensorType.dataType, self.where)
        if value.WhichOneof("value") == "blobFileValue":
            name, offset = value.blobFileValue.fileName, value.blobFileValue.offset
            if (name, offset) in self.seen:
                return 0
            self.seen.add((name, offset))
            if name not in self.files:
                self.files[name] = BlobStorage(blob_file(self.model_dir, name, self.where))
            return self.files[name].entry(offset, dtype).size
        count = int(np.prod([d.constant.size for d in value.type.tensorType.dimensions]))
        return -(-count * dtype.nbits // 8)

    def stored(self, var: str) -> int:
        """Bytes of every stored value `var` is computed from; each value counts once."""
        if var in self.seen:
            return 0
        self.seen.add(var)
        op = self.producers[var]
        total = sum(self._value_bytes(v) for k, v in op.attributes.items()
                    if k != "name" and v.type.WhichOneof("type") == "tensorType")
        for argument in op.inputs.values():
            for binding in argument.arguments:
                if binding.WhichOneof("binding") == "name":
                    total += self.stored(binding.name)
                elif binding.value.type.WhichOneof("type") == "tensorType":
                    total += self._value_bytes(binding.value)
        return total


def bits_per_weight(package_dir: str | Path) -> dict:
    """{"bits_per_weight", "weight_bytes", "parameters"} of the package at `package_dir`.

    A value stored once counts once, and a weight carried by several HF names (a tied
    embedding and head) is one tensor: the count is of what the program holds, a table's hot
    rows (their residual, slot map and ids) included, and a split head's parts: their bytes
    count, and their rows are parameters unless a constant carries the head's HF name already
    (a tied table its lookup reads beside them, in a split package's first piece).
    """
    stored = parameters = 0
    counted: set[tuple[str, ...]] = set()  # the HF names whose parameters are counted already
    views = program_views(load_manifest(Path(package_dir)))
    carried = {name for _, view in views for names in weight_vars(view).values() for name in names}
    # A split package's pieces store their own bytes, a tied table twice (the first's lookup, the
    # last's head): both count as stored, its parameters once.
    for name, manifest in views:
        walk = _StoredBytes(Path(package_dir) / name)
        for var, hf_names in weight_vars(manifest).items():
            parameters += 0 if hf_names in counted else walk.elements(var)
            counted.add(hf_names)
            stored += walk.stored(var)
        split = manifest["package"].get("head_split")
        for part in split["parts"] if split else ():
            weight = walk.producers[walk.returned[part["output"]]].inputs["weight"].arguments[0].name
            parameters += 0 if split["weight"] in carried else walk.elements(weight)
            stored += walk.stored(weight)
        for record in hot_rows_of(manifest).values():
            stored += sum(walk.stored(record[part]) for part in ("residual", "slot", "hot_ids"))
    return {"bits_per_weight": 8 * stored / parameters, "weight_bytes": stored, "parameters": parameters}
