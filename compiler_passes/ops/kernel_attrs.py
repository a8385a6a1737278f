"""The attributes every kernel PrimFunc of ops/ carries, so that TVM's lowering leaves it as written.

GPU kernels are hand-scheduled (thread-bound: `tirx.is_scheduled`); all kernels are opaque
(`op_pattern` 8) so that FuseOps leaves them alone (dlight's Fallback cannot schedule a
gather-reduction, and a launch wrapper has nothing to fuse).

Programmatic dependent launch (PDL, sm_90+): every CUDA kernel of ops/ (the Triton ones and the
CUDA C++ ones) built for sm_90 or later starts by waiting for its producers (griddepcontrol.wait:
until the kernels before it in the stream have finished and their writes are visible; a no-op after
a launch that was not programmatic). With PDL on (the default), their launches take CUDA's
programmatic stream serialization (TVM's launch tag below), so that a kernel's blocks are scheduled
while the kernel before it drains rather than after it, inside CUDA graphs too. Builds for earlier
GPUs neither wait nor launch programmatically.
"""

from __future__ import annotations

import tvm

OPAQUE = 8  # relax OpPatternKind kOpaque
PDL = True  # launch ops/' CUDA kernels programmatically (above; docs/SGMV.md has its timing)
PDL_TAG = "tirx.use_programtic_dependent_launch"  # TVM's launch tag for it (TVM's spelling)
PDL_MIN_SM = 90  # the first compute capability with griddepcontrol


def sm_version(arch: str) -> int:
    """The compute capability of a CUDA arch name: "sm_90a" -> 90."""
    return int(arch.removeprefix("sm_").rstrip("af"))


def pdl_tags(arch: str) -> list[str]:
    """The launch tags PDL adds to the launches of a kernel built for `arch` (none while it is off
    or before sm_90)."""
    return [PDL_TAG] if PDL and sm_version(arch) >= PDL_MIN_SM else []


def is_gpu(target: tvm.target.Target) -> bool:
    return "gpu" in target.keys


def kernel_attrs(gpu: bool) -> dict:
    return {"tirx.is_scheduled": True, "op_pattern": OPAQUE} if gpu else {"op_pattern": OPAQUE}
