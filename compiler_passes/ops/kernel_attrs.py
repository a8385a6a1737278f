"""The attributes every kernel PrimFunc of ops/ carries, so that TVM's lowering leaves it as written.

GPU kernels are hand-scheduled (thread-bound: `tirx.is_scheduled`); all kernels are opaque
(`op_pattern` 8) so that FuseOps leaves them alone (dlight's Fallback cannot schedule a
gather-reduction, and a launch wrapper has nothing to fuse).

Programmatic dependent launch (PDL, sm_90+): every CUDA kernel of ops/ (the Triton ones and the
CUDA C++ ones) starts by waiting for its producers (griddepcontrol.wait: until the kernels before
it in the stream have finished and their writes are visible; a no-op after a launch that was not
programmatic). With PDL on, their launches take CUDA's programmatic stream serialization (TVM's
launch tag below), so that a kernel's blocks are scheduled while the kernel before it drains
rather than after it, inside CUDA graphs too.
"""

from __future__ import annotations

import tvm

OPAQUE = 8  # relax OpPatternKind kOpaque
PDL = False  # launch ops/' CUDA kernels programmatically (above); off until timed
PDL_TAG = "tirx.use_programtic_dependent_launch"  # TVM's launch tag for it (TVM's spelling)


def pdl_tags() -> list[str]:
    """The launch tags PDL adds to a kernel's (none while it is off)."""
    return [PDL_TAG] if PDL else []


def is_gpu(target: tvm.target.Target) -> bool:
    return "gpu" in target.keys


def kernel_attrs(gpu: bool) -> dict:
    return {"tirx.is_scheduled": True, "op_pattern": OPAQUE} if gpu else {"op_pattern": OPAQUE}
