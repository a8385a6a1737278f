"""A tiny random Llama with a real (byte-level BPE) tokenizer and SmolLM2's ChatML template."""

from __future__ import annotations

import json

import pytest

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 320
CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello, how are you today? I am fine, thank you.",
    "system user assistant You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "Continuous batching serves many requests at once; paged attention keeps the cache small.",
    "Ünïcödé tëxt and emoji 🙂 test the streaming detokenizer.",
] * 20


def make_tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
        "model_max_length": 512}))
    return tok


def make_chat_model(folder, seed=0):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=VOCAB,
                                   tie_word_embeddings=False, max_position_embeddings=512, rms_norm_eps=1e-5,
                                   bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the random init: fewer near-ties in greedy runs
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder, safe_serialization=True)
    make_tokenizer(folder)
    return model


@pytest.fixture(scope="session")
def tiny_chat_hf(tmp_path_factory):
    """(hf_model, its Hugging Face folder) of the tiny chat model."""
    hf_dir = tmp_path_factory.mktemp("tiny_chat") / "hf"
    return make_chat_model(hf_dir), hf_dir


@pytest.fixture(scope="session")
def tiny_chat(tiny_chat_hf, compile_once):
    """(hf_model, compiled_dir) of the tiny chat model, compiled for llvm once per run."""
    from mlc_lora.compile import CompileOptions

    model, hf_dir = tiny_chat_hf
    return model, compile_once(hf_dir, CompileOptions(prefill_chunk_size=128, max_batch_size=16))


@pytest.fixture(scope="module")
def engine(tiny_chat):
    from mlc_lora import MLCEngine

    with MLCEngine(tiny_chat[1], "cpu") as eng:
        yield eng
