"""Fixtures of the runtime tests: the tiny models compiled a second time with TVM's own KV cache."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def stock_twins(tiny_models, tmp_path_factory):
    """name -> compiled dir identical to tiny_models[name] except for TVM's stock paged KV cache."""
    from mlc_lora.compile import CompileOptions, export_model, make_target
    from mlc_lora.compiler_passes import get_pipeline
    from mlc_lora.models import llama
    from mlc_lora.runner import ModelRunner
    import tvm

    cache = {}

    def get(name: str):
        if name not in cache:
            _, ours = tiny_models[name]
            out = tmp_path_factory.mktemp(f"{name}-stock")
            for f in ours.iterdir():
                shutil.copy(f, out / f.name)
            r = ModelRunner(ours)
            cfg = llama.LlamaConfig(**r.model_config)
            target = make_target(CompileOptions())
            mod, _ = export_model(llama, cfg, r.dtype, target)
            with target:
                ex = tvm.compile(mod, target, relax_pipeline=get_pipeline(target, stock_kv_cache=True))
            ex.export_library(str(out / r.config["library"]))
            cache[name] = out
        return cache[name]

    return get
