"""The C++ chat app must print exactly the Python greedy output for the same prompts.

  chat_parity.py prepare DIR     a tiny Llama (random weights) with a BPE tokenizer trained on
                                 ShareGPT and SmolLM2's ChatML template, compiled by mlc_lora into
                                 DIR/compiled and, with LoRA inputs, DIR/compiled_lora; the Python
                                 reference outputs go to DIR/expected.json
                                 two seeded random PEFT adapters go to DIR/adapters/{alpha,beta} and
                                 the LoRA reference (ModelRunner on the pool, adapters packed by
                                 mlc_lora.lora.pack_peft_adapter; and MLCEngine with the adapters
                                 loaded) to DIR/expected_lora.json
  chat_parity.py compare DIR --app PATH
                                 runs the app (batched, and with tiny batches and prefill chunks)
                                 and compares text and ids, on both builds
  chat_parity.py compare-adapters DIR --app PATH
                                 the app loads both adapters (Engine::LoadAdapter: the runtime's
                                 PEFT reader and packer) and runs one batch that mixes them and
                                 the base model; text and ids must be the Python ones
  chat_parity.py check MODEL_DIR --app PATH
                                 the same for any compiled model (e.g. SmolLM2): reference first

The Python reference is independent of the C++ code: jinja2 renders the chat template, the
`tokenizers` library encodes and decodes, ModelRunner runs one request at a time with numpy argmax.
The Python serving engine (MLCEngine, greedy, with the adapters loaded through its own API) must
give the same text too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a five year old, with an example in Python.",
    "hi",
    "List three colors: red, ... and what else? Ünïcödé too!",
    "Summarize the plot of Hamlet in two sentences.",
]
MAX_TOKENS = 24
# The adapter of each prompt in the mixed LoRA batch (None = the base model).
ADAPTER_OF = ["alpha", "beta", None, "beta", None, "alpha"]
ADAPTERS = {"alpha": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"]),
            "beta": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])}
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def prepare(root: Path) -> None:
    import torch
    import transformers
    from make_tokenizer_cases import sharegpt_messages, train_tiny

    from mlc_lora.compile import CompileOptions, compile_model

    hf = root / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    tok_json = train_tiny(sharegpt_messages(120), vocab_size=600)
    (hf / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    vocab = len(json.loads(tok_json)["model"]["vocab"])
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": SMOLLM2_TEMPLATE, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "add_bos_token": False}))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=vocab,
                                   max_position_embeddings=512, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the 0.02-std init: fewer near-ties, varied text
        for p in model.parameters():
            p.mul_(4.0)
    model.save_pretrained(hf, safe_serialization=True)
    compile_model(hf, root / "compiled", CompileOptions(prefill_chunk_size=128, max_batch_size=8), progress=False)
    # The same model with LoRA table inputs: its base-model output must not change.
    compile_model(hf, root / "compiled_lora", CompileOptions(prefill_chunk_size=128, max_batch_size=8,
                                                             max_lora_rank=8, lora_pool_pages=64), progress=False)
    (root / "expected.json").write_text(json.dumps(reference(root / "compiled"), ensure_ascii=False, indent=1))
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        import peft

        torch.manual_seed(50 + i)
        pm = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(hf), peft.LoraConfig(**kw))
        with torch.no_grad():  # PEFT starts B at zero; random B makes the adapter change the text
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.5 * torch.randn_like(p))
        pm.save_pretrained(root / "adapters" / name)
    lora = reference(root / "compiled_lora", adapters={n: root / "adapters" / n for n in ADAPTERS},
                     adapter_of=ADAPTER_OF)
    base = json.loads((root / "expected.json").read_text())
    for name in ADAPTERS:  # the adapters must matter, or the check below proves nothing
        changed = [i for i, a in enumerate(ADAPTER_OF) if a == name and lora[i]["output_ids"] != base[i]["output_ids"]]
        assert changed, f"adapter {name} does not change any greedy output"
    (root / "expected_lora.json").write_text(json.dumps(lora, ensure_ascii=False, indent=1))
    print(f"compiled a tiny Llama (vocab {vocab}) into {root / 'compiled'}")


def reference(model_dir: Path, prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS,
              adapters: dict[str, Path] | None = None, adapter_of: list[str | None] | None = None,
              engine: bool = True) -> list[dict]:
    """One request at a time. With `adapters`, prompt i runs with adapter_of[i] through the pool:
    pack_peft_adapter -> Pool.load_packed_adapter, Pool.set_sequence_adapter, prefill/decode(lora="pool")."""
    import jinja2
    import numpy as np
    import tokenizers

    from mlc_lora.lora import pack_peft_adapter
    from mlc_lora.runner import ModelRunner

    cfg = json.loads((model_dir / "mlc-lora-config.json").read_text())
    tok = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # as transformers renders chat templates
    template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(cfg["tokenizer"]["chat_template"])
    eos = cfg["tokenizer"]["eos_token_id"]
    stop = set(eos if isinstance(eos, list) else [eos]) | {tok.token_to_id(cfg["tokenizer"]["eos_token"])}
    runner = ModelRunner(model_dir)
    out = []
    for i, prompt in enumerate(prompts):
        text = template.render(messages=[{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False).ids
        lora = None
        if runner.lora:  # the cache must have exactly pool_pages pages (the compiled arena)
            kv = runner.create_pool(1, (runner.lora.pool_pages - 1) * 16)
            lora = "pool"
        else:
            kv = runner.create_pool(1, 512)
        kv.add_sequence(i)
        name = adapter_of[i] if adapter_of else None
        if name is not None:
            p = pack_peft_adapter(adapters[name], cfg, name)
            kv.load_packed_adapter(0, p, False)
        if runner.lora:
            kv.set_sequence_adapter(i, None if name is None else 0)
        logits = runner.prefill(kv, [i], [ids], lora=lora).numpy()
        gen, finish = [], "length"
        while True:
            nxt = int(np.argmax(logits[0]))
            if nxt in stop:
                finish = "stop"
                break
            gen.append(nxt)
            if len(gen) == max_tokens:
                break
            logits = runner.decode(kv, [i], [nxt], lora=lora).numpy()
        out.append({"prompt": prompt, "adapter": name, "max_tokens": max_tokens, "prompt_ids": ids, "output_ids": gen, "finish_reason": finish,
                    "text": tok.decode(gen, skip_special_tokens=True)})
    del runner
    if engine:
        engine_outputs(model_dir, out, adapters)
    return out


def engine_outputs(model_dir: Path, expected: list[dict], adapters: dict[str, Path] | None = None) -> None:
    """The Python serving engine's greedy answers (continuous batching, on-device argmax; each
    request with its `adapter`, loaded by MLCEngine.load_adapter) must agree with the plain
    reference; they are kept as `engine_text` and checked again in compare."""
    import jinja2.ext  # noqa: F401  mlc_lora.tokenizer uses jinja2.ext without importing it

    from mlc_lora.engine import MLCEngine

    with MLCEngine(model_dir) as eng:
        for name, path in (adapters or {}).items():
            eng.load_adapter(name, path)
        for want in expected:
            r = eng.chat.completions.create(messages=[{"role": "user", "content": want["prompt"]}],
                                            max_tokens=want["max_tokens"], temperature=0,
                                            adapter_id=want.get("adapter"))
            want["engine_text"] = r.choices[0].message.content
            want["engine_finish_reason"] = r.choices[0].finish_reason


def compare(model_dir: Path, expected: list[dict], app: str, adapters: dict[str, Path] | None = None) -> int:
    """With `adapters`: the app loads them and runs one batch mixing them (each prompt's
    `adapter`) and the base model; the references are ModelRunner + pool and MLCEngine."""
    failures = 0
    for extra in ([], ["--max-batch", "2", "--prefill-chunk", "16"]):
        cmd = [app, str(model_dir), "--json", "--max-tokens", str(expected[0]["max_tokens"]), *extra]
        for name, d in (adapters or {}).items():
            cmd += ["--adapter", f"{name}={d}"]
        for want in expected:
            if adapters:
                cmd += ["--use", want["adapter"] or "-"]
            cmd += ["--prompt", want["prompt"]]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"app failed on {model_dir} ({' '.join(extra) or 'defaults'}):\n{proc.stderr}")
            return 1
        got = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
        for want, have in zip(expected, got, strict=True):
            engine_text, engine_finish = want["engine_text"], want["engine_finish_reason"]
            same = have["text"] == want["text"] == engine_text and have["output_ids"] == want["output_ids"] \
                and have["finish_reason"] == want["finish_reason"] == engine_finish
            failures += not same
            tag = f" adapter={want.get('adapter')}" if adapters else ""
            print(f"{'ok  ' if same else 'DIFF'} [{model_dir.name}{tag} {' '.join(extra) or 'batched'}] {want['prompt'][:40]!r}: "
                  f"{len(want['output_ids'])} tokens ({want['finish_reason']})")
            if not same:
                print(f"   python: {want['text']!r} {want['output_ids']}\n   engine: {engine_text!r}\n"
                      f"   c++:    {have['text']!r} {have['output_ids']}")
        print(proc.stderr.strip())
    if adapters:
        print("PASSED" if failures == 0 else f"FAILED ({failures} differences)")
        return 1 if failures else 0
    # Interactive mode streams the same text for a first turn.
    first = expected[0]
    proc = subprocess.run([app, str(model_dir), "--max-tokens", str(first["max_tokens"])], input=first["prompt"] + "\n/quit\n",
                          capture_output=True, text=True, check=False)
    streamed = proc.stdout.removeprefix("> ").removesuffix("> ").removesuffix("\n")
    same = proc.returncode == 0 and streamed == first["text"]
    failures += not same
    print(f"{'ok  ' if same else 'DIFF'} [interactive, streamed] {first['prompt'][:40]!r}")
    if not same:
        print(f"   python: {first['text']!r}\n   c++:    {streamed!r}\n{proc.stderr}")
    print("PASSED" if failures == 0 else f"FAILED ({failures} differences)")
    return 1 if failures else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["prepare", "compare", "compare-adapters", "check"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--app")
    ap.add_argument("--num-prompts", type=int, default=len(PROMPTS), help="check mode: the first N prompts")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="check mode")
    args = ap.parse_args()
    if args.mode == "prepare":
        prepare(args.dir)
        return 0
    if args.mode == "check":
        return compare(args.dir, reference(args.dir, PROMPTS[: args.num_prompts], args.max_tokens), args.app)
    if args.mode == "compare-adapters":
        expected_lora = json.loads((args.dir / "expected_lora.json").read_text())
        adapters = {n: args.dir / "adapters" / n for n in ADAPTERS}
        return compare(args.dir / "compiled_lora", expected_lora, args.app, adapters)
    expected = json.loads((args.dir / "expected.json").read_text())
    return compare(args.dir / "compiled", expected, args.app) or compare(args.dir / "compiled_lora", expected, args.app)


if __name__ == "__main__":
    sys.exit(main())
