"""scripts/harness/route_kernels.py (the kernels of bench_lora_fused.py's experimental routes) under
Triton's interpreter on the CPU, against float64: the producer's x (RMSNorm or a copy), each token's
own scaled shrink columns (a base-model token and a module its adapter leaves alone among them), and
the route's output xe @ [W | B_cols].T against x @ W.T + the LoRA delta."""

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
import json, sys
import torch
from tests.python.compiler.ops.lora.triton_interp import _interpreter_scalars
_interpreter_scalars()
from harness.route_kernels import producer_shrink_kernel
from harness.workload import arena_tables, lora_weights, token_slots

RS, K, N, r, T, SCALE = 32, 128, 4, 8, 37, 0.5
out = []
for norm in (True, False):
    for widths in ((64, 32, 32), (64,)):
        P, dt = len(widths), torch.float16
        mods = [lora_weights(torch, 1, [r] * N, K, w, dt, "cpu", 7 + p) for p, w in enumerate(widths)]
        arena, a_off, _ = arena_tables(torch, mods, "cpu")
        slot = torch.from_numpy(token_slots(T, N, 3))
        slot[5] = -1  # a base-model token
        rank = torch.full((N,), r, dtype=torch.int32)
        scale = torch.full((N, P), SCALE, dtype=torch.float32)
        scale[2, 0] = 0  # adapter 2 leaves part 0 alone
        h = torch.randn(T, K).to(dt)
        g = (torch.rand(K) + 0.5).to(dt)
        KE = K + P * RS
        xe = torch.full((T, KE), float("nan"), dtype=dt)
        m3 = (list(range(P)) + [-1] * 3)[:3]
        producer_shrink_kernel[(-(-T // 16),)](
            h, g, arena, slot, rank, scale, a_off[0], xe, T, N, 0, 1e-5, K=K, KE=KE, M=P, R=r, m0=m3[0],
            m1=m3[1], m2=m3[2], P=P, BM=16, BK=64, RS=RS, SC=16, ALIGN=8, NORM=norm, SHRINK=True, num_warps=4)
        hf = h.double()
        x = hf * torch.rsqrt((hf * hf).mean(1, keepdim=True) + 1e-5) * g.double() if norm else hf
        xr = xe[:, :K].double()  # x as the kernel rounded it, what its shrink multiplies
        w = torch.randn(sum(widths), K).double()
        w_cols = torch.zeros(sum(widths), KE, dtype=torch.float64)
        w_cols[:, :K] = w
        s_ref = torch.zeros(T, P * RS, dtype=torch.float64)
        ref = xr @ w.t()
        o = 0
        for p, wp in enumerate(widths):
            a, b = mods[p][0][0].double(), mods[p][1][0].double()  # (N, R, K), (N, out, R)
            for s in range(N):
                w_cols[o:o + wp, K + p * RS + s * r:K + p * RS + (s + 1) * r] = b[s]
            for t in range(T):
                s = int(slot[t])
                if s >= 0 and scale[s, p] != 0:
                    xa = SCALE * (xr[t] @ a[s].t())
                    s_ref[t, p * RS + s * r:p * RS + (s + 1) * r] = xa
                    ref[t, o:o + wp] += xa @ b[s].t()
            o += wp
        y = xe.double() @ w_cols.t()
        out.append(dict(norm=norm, parts=P, nan=bool(torch.isnan(xe).any()),
                        x_err=float((xr - x).abs().max()),
                        s_err=float((xe[:, K:].double() - s_ref).abs().max() / s_ref.abs().max()),
                        y_err=float((y - ref).norm() / (ref - xr @ w.t()).norm())))
print(json.dumps(out))
"""


def test_producer_shrink_kernel_matches_float64_under_the_interpreter():
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
        assert r["y_err"] < 2e-3, r  # of the delta, against float64
