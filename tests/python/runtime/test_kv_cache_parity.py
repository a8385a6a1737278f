"""mlc-lora's paged KV cache against TVM's stock cache (and HF) on the same traffic.

Both caches are driven only through the stock vm.builtin.* functions (which the runner's Pool
calls): mixed prefill and decode, forks at a page boundary, inside a page and at the end, popn into
a shared page, removal of a parent whose pages its children share.
"""

import numpy as np
import torch
import tvm

from mlc_lora.runner import ModelRunner

ATOL = 1e-5


class Twin:
    """The same traffic on our cache and TVM's; every forward's logits are compared."""

    def __init__(self, ours_dir, stock_dir, hf):
        self.ours, self.stock, self.hf = ModelRunner(ours_dir), ModelRunner(stock_dir), hf
        self.pool_ours = self.ours.create_pool(8, 512, 64)
        self.pool_stock = self.stock.create_pool(8, 512, 64)
        self.tokens = {}
        self.vocab = self.ours.vocab_size
        self.rng = np.random.default_rng(1)

    def both(self, fn, *args):
        getattr(self.pool_ours, fn)(*args)
        getattr(self.pool_stock, fn)(*args)

    def add(self, s):
        self.both("add_sequence", s)
        self.tokens[s] = []

    def fork(self, parent, child, pos=-1):
        self.both("fork_sequence", parent, child, pos)
        self.tokens[child] = list(self.tokens[parent][: None if pos == -1 else pos])

    def popn(self, s, n):
        self.both("popn", s, n)
        del self.tokens[s][-n:]

    def remove(self, s):
        self.both("remove_sequence", s)
        del self.tokens[s]

    def forward(self, lens: dict, check_hf=False):
        seqs = list(lens)
        new = [self.rng.integers(0, self.vocab, lens[s]).tolist() for s in seqs]
        if all(n == 1 for n in lens.values()):
            a = self.ours.decode(self.pool_ours, seqs, [t[0] for t in new]).numpy()
            b = self.stock.decode(self.pool_stock, seqs, [t[0] for t in new]).numpy()
        else:
            a = self.ours.prefill(self.pool_ours, seqs, new).numpy()
            b = self.stock.prefill(self.pool_stock, seqs, new).numpy()
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)
        for s, t in zip(seqs, new):
            self.tokens[s] += t
        if check_hf:
            with torch.no_grad():
                for row, s in enumerate(seqs):
                    ref = self.hf(torch.tensor([self.tokens[s]])).logits[0, -1].numpy()
                    np.testing.assert_allclose(a[row], ref, atol=1e-4, rtol=0)
        for s in self.tokens:
            assert self.pool_ours.sequence_length(s) == len(self.tokens[s])

    def check_kv_equal(self):
        """The cached K/V of every live sequence, every layer, equal the stock cache's."""
        f = tvm.get_global_func("vm.builtin.attention_kv_cache_debug_get_kv")
        cfg = self.ours.model_config
        shape = lambda n: (cfg["num_hidden_layers"], n, cfg["num_key_value_heads"], cfg["head_dim"])
        for s, toks in self.tokens.items():
            if not toks:
                continue
            got = []
            for r, pool in ((self.ours, self.pool_ours), (self.stock, self.pool_stock)):
                k = tvm.runtime.empty(shape(len(toks)), "float32", r.device)
                v = tvm.runtime.empty(shape(len(toks)), "float32", r.device)
                f(pool.handle, s, 0, len(toks), k, v)
                got.append((k.numpy(), v.numpy()))
            np.testing.assert_allclose(got[0][0], got[1][0], atol=ATOL, rtol=0)
            np.testing.assert_allclose(got[0][1], got[1][1], atol=ATOL, rtol=0)


def test_same_logits_as_stock_cache(tiny_models, stock_twins):
    hf, ours = tiny_models["gqa"]
    t = Twin(ours, stock_twins("gqa"), hf)
    for s in (0, 1, 2):
        t.add(s)
    t.forward({0: 7, 1: 20, 2: 3}, check_hf=True)  # ragged prefill, one sequence over a page
    for _ in range(3):
        t.forward({0: 1, 1: 1, 2: 1})
    t.fork(1, 3)           # at the end (23 tokens: a shared, partly filled page)
    t.fork(0, 4, 5)        # inside the first page
    t.fork(1, 5, 16)       # at a page boundary
    t.forward({3: 4, 0: 1, 4: 6, 5: 1}, check_hf=True)  # prefill and decode in one batch
    t.forward({1: 1, 3: 1, 5: 1})  # 1 and 3 append to the page they share: copy on write
    t.popn(1, 3)           # inside 1's own last page
    t.popn(3, 10)          # back into the full page shared with 1 and 5
    t.forward({1: 2, 3: 1, 4: 1, 5: 1}, check_hf=True)
    t.remove(0)            # 4 shares 0's first page
    t.remove(1)            # 3 and 5 share 1's pages
    for _ in range(2):
        t.forward({2: 1, 3: 1, 4: 1, 5: 1})
    t.forward({4: 17, 2: 1}, check_hf=True)
    t.check_kv_equal()
    for s in list(t.tokens):
        t.remove(s)
    assert t.pool_ours.available_pages() == t.pool_stock.available_pages()


def test_long_prompt_chunks_and_decode_match_hf(tiny_models, stock_twins):
    """Chunked prefill beyond several pages, then a decode batch of 8 (Llama-3 RoPE, GQA 4:1)."""
    hf, ours = tiny_models["llama3"]
    t = Twin(ours, stock_twins("llama3"), hf)
    for s in range(8):
        t.add(s)
    t.forward({0: 50, 1: 9})
    t.forward({0: 40, 2: 17, 3: 1}, check_hf=True)
    t.forward({s: 2 + s for s in range(8)})
    for _ in range(2):
        t.forward({s: 1 for s in range(8)}, check_hf=True)
    t.check_kv_equal()
