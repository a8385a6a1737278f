"""Decode under CUDA graphs with LoRA (sgmv): the LoRA kernels are captured with the base GEMMs,
and what a captured graph depends on is the batch size only once the runner fixes the slot count.

Read from the lowered IR (RewriteCUDAGraph's output), like test_dispatch_cublas's capture test; the
runner's side (fixed-address tables at a fixed slot count) is tests/python/lora/test_graph_tables.py.
"""

import dataclasses

import pytest
import tvm
from tvm import relax

from mlc_lora.compile import _decode_graph_attrs, export_model, lora_pass_options, prepare_cuda_build
from mlc_lora.compiler_passes import get_pipeline
from mlc_lora.compiler_passes.ops.lora import linear_triton as LT
from mlc_lora.compiler_passes.passes import LoraRewrite
from mlc_lora.contract import BASE_FUNCTION_SUFFIX, FILL_COLUMNS_FUNCTION, FUSED_FUNCTION_SUFFIX, LORA_TABLE_INPUTS
from mlc_lora.lora.layout import make_spec
from mlc_lora.models import llama

from ..conftest import needs_nvcc

pytestmark = needs_nvcc  # the CUDA sgmv and gemv kernels are built at compile time

TABLES = LORA_TABLE_INPUTS


def _lowered(layers=2, fused=False, rank_rows=False, spare_columns=False, add_norm=False):
    prepare_cuda_build()
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    cfg = llama.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=layers, vocab_size=80,
                            prefill_chunk_size=64, max_batch_size=4)
    mod, names = export_model(llama, cfg, "float16", cuda)
    spec = make_spec(cfg, 8, 64, None, "sgmv")
    if fused:
        spec = dataclasses.replace(spec, fused={"rank_columns": 32, "slot_columns": 16, "rank_rows": rank_rows,
                                                "spare_columns": spare_columns})
    lora = lora_pass_options(spec, cfg, llama, names)
    mod = _decode_graph_attrs(mod, 4)
    with cuda, tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
        return cfg, get_pipeline(cuda, lora=lora, rank_rows=rank_rows, spare_columns=spare_columns,
                                 add_norm=add_norm)(mod)


def _calls(func, prefix):
    """Names of the PrimFuncs `func` calls whose name starts with `prefix`."""
    out = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, relax.GlobalVar) and e.op.name_hint.startswith(prefix):
            out.append(e.op.name_hint)

    relax.analysis.post_order_visit(func.body, visit)
    return out


def test_decode_graphs_capture_the_sgmv_kernels():
    cfg, lowered = _lowered()
    captures = {gv.name_hint: f for gv, f in lowered.functions_items()
                if gv.name_hint.startswith("decode_cuda_graph_capture")}
    assert captures, "decode was not captured"
    inside = [c for f in captures.values() for c in _calls(f, "lora_sgmv_")]
    # one shrink + one in-place expand per fused linear (qkv, o, gate_up, down: all 7 modules) in
    # every layer, and the batch's tile table laid out once for all of them, all inside the graphs
    assert len(inside) == 2 * 4 * cfg.num_hidden_layers + 1
    assert sum("expand" in c for c in inside) == 4 * cfg.num_hidden_layers
    assert sum("tiles" in c for c in inside) == 1
    assert not _calls(lowered["decode"], "lora_sgmv_")
    # the decode without adapters is captured too, and runs no LoRA kernel at all
    base = "decode" + BASE_FUNCTION_SUFFIX
    base_captures = [f for gv, f in lowered.functions_items() if gv.name_hint.startswith(base + "_cuda_graph_capture")]
    assert base_captures and not [c for f in base_captures for c in _calls(f, "lora_")]
    assert "lora_arena" not in [p.name for p in lowered[base].params]
    # the base linears (gemv / cuBLAS wrappers) stay captured too: the LoRA deltas do not split the
    # layers' graphs
    assert sum(len(_calls(f, "mlc_lora_linear_")) for f in captures.values()) == 4 * cfg.num_hidden_layers + 1
    assert not _calls(lowered["decode"], "mlc_lora_linear_")
    # decode: the KV-cache attention call of each layer stays outside, between graph launches
    script = lowered["decode"].script()
    assert script.count("vm.builtin.cuda_graph.run_or_capture") <= 2 * cfg.num_hidden_layers + 1


def test_captured_graphs_read_the_tables_as_fixed_inputs_keyed_by_sizes_only():
    """The tables are passed into the captured functions (their addresses are baked into the
    graph), and a graph is keyed only by symbolic sizes: batch_size, the arena size and the slot
    count; no adapter data, offsets or ranks decide which graph runs."""
    _, lowered = _lowered(layers=1)
    decode = lowered["decode"]
    # the tables come right after the KV cache; decode's num_input stops before them
    names = [p.name for p in decode.params]
    assert names[2:2 + len(TABLES)] == list(TABLES)
    assert int(decode.attrs["num_input"]) == 2
    used = set()
    for gv, f in lowered.functions_items():
        if not gv.name_hint.startswith("decode_cuda_graph_capture"):
            continue
        params = [p.name for p in f.params]
        if _calls(f, "lora_sgmv_"):
            used |= {t for t in TABLES if t in params}
        key = f.params[-1]
        assert key.name == "shape_expr"
        assert {v.name for v in key.ty.values} <= {"batch_size", "lora_slots", "lora_arena_elems",
                                                   "lora_slot_capacity_plus_one"}
    # (the default sgmv, the Triton kernels, tiles the tokens in the pool's sorted order by each
    # slot's start in it: the per-token slot is left to the other stages and the fused functions)
    assert used == set(TABLES) - {"lora_token_slot"}


def test_prefill_keeps_the_tables_as_inputs():
    """Prefill is not captured: its tables stay per-call inputs (num_input counts them)."""
    prepare_cuda_build()
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}, host="llvm")
    cfg = llama.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=1, vocab_size=80,
                            prefill_chunk_size=64, max_batch_size=4)
    mod, names = export_model(llama, cfg, "float16", cuda)
    lora = lora_pass_options(make_spec(cfg, 8, 64, None, "sgmv"), cfg, llama, names)
    mod = _decode_graph_attrs(mod, 4)
    out = LoraRewrite(target=cuda, **lora)(mod)
    assert int(out["prefill"].attrs["num_input"]) == 3 + len(TABLES)
    assert int(out["decode"].attrs["num_input"]) == 2


def test_fused_functions_are_one_kernel_call_per_linear_decode_in_graphs():
    """decode_fused: every target linear is one call of the fused linear (base GEMM + delta),
    inside the graphs; no cuBLAS/gemv call and no sgmv kernel is left for them (the lm_head keeps
    its GEMM); prefill_fused the same. Both run the activation kernel (DispatchActivation) on
    gate|up's output, as decode does."""
    pytest.importorskip("triton")
    cfg, lowered = _lowered(fused=True)
    fused = "decode" + FUSED_FUNCTION_SUFFIX
    captures = [f for gv, f in lowered.functions_items() if gv.name_hint.startswith(fused + "_cuda_graph_capture")]
    assert captures, "decode_fused was not captured"
    inside = [c for f in captures for c in _calls(f, "lora_linear_triton_")]
    assert len(inside) == 4 * cfg.num_hidden_layers
    assert len([c for f in captures for c in _calls(f, "silu_mul_triton_96_float16")]) == cfg.num_hidden_layers
    assert not [c for f in captures for c in _calls(f, "fused_split")]
    assert not [c for f in captures for c in _calls(f, "lora_sgmv_")]
    assert sum(len(_calls(f, "mlc_lora_linear_")) for f in captures) == 1  # lm_head
    # same inputs as decode, so the runner passes the same (fixed-address) tables
    assert [p.name for p in lowered[fused].params] == [p.name for p in lowered["decode"].params]
    # prefill_fused too (not captured: prefill's token count varies), with prefill's inputs
    pre = "prefill" + FUSED_FUNCTION_SUFFIX
    assert len(_calls(lowered[pre], "lora_linear_triton_")) == 4 * cfg.num_hidden_layers
    assert not _calls(lowered[pre], "lora_sgmv_")
    assert [p.name for p in lowered[pre].params] == [p.name for p in lowered["prefill"].params]
    # decode itself is unchanged: cuBLAS/gemv + the sgmv kernels (and their tile table)
    dec = [f for gv, f in lowered.functions_items() if gv.name_hint.startswith("decode_cuda_graph_capture")]
    assert sum(len(_calls(f, "lora_sgmv_")) for f in dec) == 2 * 4 * cfg.num_hidden_layers + 1
    assert sum(len(_calls(f, "silu_mul_triton_96_float16")) for f in dec) == cfg.num_hidden_layers
    # the fused linears of a function share one (COUNTER_SLOTS,) int32 counter tensor of zeros (the
    # split kernels leave it so), a constant of the library: the same object in every call
    from mlc_lora.compiler_passes.ops.lora.linear_triton import COUNTER_SLOTS

    for name in (pre, fused):
        counters = []

        def visit(e):
            if isinstance(e, relax.Call) and isinstance(e.op, relax.GlobalVar) and \
                    e.op.name_hint.startswith("lora_linear_triton_"):
                counters.append(e.args[9])

        for gv, f in lowered.functions_items():
            if gv.name_hint == name or gv.name_hint.startswith(name + "_cuda_graph_capture"):
                relax.analysis.post_order_visit(f.body, visit)
        assert len(counters) == 4 * cfg.num_hidden_layers
        assert all(isinstance(c, tvm.ir.expr.Constant) and c.same_as(counters[0]) for c in counters)
        assert counters[0].value.numpy().tolist() == [0] * COUNTER_SLOTS


def test_rank_rows_library_widens_the_weights_and_fuses_past_the_small_kernel():
    """--lora-rank-rows: every targeted weight of every function is 32 rows per part taller; the
    fused functions' linears (the rank rows wrapper, inside decode_fused's graphs) take the whole
    weight, every other GEMM a view of its first rows (no copy kernel); lm_head is untouched."""
    pytest.importorskip("triton")
    cfg, lowered = _lowered(fused=True, rank_rows=True)
    fused = "decode" + FUSED_FUNCTION_SUFFIX
    captures = [f for gv, f in lowered.functions_items() if gv.name_hint.startswith(fused + "_cuda_graph_capture")]
    assert len([c for f in captures for c in _calls(f, "lora_linear_rows_")]) == 4 * cfg.num_hidden_layers
    assert not [c for f in captures for c in _calls(f, "lora_linear_triton_")]
    pre = "prefill" + FUSED_FUNCTION_SUFFIX
    assert len(_calls(lowered[pre], "lora_linear_rows_")) == 4 * cfg.num_hidden_layers
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    want = {(qkv + 96, h), (h + 32, h), (2 * inter + 64, h), (h + 32, inter)}
    for name in ("decode", "prefill", "decode" + BASE_FUNCTION_SUFFIX, fused, pre):
        shapes = [tuple(int(v) for v in f.shape.values) for f in lowered[name].params[-1].ty.fields]
        assert want <= set(shapes), name
        assert (cfg.vocab_size, h) in shapes  # lm_head
    # the other GEMMs (gemv / cuBLAS wrappers) take the whole weight and read its first rows: no view
    # is made per call, and no linear falls back to TVM's matmul
    for gv, f in lowered.functions_items():
        if isinstance(f, relax.Function):
            text = f.script()
            assert "TVMTensorCreateView" not in text and "NT_matmul" not in text, gv.name_hint
    base = [f for gv, f in lowered.functions_items() if gv.name_hint.startswith("decode_base_cuda_graph_capture")]
    wrappers = {c for f in base for c in _calls(f, "mlc_lora_linear_")}
    assert wrappers == {f"mlc_lora_linear_f16_{n}_of{n + r}x{k}_3d" for n, k, r in (
        (qkv, h, 96), (h, h, 32), (2 * inter, h, 64), (h, inter, 32))} | {f"mlc_lora_linear_f16_{cfg.vocab_size}x{h}_3d"}


@pytest.mark.parametrize("fold_silu", [False, True])
def test_spare_columns_library_widens_the_weights_and_every_gemm_reads_their_first_columns(fold_silu, monkeypatch):
    """Spare columns (the rank columns route): every targeted weight of every function has 32 columns
    per part beside its own, padded to a row of a multiple of 64 (spare_columns); the fused
    functions' linears (the rank columns wrapper, inside decode_fused's graphs and in prefill_fused)
    take the whole weight, every other GEMM (gemv / cuBLAS wrappers) too, with its row stride: no
    slice is copied per call and no linear falls back to TVM's matmul; lm_head is untouched. The
    route runs where x's producer writes x into [x | s]: q|k|v and gate|up take the RMSNorm's input
    and gain (no RMSNorm kernel left before them in the fused functions, only the final norm); down
    the gate|up output (silu * up) where lora_rewrite.FOLD_SILU_MUL says so (on by default). o (x
    the attention's), and down without the fold, keep the pair over their weights' first columns,
    and their columns are not filled. decode_fused's first q|k|v reads the function's input, so it
    runs before the first graph."""
    pytest.importorskip("triton")
    from mlc_lora.compiler_passes.passes import lora_rewrite

    monkeypatch.setattr(lora_rewrite, "FOLD_SILU_MUL", fold_silu)
    cfg, lowered = _lowered(fused=True, spare_columns=True)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    # 64 + 96 -> 192, 64 + 32 -> 128, 64 + 64 = 128, 96 + 32 = 128
    sc = {3: 128, 1: 64, 2: 64, "down": 32}
    assert sc == {3: LT.spare_columns(h, 3), 1: LT.spare_columns(h, 1), 2: LT.spare_columns(h, 2),
                  "down": LT.spare_columns(inter, 1)}
    fused = "decode" + FUSED_FUNCTION_SUFFIX
    captures = [f for gv, f in lowered.functions_items() if gv.name_hint.startswith(fused + "_cuda_graph_capture")]
    L, routed = cfg.num_hidden_layers, 3 if fold_silu else 2  # the linears on the route, per layer
    linears = [c for f in captures for c in _calls(f, "lora_linear_cols_")]
    pairs = [c for f in captures for c in _calls(f, "lora_linear_triton_")]
    outside = _calls(lowered[fused], "lora_linear_cols_")
    assert outside == [f"lora_linear_cols_m0_1_2_{h}x{qkv}_of{h + sc[3]}_norm"], outside
    assert len(linears) == routed * L - 1 and all("_of" in c for c in linears), linears
    assert len(pairs) == (4 - routed) * L and all("_of" in c for c in pairs), pairs
    assert not [c for f in captures for c in _calls(f, "lora_fill_columns_")]
    prefill = _calls(lowered["prefill" + FUSED_FUNCTION_SUFFIX], "lora_linear_cols_")
    ends = [c.rsplit("_of", 1)[1].split("_", 1)[1:] for c in prefill]  # the producer each takes
    assert ends == ([["norm"], ["norm"]] + ([["silu"]] if fold_silu else [])) * L, prefill
    assert len(_calls(lowered["prefill" + FUSED_FUNCTION_SUFFIX], "lora_linear_triton_")) == (4 - routed) * L
    activations = [c for f in [lowered["prefill" + FUSED_FUNCTION_SUFFIX], lowered[fused]] + captures
                   for c in _calls(f, "silu_mul_triton_")]
    assert len(activations) == (0 if fold_silu else 2 * cfg.num_hidden_layers), activations
    assert len(_calls(lowered["prefill" + FUSED_FUNCTION_SUFFIX], "rms_norm")) == 1  # the final norm
    # the fill of the spare columns: its own function, one call per targeted weight, in place
    fills = _calls(lowered[FILL_COLUMNS_FUNCTION], "lora_fill_columns_")
    assert len(fills) == routed * L and len(set(fills)) == routed, fills
    want = {(qkv, h + sc[3]), (h, h + sc[1]), (2 * inter, h + sc[2]), (h, inter + sc["down"])}
    for name in ("decode", "prefill", "decode" + BASE_FUNCTION_SUFFIX, fused, "prefill" + FUSED_FUNCTION_SUFFIX):
        shapes = [tuple(int(v) for v in f.shape.values) for f in lowered[name].params[-1].ty.fields]
        assert want <= set(shapes), name
        assert (cfg.vocab_size, h) in shapes  # lm_head
    for gv, f in lowered.functions_items():
        if isinstance(f, relax.Function):
            text = f.script()
            assert "strided_slice" not in text and "NT_matmul" not in text, gv.name_hint
    base = [f for gv, f in lowered.functions_items() if gv.name_hint.startswith("decode_base_cuda_graph_capture")]
    wrappers = {c for f in base for c in _calls(f, "mlc_lora_linear_")}
    assert wrappers == {f"mlc_lora_linear_f16_{n}x{k}_of{k + r}_3d" for n, k, r in (
        (qkv, h, sc[3]), (h, h, sc[1]), (2 * inter, h, sc[2]), (h, inter, sc["down"]))} | {
        f"mlc_lora_linear_f16_{cfg.vocab_size}x{h}_3d"}


def test_add_norm_library_adds_each_residual_in_the_norm_that_reads_it():
    """With add_norm every RMSNorm of the hidden state runs on ops/norm_triton.py's kernel, and each
    residual sum (h + o_proj's, h + down_proj's) is made by the norm that reads it: in the functions
    without the rank columns route one add + norm kernel per sum (2 a layer: the post-attention
    norm, the next layer's input norm or the final one) and the first layer's input norm alone; in
    the fused functions the route's q|k|v and gate|up run the add + norm as x's producer (the
    first layer's q|k|v the norm alone) and the last sum the final norm's kernel. No TVM RMSNorm is
    left, nor a residual add of its own (the adds left are the LoRA-free ones TVM fuses elsewhere)."""
    pytest.importorskip("triton")
    cfg, lowered = _lowered(fused=True, spare_columns=True, add_norm=True)
    L = cfg.num_hidden_layers
    for name in ("prefill", "prefill" + BASE_FUNCTION_SUFFIX):
        calls = _calls(lowered[name], "")
        assert sum(c.startswith("add_rms_norm_triton_") for c in calls) == 2 * L, (name, calls)
        assert sum(c.startswith("rms_norm_triton_") for c in calls) == 1, name
        assert not [c for c in calls if c.startswith(("rms_norm", "fused_rms_norm")) and "triton" not in c], name
    prefill = _calls(lowered["prefill" + FUSED_FUNCTION_SUFFIX], "")
    ends = [c.rsplit("_of", 1)[1].split("_", 1)[1:] for c in prefill if c.startswith("lora_linear_cols_")]
    assert ends == [["norm"], ["addnorm"], ["silu"]] + [["addnorm"], ["addnorm"], ["silu"]] * (L - 1), prefill
    assert sum(c.startswith("add_rms_norm_triton_") for c in prefill) == 1  # the final norm
    assert not [c for c in prefill if "rms_norm" in c and "triton" not in c], prefill
    # decode alike, the graphs holding all but the first layer's: its q|k|v (the norm alone) and its
    # gate|up (whose sum reads the function's input, as the add of its own did) run between them
    fused = "decode" + FUSED_FUNCTION_SUFFIX
    captured = [c for gv, f in lowered.functions_items() if gv.name_hint.startswith(fused + "_cuda_graph_capture")
                for c in _calls(f, "")]
    outside = [c for c in _calls(lowered[fused], "") if "norm" in c]
    assert outside == [f"lora_linear_cols_m0_1_2_{cfg.hidden_size}x128_of192_norm",
                       f"lora_linear_cols_m4_5_{cfg.hidden_size}x192_of128_addnorm"], outside
    assert sum(c.endswith("_addnorm") for c in captured) == 2 * L - 2, captured
    assert sum(c.startswith("add_rms_norm_triton_") for c in captured) == 1, captured
