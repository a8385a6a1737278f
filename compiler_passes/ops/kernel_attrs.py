"""The attributes every kernel PrimFunc of ops/ carries, so that TVM's lowering leaves it as written.

GPU kernels are hand-scheduled (thread-bound: `tirx.is_scheduled`); all kernels are opaque
(`op_pattern` 8) so that FuseOps leaves them alone (dlight's Fallback cannot schedule a
gather-reduction, and a launch wrapper has nothing to fuse).
"""

from __future__ import annotations

import tvm

OPAQUE = 8  # relax OpPatternKind kOpaque


def is_gpu(target: tvm.target.Target) -> bool:
    return "gpu" in target.keys


def kernel_attrs(gpu: bool) -> dict:
    return {"tirx.is_scheduled": True, "op_pattern": OPAQUE} if gpu else {"op_pattern": OPAQUE}
