"""Reserve columns beside each LoRA-targeted weight for the batch's B rows (the rank columns route).

Past FUSED_MAX_TOKENS the _fused functions' linears can let cuBLAS add the LoRA delta inside the
base product: with W stored as [W | B columns] (each output row followed by P x RANK_COLUMNS
inputs that hold, for the batch's adapters, that output's B entries) and x extended by each
token's scaled shrink [x | s], one GEMM over K + P x RANK_COLUMNS inputs gives x @ W.T + s @ B.T:
no expand, no second pass over y (ops/lora/linear_triton.py). That needs the weight's rows to have
the columns: this pass makes every such packed param (W, K + spare_columns(K, P)) in every function
(the rank columns, then zeros to a row length of a multiple of COLUMN_ALIGN), and
every existing use of it a strided_slice of its first K columns, which DispatchCublas and
LoraRewrite take as the whole weight read with its row stride (the GEMMs read the first K
columns: cublas_gemm's lda, the gemv kernel's and the one-kernel linear's row stride); anything
else would copy the slice. The compile writes the reserved columns as zeros.
"""

from __future__ import annotations

from typing import Sequence

import tvm

from .reserve_rank_rows import extra_rows, widen_weights


@tvm.transform.module_pass(opt_level=0, name="ReserveRankColumns")
class ReserveRankColumns:  # pylint: disable=too-few-public-methods
    """Widen the LoRA-targeted weights by their spare columns (ops/lora/linear_triton.spare_columns);
    their uses read strided slices of the first columns. `param_names`, `modules` (name, in, out) and
    `linears` as LoraRewrite takes them."""

    def __init__(self, *, param_names: Sequence[str], modules: Sequence[tuple[str, int, int]],
                 linears: dict[str, Sequence[tuple[str, int, int]]]):
        self.cols = {i: r for i, p in enumerate(param_names) if (r := extra_rows(p, modules, linears, axis=1))}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not self.cols:
            raise ValueError("ReserveRankColumns found no LoRA-targeted weight among the params")
        return widen_weights(mod, self.cols, axis=1)
