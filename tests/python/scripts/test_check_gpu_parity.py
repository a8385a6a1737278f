"""scripts/check_gpu_parity.py on CPU with a tiny random Llama and two PEFT adapters: the mixed batch
of `run` (base and adapter rows in one batch) against HF transformers + PEFT row by row; `device`
against a reference made from that batch (exit 0, exact, without importing the compiler) and against
one with a token and a row's logits changed (exit 1, those rows flagged); `split` and the joining
of its parts."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import check_gpu_parity as parity

from ..conftest import make_tiny_hf_model, save_adapter

ADAPTERS = {  # folder name: LoraConfig kwargs (the demo pair's shapes)
    "caps": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "pir": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"]),
}
PROMPTS = [[1, 5, 7, 9, 3], [2, 4, 6, 8, 10, 12, 14]]
GREEDY_CHECKED = 8  # own greedy tokens compared with PEFT's (a random model has near-ties later on)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(compiled tiny LoRA model, adapter folders, PEFT models: None for the base, then each adapter)."""
    from mlc_lora.compile import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("parity")
    base = make_tiny_hf_model(root / "hf", "gqa")
    folders, refs = [], [base]
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        folders.append(str(root / name))
        refs.append(save_adapter(base, root / name, 50 + seed, **kw))
    compiled = compile_model(root / "hf", root / "lora-llvm",
                             CompileOptions(prefill_chunk_size=128, max_batch_size=16, lora_pool_pages=64,
                                            max_lora_rank=16), progress=False)
    return compiled, folders, refs


def _peft(model, prompt, n):
    """PEFT's prefill logits and its first n greedy tokens."""
    ids, first = list(prompt), None
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            first = logits.numpy() if first is None else first
            ids.append(int(logits.argmax()))
    return first, ids[len(prompt):]


def _mixed_batch(compiled, folders):
    from mlc_lora.runner import ModelRunner

    runner = ModelRunner(compiled, "cpu")
    row_adapter, row_prompt = parity.mixed_rows(len(PROMPTS), len(folders))
    pool = parity.make_pool(runner, len(row_prompt))
    names = parity.load_adapters(pool, folders)
    logits, greedy = parity.run(runner, pool, [PROMPTS[p] for p in row_prompt], list(row_adapter), None,
                                parity.STEPS)
    return names, row_adapter, row_prompt, logits, greedy


def test_mixed_batch_rows_match_peft(setup):
    compiled, folders, refs = setup
    names, row_adapter, row_prompt, logits, greedy = _mixed_batch(compiled, folders)
    assert names == list(ADAPTERS)
    assert list(row_adapter) == [-1, -1, 0, 0, 1, 1] and list(row_prompt) == [0, 1] * 3
    assert logits.shape[:2] == greedy.shape == (parity.STEPS + 1, 6)
    for i, (a, p) in enumerate(zip(row_adapter, row_prompt)):
        want_logits, want_tokens = _peft(refs[a + 1], PROMPTS[p], GREEDY_CHECKED)
        np.testing.assert_allclose(logits[0, i], want_logits, atol=1e-4, err_msg=f"row {i}")
        assert greedy[:GREEDY_CHECKED, i].tolist() == want_tokens, f"row {i}"
    # the adapters change every prompt's prefill logits (rows of one prompt: i, i + 2, i + 4)
    for i in (0, 1):
        assert np.abs(logits[0, i + 2] - logits[0, i]).max() > 1e-2
        assert np.abs(logits[0, i + 4] - logits[0, i]).max() > 1e-2


def _table_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.endswith(("  ok", "  FAIL")) or "  tie (" in line]


def test_device_gate(setup, tmp_path, capsys):
    compiled, folders, _ = setup
    names, row_adapter, row_prompt, logits, greedy = _mixed_batch(compiled, folders)
    ref = tmp_path / "ref.npz"
    parity.save_reference(ref, logits, greedy, PROMPTS, ["p0", "p1"], names, row_adapter, row_prompt)
    args = ["device", "--device", "cpu", "--ref", str(ref), "--lib-dir", str(compiled), "--adapters", *folders]

    # the same build: every row exact; `device` imports no part of the compiler
    code = ("import sys, check_gpu_parity as p; rc = p.main(sys.argv[1:]); "
            "print('compiler modules:', sorted(m for m in sys.modules if m.startswith(('mlc_lora.compile', "
            "'mlc_lora.compiler_passes', 'mlc_lora.models.llama')) and m != 'mlc_lora.models.llama_loader')); "
            "sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, check=False,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _table_rows(r.stdout)
    assert [(x[2], x[3]) for x in rows] == [("base", "#0"), ("base", "#1"), ("caps", "#0"), ("caps", "#1"),
                                           ("pir", "#0"), ("pir", "#1")]
    assert all(x[4:9] == ["0.000e+00", "0.000e+00", "100.0%", "None", "ok"] for x in rows), r.stdout
    assert "compiler modules: []" in r.stdout and "PASS: 6 of 6 rows agree" in r.stdout and "0 first differ" in r.stdout

    # greedy tokens changed past the kept logits (fed at decode steps 10 and 20: the logits compared
    # stay equal): row 1 at step 20 (past the gate), row 3 at step 10; row 5's logits 5% off
    bad = dict(np.load(ref))
    for step, row in ((20, 1), (10, 3)):
        bad["greedy"][step, row] = (bad["greedy"][step, row] + 1) % logits.shape[-1]
    bad["logits"][:, 5] *= 1.05
    np.savez(ref, **bad)
    assert parity.main(args) == 1
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert [x[-1] for x in rows] == ["ok", "ok", "ok", "FAIL", "ok", "FAIL"], out
    assert [x[7] for x in rows] == ["None", "20", "None", "10", "None", "None"], out
    assert rows[3][5] == "0.000e+00" and 0.04 < float(rows[5][5]) < 0.06, out
    assert "FAIL: 2 of 6 rows" in out

    # a reference adapter without its folder
    with pytest.raises(SystemExit, match=r"the reference ran adapters \['caps', 'pir'\]; --adapters gave \['caps'\]"):
        parity.main(args[:-1])


def test_first_difference_at_a_tie_passes_and_is_named():
    """A first differing token passes the gate only where the CPU's margin between its token and the
    one chosen is within the build's logit error at that step."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((3, 50))
    want, own = np.array([7, 3, 4, 4]), np.array([7, 9, 4, 1])  # differ first at step 1
    ref[1, 3], ref[1, 9] = 5.0, 4.99  # the CPU's margin: 0.01
    dev = ref + 0.004 * rng.standard_normal(ref.shape)
    dev[1, 9] = ref[1, 9] + 0.02  # the error that flips it (>= the margin)
    row = parity.compare_row(ref, dev, want, own)
    assert row["ok"] and row["first_diff"] == 1 and row["tie"] == pytest.approx(0.01)
    ref[1, 9] = 4.5  # a margin of 0.5, beyond the error: a real difference
    assert not parity.compare_row(ref, dev, want, own)["ok"]
    # a first difference past the logits kept (step 3 of 3 steps kept) is never a tie
    row = parity.compare_row(ref, dev, want, np.array([7, 3, 4, 1]))
    assert row["first_diff"] == 3 and row["tie"] is None and not row["ok"]


def test_split_and_join(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 1001, dtype=np.uint8).tobytes()
    (tmp_path / "m.gguf").write_bytes(data)
    parts = tmp_path / "parts"
    assert parity.main(["split", "--weights", str(tmp_path / "m.gguf"), "--out", str(parts), "--parts", "3"]) == 0
    assert [len((parts / f"part{i}").read_bytes()) for i in range(3)] == [334, 334, 333]
    (tmp_path / "a").mkdir()
    joined = parity.join_parts(parts, tmp_path / "a")
    assert joined.name == "m.gguf" and joined.read_bytes() == data

    (parts / "part2").write_bytes(b"x" + (parts / "part2").read_bytes()[1:])
    (tmp_path / "b").mkdir()
    with pytest.raises(SystemExit, match="join to 1001 bytes with sha256"):
        parity.join_parts(parts, tmp_path / "b")
    (parts / "part1").unlink()
    with pytest.raises(SystemExit, match="lacks part1 of the 3 parts of m.gguf"):
        parity.join_parts(parts, tmp_path / "b")
    with pytest.raises(SystemExit, match="is neither"):
        parity.main(["split", "--weights", str(tmp_path), "--out", str(parts)])
