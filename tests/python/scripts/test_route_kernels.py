"""scripts/harness/route_kernels.py (the kernels of bench_lora_fused.py's experimental routes) under
Triton's interpreter on the CPU, against float64: the producer's x (RMSNorm or a copy), each token's
own scaled shrink columns (a base-model token, a module its adapter leaves alone and rank columns past
the batch's ranks among them), the fill's B columns, and the route's output xe @ [W | B_cols].T
against x @ W.T + the LoRA delta."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]

CHILD = r"""
import json
import torch
from tests.python.compiler.ops.lora.triton_interp import _interpreter_scalars
_interpreter_scalars()
from harness.route_kernels import producer_shrink_kernel
from mlc_lora.compiler_passes.ops.lora.linear_triton import lora_fill_cols_kernel
from harness.workload import arena_tables, lora_weights, token_slots

RS, K, N, T, SCALE = 32, 128, 4, 37, 0.5
ranks = [8, 4, 8, 8]  # 28 of the 32 rank columns live
start = [sum(ranks[:s]) for s in range(N)]
out = []
for norm in (True, False):
    for widths in ((64, 32, 32), (64,)):
        P, dt, R = len(widths), torch.float16, max(ranks)
        mods = [lora_weights(torch, 1, ranks, K, w, dt, "cpu", 7 + p) for p, w in enumerate(widths)]
        arena, a_off, b_off = arena_tables(torch, mods, "cpu")
        slot = torch.from_numpy(token_slots(T, N, 3))
        slot[5] = -1  # a base-model token
        rank = torch.tensor(ranks, dtype=torch.int32)
        scale = torch.full((N, P), SCALE, dtype=torch.float32)
        scale[2, 0] = 0  # adapter 2 leaves part 0 alone
        m3 = (list(range(P)) + [-1] * 3)[:3]
        w3 = (list(widths) + [0, 0])[:2]
        KE = K + P * RS
        h = torch.randn(T, K).to(dt)
        g = (torch.rand(K) + 0.5).to(dt)
        xe = torch.full((T, KE), float("nan"), dtype=dt)
        producer_shrink_kernel[(-(-T // 16),)](
            h, g, arena, slot, rank, scale, a_off[0], xe, T, N, 0, 1e-5, K=K, KE=KE, M=P, R=R, m0=m3[0],
            m1=m3[1], m2=m3[2], P=P, BM=16, BK=64, RS=RS, SC=16, ALIGN=8, NORM=norm, SHRINK=True, num_warps=4)
        w = torch.randn(sum(widths), K).to(dt)
        wf = torch.zeros(sum(widths), KE, dtype=dt)  # [W | B_cols]: every part's own block NaN before the fill
        wf[:, :K] = w
        o = 0
        for p, wp in enumerate(widths):
            wf[o:o + wp, K + p * RS:K + (p + 1) * RS] = float("nan")
            o += wp
        lora_fill_cols_kernel[(sum(widths) // 32,)](arena, rank, scale, b_off[0], wf, N, 0, K=K, KE=KE, M=P, R=R,
                                                    m0=m3[0], m1=m3[1], m2=m3[2], W0=w3[0], W1=w3[1], BN=32, RS=RS,
                                                    SC=16, ALIGN=8, num_warps=4)
        hf = h.double()
        x = hf * torch.rsqrt((hf * hf).mean(1, keepdim=True) + 1e-5) * g.double() if norm else hf
        xr = xe[:, :K].double()  # x as the kernel rounded it, what its shrink multiplies
        w_ref = torch.zeros(sum(widths), KE, dtype=torch.float64)
        w_ref[:, :K] = w.double()
        s_ref = torch.zeros(T, P * RS, dtype=torch.float64)
        ref = xr @ w.double().t()
        o = 0
        for p, wp in enumerate(widths):
            a, b = mods[p][0][0].double(), mods[p][1][0].double()  # (N, R, K), (N, out, R)
            for s in range(N):
                if scale[s, p] != 0:
                    c0 = K + p * RS + start[s]
                    w_ref[o:o + wp, c0:c0 + ranks[s]] = b[s, :, :ranks[s]]
            for t in range(T):
                s = int(slot[t])
                if s >= 0 and scale[s, p] != 0:
                    xa = SCALE * (xr[t] @ a[s, :ranks[s]].t())
                    s_ref[t, p * RS + start[s]:p * RS + start[s] + ranks[s]] = xa
                    ref[t, o:o + wp] += xa @ b[s, :, :ranks[s]].t()
            o += wp
        y = xe.double() @ wf.double().t()
        out.append(dict(norm=norm, parts=P, nan=bool(torch.isnan(xe).any() or torch.isnan(wf).any()),
                        x_err=float((xr - x).abs().max()),
                        s_err=float((xe[:, K:].double() - s_ref).abs().max() / s_ref.abs().max()),
                        fill_err=float((wf.double() - w_ref).abs().max()),
                        y_err=float((y - ref).norm() / (ref - xr @ w.double().t()).norm())))
print(json.dumps(out))
"""


def test_route_kernels_match_float64_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 4
    for r in results:
        assert not r["nan"], r  # every element of xe written
        assert r["x_err"] < (2e-2 if r["norm"] else 1e-12), r  # float16 rounding of |x| up to ~4
        assert r["s_err"] < 2e-3, r
        assert r["fill_err"] == 0, r  # a copy of the B rows, zeros where a column is not live
        assert r["y_err"] < 2e-3, r  # of the delta, against float64
