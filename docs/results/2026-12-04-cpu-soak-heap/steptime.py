"""Prefill (lengths 17..200) and decode step times of ModelRunner on CPU, naive allocator."""
import statistics, sys, time, json
import numpy as np
from mlc_lora.runner import ModelRunner
r = ModelRunner(sys.argv[1], "cpu")
pool = r.create_pool(8, 4096, r.compiled.prefill_chunk_size)
rng = np.random.default_rng(0)
pre, dec = [], []
for rep in range(int(sys.argv[2])):
    for n in (17, 61, 113, 157, 200, 89):
        ids = list(range(8))
        for s in ids: pool.add_sequence(s)
        prompts = [rng.integers(0, r.vocab_size, n).tolist() for _ in ids]
        t0 = time.perf_counter(); r.prefill(pool, ids, prompts).numpy(); pre.append((time.perf_counter() - t0) / (8 * n))
        for _ in range(4):
            t0 = time.perf_counter(); r.decode(pool, ids, [1] * 8).numpy(); dec.append(time.perf_counter() - t0)
        for s in ids: pool.remove_sequence(s)
print(json.dumps(dict(prefill_ms_per_token=1e3 * statistics.median(pre), decode_ms_per_step_b8=1e3 * statistics.median(dec))))
