"""Mixed-adapter batches of the compiled tiny Llama against HF transformers + PEFT.

Five seeded PEFT adapters (ranks 4..64, different alphas and targets, one rsLoRA, one with
rank/alpha patterns and a regex target, one on a single layer) are packed by the runtime into a
numpy arena, the tables coming from the numpy table builder (tests/python/lora/reference.py: what
the C++ pool must produce), and into the C++ pool itself.
"""

import json

import numpy as np
import pytest
import torch

from mlc_lora.compile import CompileOptions, compile_model
from mlc_lora.errors import MLCLoraError
from mlc_lora.lora import pack_peft_adapter
from mlc_lora.models.llama import LlamaConfig
from mlc_lora.runner import ModelRunner

from ..conftest import make_tiny_hf_model, save_adapter
from .reference import NumpyArena

ADAPTERS = {
    # id: LoraConfig kwargs
    1: dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                "up_proj", "down_proj"]),
    2: dict(r=16, lora_alpha=32, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    3: dict(r=64, lora_alpha=16, target_modules=["o_proj", "gate_proj", "down_proj"]),
    4: dict(r=8, lora_alpha=16, target_modules=r".*\.(k_proj|up_proj|down_proj)",
            rank_pattern={"down_proj": 4}, alpha_pattern={"layers.1.mlp.up_proj": 4}),
    5: dict(r=12, lora_alpha=6, target_modules=["v_proj", "gate_proj"], layers_to_transform=[1]),
}
# (adapter id or None, prompt); order mixes adapters and base requests.
REQUESTS = [(1, [1, 5, 7, 9, 3, 11, 2]), (None, [2, 4, 6]), (3, [10, 11, 12, 13, 14, 15, 16, 17, 18]),
            (2, [3, 3, 8]), (4, [7, 1, 9, 20, 21]), (1, [30, 31]), (5, [5, 6, 7, 8]), (None, [9])]
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory, compile_once):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_hf_model(root / "hf", "gqa")
    cfg = LlamaConfig.from_dict(json.loads((root / "hf" / "config.json").read_text()))
    refs = {None: base}
    for aid, kw in ADAPTERS.items():
        refs[aid] = save_adapter(base, root / f"adapter{aid}", 100 + aid, **kw)
    compiled = {}
    for kernel in ("gather", "single", "sgmv"):
        compiled[kernel] = compile_once(root / "hf", CompileOptions(
            prefill_chunk_size=128, max_batch_size=16, lora_pool_pages=96, max_lora_rank=64, lora_kernel=kernel))
    return cfg, root, refs, compiled


def _peft_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].numpy()


def _run_batches(runner, arena, batches, kv=None):
    """Prefill then DECODE_STEPS decodes for each batch (a list of request indices).
    `arena`: a NumpyArena (tables from the numpy builder) or "pool" (the C++ pool's tables, `kv`).
    Returns {request index: [logits after prefill, after decode 1, ...]} and the token sequences."""
    rng = np.random.default_rng(7)
    next_tokens = {i: rng.integers(0, runner.vocab_size, DECODE_STEPS).tolist() for i in range(len(REQUESTS))}
    out, seqs = {}, {}
    if kv is None:
        kv = runner.create_pool(max_batch_size=16, max_total_seq_len=512, prefill_chunk_size=128)

    def tables(token_adapter):
        if arena == "pool":
            return "pool"
        return arena.tables(token_adapter) | {"lora_arena": arena.data}

    for batch in batches:
        for i in batch:
            kv.add_sequence(i)
            if arena == "pool":
                kv.set_sequence_adapter(i, REQUESTS[i][0])
            seqs[i] = list(REQUESTS[i][1])
        token_adapter = [REQUESTS[i][0] for i in batch for _ in REQUESTS[i][1]]
        logits = runner.prefill(kv, batch, [REQUESTS[i][1] for i in batch], lora=tables(token_adapter)).numpy()
        for row, i in enumerate(batch):
            out[i] = [logits[row].copy()]
        for step in range(DECODE_STEPS):
            toks = [next_tokens[i][step] for i in batch]
            logits = runner.decode(kv, batch, toks, lora=tables([REQUESTS[i][0] for i in batch])).numpy()
            for row, i in enumerate(batch):
                seqs[i].append(toks[row])
                out[i].append(logits[row].copy())
    return out, seqs


def _one_adapter_batches():
    """Stage 1 batches: one adapter each; the base requests ride along with the first (slot -1)."""
    by_adapter = {}
    for i, (aid, _) in enumerate(REQUESTS):
        by_adapter.setdefault(aid, []).append(i)
    base = by_adapter.pop(None)
    return [by_adapter[a] + (base if n == 0 else []) for n, a in enumerate(sorted(by_adapter))]


def _arena(runner, root):
    spec = runner.lora
    arena = NumpyArena(spec, np.float32)
    # Load in an order that leaves adapters on non-contiguous, non-initial page ids.
    arena.free = list(np.random.default_rng(3).permutation(spec.pool_pages))
    for aid in (3, 1, 5, 2, 4):
        arena.load(aid, pack_peft_adapter(root / f"adapter{aid}", runner.config))
    return arena


_PEFT_CACHE = {}


def _check_against_peft(refs, out, seqs):
    worst = 0.0
    for i, (aid, prompt) in enumerate(REQUESTS):
        for step, got in enumerate(out.get(i, ())):  # (of the requests run)
            toks = tuple(seqs[i][: len(prompt) + step])
            if (aid, toks) not in _PEFT_CACHE:  # the same requests recur across tests
                _PEFT_CACHE[aid, toks] = _peft_logits(refs[aid], list(toks))
            want = _PEFT_CACHE[aid, toks]
            err = float(np.abs(got - want).max())
            assert err < 1e-4, f"request {i} (adapter {aid}) step {step}: max abs error {err}"
            worst = max(worst, err)
    return worst


@pytest.mark.parametrize("kernel", ["gather", "sgmv"])
def test_mixed_adapter_batch_matches_peft_gather(lora_setup, kernel):
    cfg, root, refs, compiled = lora_setup
    runner = ModelRunner(compiled[kernel])
    arena = _arena(runner, root)
    out, seqs = _run_batches(runner, arena, [list(range(len(REQUESTS)))])
    print(f"{kernel}, one mixed batch: max abs error vs PEFT {_check_against_peft(refs, out, seqs):.2e}")
    # The adapters matter: every adapter request differs visibly from the base model.
    for i, (aid, prompt) in enumerate(REQUESTS):
        if aid is not None:
            assert np.abs(out[i][0] - _peft_logits(refs[None], prompt)).max() > 1e-2, f"adapter {aid}"


@pytest.mark.parametrize("kernel", ["gather", "single", "sgmv"])
def test_tables_from_the_cpp_pool_match_peft(lora_setup, kernel):
    """The same requests with the adapters loaded into the C++ unified pool (KV pages and adapter
    pages in one arena) and the pool's own per-batch tables."""
    cfg, root, refs, compiled = lora_setup
    runner = ModelRunner(compiled[kernel])
    kv = runner.create_pool(max_batch_size=16, max_total_seq_len=1024, prefill_chunk_size=128)
    for aid in (3, 1, 5, 2, 4):
        p = pack_peft_adapter(root / f"adapter{aid}", runner.config)
        kv.load_packed_adapter(aid, p, False)
    batches = [list(range(len(REQUESTS)))] if kernel != "single" else _one_adapter_batches()
    out, seqs = _run_batches(runner, "pool", batches, kv=kv)
    print(f"{kernel} with the C++ pool: max abs error vs PEFT {_check_against_peft(refs, out, seqs):.2e}")
    kv.check_invariants()


def test_single_adapter_batches_match_peft_and_gather(lora_setup):
    cfg, root, refs, compiled = lora_setup
    single = ModelRunner(compiled["single"])
    batches = _one_adapter_batches()
    out1, seqs = _run_batches(single, _arena(single, root), batches)
    print(f"single, one adapter per batch: max abs error vs PEFT {_check_against_peft(refs, out1, seqs):.2e}")
    with pytest.raises(MLCLoraError, match="compiled with --lora-kernel single: a batch may use one adapter"):
        _run_batches(single, _arena(single, root), [[0, 2]])
    for kernel in ("gather", "sgmv"):  # stages 2 and 3 agree with stage 1 on its batches
        other = ModelRunner(compiled[kernel])
        out2, _ = _run_batches(other, _arena(other, root), batches)
        for i in out1:
            for a, b in zip(out1[i], out2[i]):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_base_only_batch_and_config_record(lora_setup):
    cfg, _, refs, compiled = lora_setup
    r = ModelRunner(compiled["gather"])
    lora = r.config["lora"]
    assert lora["max_rank"] == 64 and lora["kernel"] == "gather" and lora["pool_pages"] == 96
    assert lora["page_elems"] == 2 * 2 * 16 * 16
    assert [(m["name"], m["in_features"], m["out_features"]) for m in lora["modules"]] == [
        ("q_proj", 64, 64), ("k_proj", 64, 32), ("v_proj", 64, 32), ("o_proj", 64, 64),
        ("gate_proj", 64, 128), ("up_proj", 64, 128), ("down_proj", 128, 64)]
    kv = r.create_pool(max_batch_size=4, max_total_seq_len=128, prefill_chunk_size=128)
    kv.add_sequence(0)
    got = r.prefill(kv, [0], [[4, 5, 6]]).numpy()[0]  # no tables: every token on the base model
    np.testing.assert_allclose(got, _peft_logits(refs[None], [4, 5, 6]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kernel", ["gather", "single"])
def test_mixed_adapter_batch_matches_peft_cuda(lora_setup, kernel):
    """The same on a GPU (float32; hand-scheduled kernels). Skipped where no GPU is visible."""
    from mlc_lora.runner import device_of

    try:
        device_of("cuda")
    except (MLCLoraError, OSError, RuntimeError):
        pytest.skip("no CUDA GPU visible")
    cfg, root, refs, _ = lora_setup
    compiled = compile_model(root / "hf", root / f"lora-cuda-{kernel}",
                             CompileOptions(target="cuda", dtype="float32", prefill_chunk_size=128,
                                            max_batch_size=16, lora_pool_pages=96, max_lora_rank=64,
                                            lora_kernel=kernel), progress=False)
    runner = ModelRunner(compiled, device="cuda")
    batches = [list(range(len(REQUESTS)))] if kernel == "gather" else _one_adapter_batches()
    out, seqs = _run_batches(runner, _arena(runner, root), batches)
    print(f"cuda {kernel}: max abs error vs PEFT {_check_against_peft(refs, out, seqs):.2e}")


@pytest.mark.parametrize("dtype,tol", [("float16", 1e-2), ("bfloat16", 5e-2)])
def test_half_precision_library_matches_peft(lora_setup, tmp_path, dtype, tol):
    """fp16 / bf16 libraries (CPU, sgmv) with the C++ pool's tables against float32 PEFT: relative
    error of the logits within the dtype's rounding, far below what the adapters change; a bf16
    engine loads PEFT adapters (its pages are bfloat16 on the host)."""
    from mlc_lora import MLCEngine

    _, root, refs, _ = lora_setup
    lib = compile_model(root / "hf", tmp_path / f"lora-{dtype}",
                        CompileOptions(prefill_chunk_size=128, max_batch_size=16, lora_pool_pages=96,
                                       max_lora_rank=64, lora_kernel="sgmv", dtype=dtype), progress=False)
    runner = ModelRunner(lib)
    kv = runner.create_pool(max_batch_size=16, max_total_seq_len=1024, prefill_chunk_size=128)
    for aid in (3, 1, 5, 2, 4):
        p = pack_peft_adapter(root / f"adapter{aid}", runner.config)
        assert p.pages.dtype.name == dtype
        kv.load_packed_adapter(aid, p, False)
    out, seqs = _run_batches(runner, "pool", [list(range(len(REQUESTS)))], kv=kv)
    worst, effect = 0.0, np.inf
    for i, (aid, prompt) in enumerate(REQUESTS):
        for step, got in enumerate(out[i]):
            toks = list(seqs[i][: len(prompt) + step])
            want = _peft_logits(refs[aid], toks)
            worst = max(worst, np.linalg.norm(np.float32(got) - want) / np.linalg.norm(want))
            if aid is not None:
                base = _peft_logits(refs[None], toks)
                effect = min(effect, np.linalg.norm(want - base) / np.linalg.norm(want))
    print(f"{dtype}: worst relative error vs PEFT {worst:.2e}, smallest adapter effect {effect:.2e}")
    assert worst < tol and effect > 5 * tol
    with MLCEngine(lib, "cpu") as eng:
        eng.load_adapter("a1", root / "adapter1")
        out = eng.completions.create(prompt=REQUESTS[0][1], max_tokens=3, ignore_eos=True, adapter_id="a1")
        assert len(out.choices[0].token_ids) == 3 and eng.list_adapters()[0]["resident"]


def _reserved_library(lora_setup, tmp_path, monkeypatch, route: str, axis: int):
    """Compile the sgmv library with the fused functions forced on (on llvm they are the stage's
    copies) and `route` ("rank_rows" / "spare_columns") on; check that every weight's own part
    equals the plain library's and its reserved rows (axis 0) or columns (axis 1) are zeros, then
    put NaN in them. Returns (library folder, params with the NaN, plain params, reserved count by
    linear kind)."""
    import dataclasses

    from safetensors.numpy import load_file

    import mlc_lora.compile as C
    from mlc_lora.contract import PARAMS_FILE

    _, root, _, compiled = lora_setup
    real = C.lora_spec
    monkeypatch.setattr(C, "lora_spec", lambda c, o: dataclasses.replace(
        real(c, o), fused={"rank_columns": 32, "slot_columns": 16, route: True}))
    out = C.compile_model(root / "hf", tmp_path / route, CompileOptions(
        prefill_chunk_size=128, max_batch_size=16, lora_pool_pages=96, max_lora_rank=64, lora_kernel="sgmv"),
        progress=False)
    params, plain = load_file(out / PARAMS_FILE), load_file(compiled["sgmv"] / PARAMS_FILE)
    extra = {}
    for name, arr in params.items():
        ax = min(axis, arr.ndim - 1)  # (vectors: their one axis, never widened)
        own, rest = [slice(None)] * arr.ndim, [slice(None)] * arr.ndim
        own[ax], rest[ax] = slice(0, plain[name].shape[ax]), slice(plain[name].shape[ax], None)
        np.testing.assert_array_equal(arr[tuple(own)], plain[name])
        assert not arr[tuple(rest)].any()
        if arr.shape[ax] > plain[name].shape[ax]:
            extra[name.split(".")[-2]] = arr.shape[ax] - plain[name].shape[ax]
            arr[tuple(rest)] = np.nan
    return out, params, plain, extra


def _matches_peft_with_nan_reserved(lora_setup, out, params, label: str):
    """The library at `out` with `params` (NaN in the reserved parts) against PEFT: all requests
    (ranks past the fused limits), then adapter 1 (rank 4) with base rows (the fused functions)."""
    from safetensors.numpy import save_file

    from mlc_lora.contract import PARAMS_FILE

    _, root, refs, _ = lora_setup
    save_file(params, str(out / PARAMS_FILE), metadata={"dtype": "float32"})
    runner = ModelRunner(out)
    for batch in (list(range(len(REQUESTS))), [0, 1, 5, 7]):
        kv = runner.create_pool(max_batch_size=16, max_total_seq_len=1024, prefill_chunk_size=128)
        for aid in (3, 1, 5, 2, 4):
            kv.load_packed_adapter(aid, pack_peft_adapter(root / f"adapter{aid}", runner.config), False)
        out_, seqs = _run_batches(runner, "pool", [batch], kv=kv)
        print(f"{label} library: max abs error vs PEFT {_check_against_peft(refs, out_, seqs):.2e}")
        kv.check_invariants()
    return runner


def test_rank_rows_library_matches_peft(lora_setup, tmp_path, monkeypatch):
    """A library whose targeted weights reserve the rank rows route's rows (--lora-rank-rows; the
    fused functions are forced on here, on llvm, where they are the stage's copies: the route's
    kernels are CUDA): the compile writes every such weight 32 rows per part taller, its rows
    then zeros; with NaN put in them, mixed batches and a batch within the fused limits still
    match PEFT: the base GEMMs and the stage read the weights' own rows only."""
    from safetensors.numpy import load_file

    cfg, root, _, _ = lora_setup
    out, params, plain, extra = _reserved_library(lora_setup, tmp_path, monkeypatch, "rank_rows", 0)
    assert extra == {"qkv_proj": 96, "o_proj": 32, "gate_up_proj": 64, "down_proj": 32}
    # the config records them, for a runtime that converts the weights itself (check_gpu_parity.py)
    recorded = json.loads((out / "mlc-lora-config.json").read_text())["param_reserved"]
    assert recorded == {k: [a.shape[0] - plain[k].shape[0], 0] for k, a in params.items()
                        if a.shape[0] > plain[k].shape[0]}
    import check_gpu_parity  # (scripts/ is on the tests' path)

    cfg_json = json.loads((out / "mlc-lora-config.json").read_text())
    check_gpu_parity.convert_source(str(root / "hf"), tmp_path, dict(cfg_json, params_file="again.safetensors"))
    again = load_file(tmp_path / "again.safetensors")
    assert {k: a.shape for k, a in again.items()} == {k: a.shape for k, a in params.items()}
    assert all(not a[plain[k].shape[0]:].any() for k, a in again.items())
    assert sum(a.shape[0] > plain[k].shape[0] for k, a in params.items()) == 4 * cfg.num_hidden_layers
    runner = _matches_peft_with_nan_reserved(lora_setup, out, params, "rank rows")
    assert runner.lora.fused.get("rank_rows") is True


def test_spare_columns_library_matches_peft(lora_setup, tmp_path, monkeypatch):
    """A library whose targeted weights carry the rank columns route's spare columns
    (CompileOptions.lora_spare_columns; the fused functions forced on, on llvm, where they are the
    stage's copies): the compile writes every such weight spare_columns(K, P) columns wider (32 per
    part, then zeros to a row of a multiple of 64), zeros; with NaN put in them, mixed batches and a
    batch within the fused limits still match PEFT: every GEMM reads each row's own columns only,
    with the weight's row stride. The config records the columns for check_gpu_parity.py."""
    from mlc_lora.compiler_passes.ops.lora.linear_triton import spare_columns

    cfg = lora_setup[0]
    out, params, plain, extra = _reserved_library(lora_setup, tmp_path, monkeypatch, "spare_columns", 1)
    h, i = cfg.hidden_size, cfg.intermediate_size
    assert extra == {"qkv_proj": spare_columns(h, 3), "o_proj": spare_columns(h, 1),
                     "gate_up_proj": spare_columns(h, 2), "down_proj": spare_columns(i, 1)}
    assert all((h + extra[k]) % 64 == 0 for k in ("qkv_proj", "o_proj", "gate_up_proj"))
    assert (i + extra["down_proj"]) % 64 == 0
    recorded = json.loads((out / "mlc-lora-config.json").read_text())["param_reserved"]
    assert recorded == {k: [0, a.shape[-1] - plain[k].shape[-1]] for k, a in params.items()
                        if a.shape[-1] > plain[k].shape[-1]}
    runner = _matches_peft_with_nan_reserved(lora_setup, out, params, "spare columns")
    assert runner.lora.fused.get("spare_columns") is True


def _int8_peft(model):
    """A copy of PEFT `model` whose adapter rows are what int8 rows read (lora/layout.py's references):
    each row of lora_A and of lora_B's transpose quantized, dequantized, back in float32."""
    import copy

    from mlc_lora.lora.layout import dequantize_rows, quantize_rows

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                rows = p.numpy() if "lora_A" in name else p.numpy().T
                deq = dequantize_rows(*quantize_rows(rows), np.float32)
                p.copy_(torch.from_numpy(np.ascontiguousarray(deq if "lora_A" in name else deq.T)))
    return out


def test_int8_rows_library_matches_peft_on_its_rows(lora_setup, tmp_path):
    """A library compiled with --lora-rows int8 (CPU, sgmv) with the C++ pool: equal to PEFT run on
    the rows int8 rows stand for (each row quantized and dequantized) as closely as the float32
    library is to PEFT, and near PEFT itself: the error well below what the adapters change. Its
    adapters take about a third of a float32 library's pages; any other stage is refused."""
    cfg, root, refs, compiled = lora_setup
    opts = dict(prefill_chunk_size=128, max_batch_size=16, lora_pool_pages=96, max_lora_rank=64)
    lib = compile_model(root / "hf", tmp_path / "lora-int8", CompileOptions(**opts, lora_kernel="sgmv",
                                                                            lora_rows="int8"), progress=False)
    runner = ModelRunner(lib)
    assert runner.lora.rows == "int8"
    kv = runner.create_pool(max_batch_size=16, max_total_seq_len=1024, prefill_chunk_size=128)
    for aid in (3, 1, 5, 2, 4):
        p = pack_peft_adapter(root / f"adapter{aid}", runner.config)
        full = pack_peft_adapter(root / f"adapter{aid}", ModelRunner(compiled["sgmv"]).config)
        # a byte a value where float32 takes four; the scales' 16 bytes weigh on rows of 32-128 values
        assert p.pages.shape[1] <= full.pages.shape[1] // 3 + 1, (aid, p.pages.shape, full.pages.shape)
        kv.load_packed_adapter(aid, p, False)
    out, seqs = _run_batches(runner, "pool", [list(range(len(REQUESTS)))], kv=kv)
    int8_refs = {aid: (m if aid is None else _int8_peft(m)) for aid, m in refs.items()}
    worst, worst_orig, effect = 0.0, 0.0, np.inf
    for i, (aid, prompt) in enumerate(REQUESTS):
        for step, got in enumerate(out[i]):
            toks = list(seqs[i][: len(prompt) + step])
            worst = max(worst, float(np.abs(got - _peft_logits(int8_refs[aid], toks)).max()))
            want = _peft_logits(refs[aid], toks)
            worst_orig = max(worst_orig, np.linalg.norm(got - want) / np.linalg.norm(want))
            if aid is not None:
                effect = min(effect, np.linalg.norm(want - _peft_logits(refs[None], toks)) / np.linalg.norm(want))
    print(f"int8 rows: max abs error vs PEFT on the int8 rows {worst:.2e}; relative error vs PEFT {worst_orig:.2e}, "
          f"smallest adapter effect {effect:.2e}")
    assert worst < 1e-4 and worst_orig < effect / 20
    kv.check_invariants()
    for kernel in ("gather", "single"):
        with pytest.raises(Exception, match="int8 adapter rows need the sgmv kernel"):
            compile_model(root / "hf", tmp_path / f"int8-{kernel}", CompileOptions(**opts, lora_kernel=kernel,
                                                                                  lora_rows="int8"), progress=False)
