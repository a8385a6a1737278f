"""What the stage-3 Triton kernels compile to, here (no GPU): PTX instruction counts per kernel,
tile variant and adapter row format, for the fused q|k|v linear (4096 inputs, three parts of 4096
outputs, max rank 64, float16, sm_90a). Counts are of the code, not of executions (a loop body
counts once). What docs/SGMV.md "int8 adapter rows" cites:

  python scripts/triton_ptx.py [--rows model,int8] [--variants small,large]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

# instruction classes: int-to-float and float conversions (cvt), shared-memory traffic, MMAs
COUNTS = {"cvt": r"\bcvt\.", "ld.shared.b8": r"ld\.shared\.b8", "ld.shared": r"ld\.shared", "ldmatrix": r"ldmatrix",
          "st.shared": r"st\.shared", "mma": r"\bmma\.sync|wgmma\.mma_async", "add.f16x2": r"add\.f16x2",
          "prmt": r"\bprmt\."}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="model,int8")
    ap.add_argument("--variants", default="small,large")
    ap.add_argument("--arch", default="sm_90a")
    a = ap.parse_args(argv)
    from mlc_lora.compiler_passes.ops import triton_build  # pylint: disable=import-outside-toplevel
    from mlc_lora.compiler_passes.ops.lora import sgmv_triton as ST  # pylint: disable=import-outside-toplevel

    mods, widths = (0, 1, 2), (4096, 4096, 4096)
    print("| kernel | variant | rows | " + " | ".join(COUNTS) + " |")
    print("|---" * (3 + len(COUNTS)) + "|")
    for kind in ("shrink", "expand"):
        for var in a.variants.split(","):
            for rows in a.rows.split(","):
                consts, _ = ST.constants(kind, var, 4096, mods, None if kind == "shrink" else widths, 64, 7, 256, 8,
                                         rows=rows)
                fn = ST.lora_shrink_kernel if kind == "shrink" else ST.lora_expand_kernel
                cfg = ST.VARIANTS[var]
                ptx = triton_build.compile_triton(fn, ST._signature(kind, "float16"), consts,  # pylint: disable=protected-access
                                                  cfg["num_warps"], a.arch, cfg["num_stages"]).asm["ptx"]
                print(f"| {kind} | {var} | {rows} | "
                      + " | ".join(str(len(re.findall(pat, ptx))) for pat in COUNTS.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
