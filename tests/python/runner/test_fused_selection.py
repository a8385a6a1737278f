"""Which batches the single-GPU runner sends to prefill_fused / decode_fused: those over the pool's
tables ("pool") whose adapters fit the compiled rank and slot columns, at any token count."""

import dataclasses
import gc
import types

import pytest

from mlc_lora.lora.layout import LoraModule, LoraSpec
from mlc_lora.runner import ModelRunner, Pool


class _Pool(Pool):  # the questions the runner asks the pool (the rest of Pool unused)
    num_shards = 1
    _run = _values = read_adapter = _add_adapter = set_adapter_host = None

    def __init__(self, slots, rank_total, generation=0):
        super().__init__(None, None)
        self.slots, self.total, self.generation = slots, rank_total, generation

    def lora_columns_generation(self):
        return self.generation

    def lora_tables(self):
        return ["tables"]

    def lora_num_slots(self):
        return self.slots

    def lora_rank_total(self):
        return self.total


def _runner(fused, fns=("prefill_fused", "decode_fused")):
    r = ModelRunner.__new__(ModelRunner)  # the selection needs no model
    spec = LoraSpec(num_layers=1, page_elems=64, modules=(LoraModule("q_proj", 64, 64),), max_rank=16,
                    pool_pages=8, kernel="sgmv")
    r.compiled = types.SimpleNamespace(lora=dataclasses.replace(spec, fused=fused))
    r._fused_fns = fns  # pylint: disable=protected-access
    r._fill_columns, r._filled, r.params = None, None, ["params"]  # pylint: disable=protected-access
    return r


LIMITS = {"rank_columns": 32, "slot_columns": 16}


@pytest.mark.parametrize("which,name", [(0, "prefill_fused"), (1, "decode_fused")])
def test_batches_within_the_columns_run_the_fused_functions(which, name):
    r = _runner(LIMITS)
    assert r._fused(_Pool(4, 32), "pool", which) == name  # 4 x r8
    assert r._fused(_Pool(1, 1), "pool", which) == name
    assert r._fused(_Pool(2, 33), "pool", which) is None  # ranks past the rank columns
    assert r._fused(_Pool(17, 17), "pool", which) is None  # adapters past the slot columns
    assert r._fused(_Pool(0, 0), "pool", which) is None  # no adapter: not a LoRA batch
    assert r._fused(_Pool(4, 32), {"lora_arena": None}, which) is None  # caller-given tables


def test_libraries_without_them_never_select_them():
    assert _runner(None, (None, None))._fused(_Pool(4, 32), "pool", 1) is None
    # a library with decode_fused only
    r = _runner(LIMITS, (None, "decode_fused"))
    assert r._fused(_Pool(4, 32), "pool", 0) is None and r._fused(_Pool(4, 32), "pool", 1) == "decode_fused"


def test_spare_columns_are_filled_when_the_kept_columns_change():
    """A library with spare columns (the rank columns route): before a fused batch the runner fills
    them with the pool's tables when the pool's kept columns changed since the last fill (its
    generation), or the batch is another pool's; not before other batches."""
    r = _runner(dict(LIMITS, spare_columns=True))
    calls = []
    r._fill_columns = lambda *args: calls.append(args)  # pylint: disable=protected-access
    p = _Pool(4, 32, generation=3)
    assert r._fused(p, "pool", 1) == "decode_fused" and calls == [("tables", ["params"])]
    assert r._fused(p, "pool", 0) == "prefill_fused" and len(calls) == 1  # same generation: no fill
    p.generation = 4
    assert r._fused(p, "pool", 1) == "decode_fused" and len(calls) == 2
    q = _Pool(2, 16, generation=4)  # another pool, the same generation number
    assert r._fused(q, "pool", 1) == "decode_fused" and len(calls) == 3
    assert r._fused(_Pool(2, 33, generation=9), "pool", 1) is None and len(calls) == 3  # not fused: no fill



def test_each_pool_has_its_own_serial_and_gets_its_own_fill():
    """The runner keys its fill by the pool's serial (unique in the process), not by id(), which
    CPython may hand a new pool after a freed one; a fresh pool starts at the same generation, so
    an id key could skip its fill and leave the spare columns holding the freed pool's adapters."""
    r = _runner(dict(LIMITS, spare_columns=True))
    calls = []
    r._fill_columns = lambda *args: calls.append(args)  # pylint: disable=protected-access
    serials = []
    for _ in range(3):
        p = _Pool(4, 32, generation=1)
        serials.append(p.serial)
        assert r._fused(p, "pool", 1) == "decode_fused"
        assert r._filled == (p.serial, 1)  # pylint: disable=protected-access
        del p
        gc.collect()
    assert len(set(serials)) == 3 and len(calls) == 3
