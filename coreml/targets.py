"""Deployment targets, one registered unit each: what `survey --target` and `make TARGET=`
compress for, and what a release tells Core ML to run on.

    TARGETS["ane"].precision       # "fp16": the package precision the target's survey starts from
    TARGETS["ane"].claim           # "ane": the unit coreml.ane's static check must let a package claim
    TARGETS["ane"].compute_units   # "CPU_AND_NE": MLComputeUnits the release's snippet sets
    TARGETS["ane"].fallback        # "gpu": deployed for instead where no passing package claims "ane"

A target's survey compresses the package of its precision with the recipes asked, gates each,
and deploys only a package whose saved program can claim the target's unit (`coreml.ane`):
per-block scales, for one, are the GPU's and never deploy for the Neural Engine. Like the
precisions, this imports neither torch nor coremltools.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.ground.errors import CmfdeployError
from pipeline.ground.registry import Registry


class UnknownTarget(CmfdeployError):
    """A target no unit of coreml.targets registers."""


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    precision: str  # a unit of coreml.precisions
    claim: str  # "cpu" | "gpu" | "ane": what coreml.ane must let a deployed package claim
    compute_units: str  # MLComputeUnits name (coremltools' ct.ComputeUnit member)
    swift_compute_units: str  # MLModelConfiguration.computeUnits
    # The target a survey deploys for instead, saying why, where no passing package can claim this
    # one's unit: an fp16 package the Neural Engine refuses (a shape past its limits, a per-block
    # scale) still runs on the GPU.
    fallback: str | None = None


TARGETS: Registry[Target] = Registry("target", UnknownTarget)


def register_target(target: Target) -> Target:
    return TARGETS.add(target.name, target)


register_target(Target("cpu", "FP32 on the CPU (the reference numerics; no Neural Engine)", "fp32", "cpu", "CPU_ONLY",
                       ".cpuOnly"))
register_target(Target("gpu", "fp16 on the GPU (per-block int4 and palettes both run there)", "fp16", "gpu",
                       "CPU_AND_GPU", ".cpuAndGPU"))
register_target(Target("ane", "fp16 on the Neural Engine (palettes and per-channel scales; fixed or enumerated shapes; "
                       "the default, as apps ship)", "fp16", "ane", "CPU_AND_NE", ".cpuAndNeuralEngine", fallback="gpu"))


def target(name: str, where: object = "--target") -> Target:
    return TARGETS.lookup(name, where)


if __name__ == "__main__":  # the Makefile asks a target's precision: `python -m coreml.targets ane` -> fp16
    import sys

    try:
        print(target(sys.argv[1], "TARGET").precision)
    except UnknownTarget as error:
        sys.exit(f"UnknownTarget: {error}")
