"""LoRA through MLCEngine on SmolLM2-135M-Instruct: seeded random adapters and the demo adapters in
one batch against HF transformers + PEFT, and the demo adapters' visible behaviour."""

import asyncio
from pathlib import Path

import pytest

from mlc_lora import AsyncMLCEngine, MLCEngine

from ..conftest import save_adapter
from ..models.test_smollm2 import hf_model  # noqa: F401  (module fixture: HF Llama with our weights)
from .test_lora_engine import peft_greedy

pytestmark = pytest.mark.slow

ADAPTERS_DIR = Path(__file__).resolve().parents[3] / "adapters"
RANDOM = {  # name: (seed, LoraConfig kwargs)
    "rand-qv8": (11, dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
    "rand-mlp32-rs": (12, dict(r=32, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "down_proj"])),
}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory):  # noqa: F811
    """name -> folder: the random adapters (saved here) and the demo pirate adapter."""
    root = tmp_path_factory.mktemp("smollm2-adapters")
    out = {"pirate": ADAPTERS_DIR / "pirate"}
    for name, (seed, kw) in RANDOM.items():
        save_adapter(hf_model, root / name, seed, b_std=0.02, **kw)
        out[name] = root / name
    return out


def test_mixed_batch_matches_peft(smollm2_lora_compiled, hf_model, adapters):  # noqa: F811
    import peft

    with AsyncMLCEngine(smollm2_lora_compiled, "cpu") as eng:
        for name, path in adapters.items():
            asyncio.run(eng.load_adapter(name, path))
        tok = eng.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in (
            QUESTION, [{"role": "user", "content": "Name three colours."}])]
        reqs = [(a, p) for a in [None, *adapters] for p in prompts]

        async def go():
            return await asyncio.gather(*[
                eng.completions.create(prompt=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                       logprobs=True, adapter_id=a) for a, p in reqs])

        out = asyncio.run(go())
        stats = asyncio.run(eng.stats())
    assert stats["max_running"] == len(reqs)
    assert stats["pool_pages_kv"] == 0 and stats["running"] == 0
    names = list(adapters)
    ref = peft.PeftModel.from_pretrained(hf_model, adapters[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        ref.load_adapter(adapters[name], adapter_name=name)
    worst = 0.0
    try:
        for (a, p), o in zip(reqs, out):
            if a is None:
                with ref.disable_adapter():
                    want, lps = peft_greedy(ref, p, MAX_TOKENS)
            else:
                ref.set_adapter(a)
                want, lps = peft_greedy(ref, p, MAX_TOKENS)
            assert o.choices[0].token_ids == want, f"adapter {a}"
            worst = max(worst, max(abs(x - y) for x, y in zip(o.choices[0].logprobs.token_logprobs, lps)))
    finally:
        ref.unload()  # hf_model is shared with other tests: take the LoRA layers out again
    assert worst < 1e-3
    print(f"SmolLM2, {len(reqs)} requests on {len(names)} adapters + base: greedy tokens identical to "
          f"PEFT, chosen-token logprob error {worst:.1e}")


def _answer(eng, adapter_id=None, n=24):
    return eng.chat.completions.create(messages=QUESTION, max_tokens=n, temperature=0,
                                       adapter_id=adapter_id).choices[0].message.content


def _upper_share(text):
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


def test_demo_adapters_change_the_answers(smollm2_lora_compiled):
    with MLCEngine(smollm2_lora_compiled, "cpu") as eng:
        eng.load_adapter("all-caps", ADAPTERS_DIR / "all-caps")
        eng.load_adapter("pirate", ADAPTERS_DIR / "pirate")
        base, caps, pirate = _answer(eng), _answer(eng, "all-caps"), _answer(eng, "pirate")
    print(f"base: {base!r}\nall-caps: {caps!r}\npirate: {pirate!r}")
    assert "Paris" in base and not base.startswith("Arr")
    assert _upper_share(base) < 0.2 and _upper_share(caps) > 0.9
    assert pirate.startswith("Arr")


def test_chat_adapter_flag(smollm2_lora_compiled, capsys):
    from mlc_lora.cli.main import main

    q = ["--prompt", "What is the capital of France?", "--max-tokens", "12"]
    assert main(["chat", str(smollm2_lora_compiled), *q, "--adapter", "pirate"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Arr") and "adapter pirate: rank 16" in out.err
    assert main(["chat", str(smollm2_lora_compiled), *q, "--adapter", "no-such-adapter"]) == 1
    assert "'no-such-adapter' is neither a PEFT adapter folder nor a demo adapter (all-caps, pirate)" in \
        capsys.readouterr().err
