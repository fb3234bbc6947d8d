"""Converter faults seeded into a correct package, each registered by name: the gates are shown
to catch them (tests/test_gate_faults.py, benchmarks/fault_bench.py).

A fault edits a copy of the package as a converter that wrote wrong numbers would leave it (a
weight, or a constant of the saved program) and then makes the copy's manifest consistent
again (its files' sha256), so the identity chain holds and only the gate's numerics can tell.
The bundle is copied along to where the package's relative source link expects it.

FP32 packages: a weight is found in the package's weight file by its float32 bytes, which must
occur exactly once. The program's constants are edited in every function (a stateful
package's prefill and decode alike), at the first op of each function that reads them: one
layer's, where each layer has its own.
"""

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.ground.errors import CmfdeployError


class FaultNotApplicable(CmfdeployError):
    """The fault cannot be seeded into this package (its weight or constant is not there once)."""


@dataclass(frozen=True)
class Fault:
    name: str
    what: str  # the converter mistake it stands for
    seed: Callable[[Path, Path, dict], str]  # (mlpackage, bundle, arch) -> where it was seeded


FAULTS: dict[str, Fault] = {}


def register_fault(name: str, what: str):
    def register(seed):
        FAULTS[name] = Fault(name, what, seed)
        return seed

    return register


def seeded_copy(package_dir: Path, bundle_dir: Path, out_dir: Path, fault: str) -> tuple[Path, str]:
    """`package_dir` copied to `out_dir` with `fault` seeded and its manifest made consistent again;
    (the copy, where the fault was seeded)."""
    from manifests.identity import MANIFEST_NAME, inventory, read_json, write_json

    if fault not in FAULTS:
        raise FaultNotApplicable(f"fault {fault!r} is not among {sorted(FAULTS)}")
    package_dir, out_dir = Path(package_dir), Path(out_dir)
    manifest = read_json(package_dir / MANIFEST_NAME)
    if manifest["package"].get("precision", "fp32") != "fp32":
        raise FaultNotApplicable(f"{package_dir}: faults are seeded into FP32 packages only "
                                 f"(this is {manifest['package'].get('precision')})")
    shutil.copytree(package_dir, out_dir)
    linked = Path(os.path.normpath(out_dir / manifest["source"]["relative_path"]))
    # A copy beside the package (the same depth under the same folder) links to the bundle itself.
    if not (linked.exists() and linked.samefile(bundle_dir)):
        shutil.copytree(bundle_dir, linked, dirs_exist_ok=True)
    arch = read_json(Path(bundle_dir) / "config.json")["arch"]
    # A split package's fault goes into the piece that holds the middle layer, the one each fault edits.
    middle, pieces = _middle_layer(arch), manifest["package"].get("pieces")
    name = "model.mlpackage" if pieces is None else next(
        p["name"] for p in pieces if p["piece"]["layers"][0] <= middle < p["piece"]["layers"][1])
    where = FAULTS[fault].seed(out_dir / name, Path(bundle_dir), arch)
    manifest["files"] = inventory(out_dir)
    write_json(out_dir / MANIFEST_NAME, manifest)
    return out_dir, where


# ------------------------------------------------------------------ weights

def _bundle_tensor(bundle: Path, name: str) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(bundle / "weights.safetensors", framework="numpy") as weights:
        return weights.get_tensor(name).astype(np.float32)


def _replace_weight(mlpackage: Path, right: np.ndarray, wrong: np.ndarray, name: str) -> None:
    blob = next(mlpackage.rglob("weight.bin"))
    data = blob.read_bytes()
    found = data.count(right.tobytes())
    if found != 1:
        raise FaultNotApplicable(f"{blob}: {name}'s float32 bytes occur {found} times, not once")
    blob.write_bytes(data.replace(right.tobytes(), wrong.astype(np.float32).tobytes()))


def _middle_layer(arch: dict) -> int:
    return arch["num_layers"] // 2


@register_fault("matrix_scale", "one matrix written 0.1% too large (one layer's down_proj x (1 + 1e-3))")
def _matrix_scale(mlpackage: Path, bundle: Path, arch: dict) -> str:
    name = f"model.layers.{_middle_layer(arch)}.mlp.down_proj.weight"
    right = _bundle_tensor(bundle, name)
    _replace_weight(mlpackage, right, right * np.float32(1 + 1e-3), name)
    return name


@register_fault("norm_rows_swapped", "two entries of a norm's weight swapped (the largest and the smallest)")
def _norm_rows_swapped(mlpackage: Path, bundle: Path, arch: dict) -> str:
    name = f"model.layers.{_middle_layer(arch)}.input_layernorm.weight"
    right = _bundle_tensor(bundle, name)
    wrong = right.copy()
    low, high = int(np.argmin(right)), int(np.argmax(right))
    wrong[[low, high]] = wrong[[high, low]]
    _replace_weight(mlpackage, right, wrong, name)
    return f"{name}[{low}] <-> [{high}]"


@register_fault("kv_heads_swapped", "two K/V heads of one layer swapped (k_proj's and v_proj's rows)")
def _kv_heads_swapped(mlpackage: Path, bundle: Path, arch: dict) -> str:
    if arch["num_kv_heads"] < 2:
        raise FaultNotApplicable(f"{bundle}: one K/V head, none to swap")
    layer, dim = _middle_layer(arch), arch["head_dim"]
    for part in ("k_proj", "v_proj"):
        name = f"model.layers.{layer}.self_attn.{part}.weight"
        right = _bundle_tensor(bundle, name)
        wrong = np.concatenate([right[dim:2 * dim], right[:dim], right[2 * dim:]])
        _replace_weight(mlpackage, right, wrong, name)
    return f"layer {layer}: K/V heads 0 and 1"


# ------------------------------------------------------------------ program constants

def _scale_constant(mlpackage: Path, value: float, factor: float, what: str) -> str:
    """The scalar float constant `value` read by the first op of each function that reads it,
    times `factor`, in the saved program."""
    from coreml.mil.loader import program_spec

    spec_path, model = program_spec(mlpackage)
    edited = []
    for function_name, function in model.mlProgram.functions.items():
        ops = function.block_specializations[function.opset].operations
        scalars = {}
        for op in ops:
            val = op.attributes["val"] if op.type == "const" and "val" in op.attributes else None
            if val is not None and val.WhichOneof("value") == "immediateValue":
                floats = val.immediateValue.tensor.floats.values
                if len(floats) == 1 and np.isclose(floats[0], value, rtol=1e-6, atol=0):
                    scalars[op.outputs[0].name] = floats
        reader = next((op for op in ops if op.type != "const" and any(
            a.name in scalars for arg in op.inputs.values() for a in arg.arguments)), None)
        if reader is None:
            continue
        const = next(a.name for arg in reader.inputs.values() for a in arg.arguments if a.name in scalars)
        scalars[const][0] = float(np.float32(scalars[const][0] * factor))
        edited.append(f"{function_name}: {const} (read by {reader.type} -> {reader.outputs[0].name})")
    if not edited:
        raise FaultNotApplicable(f"{spec_path}: no op reads {what} {value:g}")
    spec_path.write_bytes(model.SerializeToString())
    return "; ".join(edited)


@register_fault("attention_scale", "one layer's attention scale x 1.01")
def _attention_scale(mlpackage: Path, bundle: Path, arch: dict) -> str:
    scalar = arch.get("query_pre_attn_scalar") or arch["head_dim"]
    return _scale_constant(mlpackage, float(np.float32(scalar ** -0.5)), 1.01, "the attention scale")


@register_fault("rmsnorm_eps", "one RMSNorm's epsilon x 100")
def _rmsnorm_eps(mlpackage: Path, bundle: Path, arch: dict) -> str:
    return _scale_constant(mlpackage, float(np.float32(arch["rms_norm_eps"])), 100.0, "RMSNorm's epsilon")
