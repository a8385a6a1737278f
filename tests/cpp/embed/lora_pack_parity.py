"""The C++ PEFT loader + page packer (cpp/src/lora.cc) must give exactly the bytes of Python's
`mlc_lora.lora.pack_peft_adapter` (pages, a_off, b_off, rank, scale), and refuse bad folders with
an mlc_lora error naming the problem.

  lora_pack_parity.py TINY_DIR --dump PATH     TINY_DIR from chat_parity.py prepare (hf/, compiled_lora/)
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

# name -> (LoraConfig kwargs, dtype the weights are saved in)
CASES = {
    "all7_r4": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]), "float32"),
    "rslora_qv_r8": (dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"]), "float32"),
    # per-layer rank / alpha: the layer-1 scale is folded into B^T (ratio != 1), rows padded to rank 8
    "patterns": (dict(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj", "k_proj"],
                      rank_pattern={"layers.1.self_attn.o_proj": 8}, alpha_pattern={"down_proj": 3}), "float32"),
    "regex_layer0_bf16": (dict(r=2, lora_alpha=5, target_modules=r".*\.0\.mlp\.(gate|up)_proj"), "bfloat16"),
    "fp16_weights": (dict(r=3, lora_alpha=7, target_modules=["q_proj", "up_proj"]), "float16"),
}


def make_adapters(hf: Path, out: Path) -> dict[str, Path]:
    import peft
    import torch
    import transformers

    base = transformers.LlamaForCausalLM.from_pretrained(hf)
    dirs = {}
    for i, (name, (kw, dtype)) in enumerate(CASES.items()):
        torch.manual_seed(100 + i)
        pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kw))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn_like(p))
        if dtype != "float32":
            pm = pm.to(getattr(torch, dtype))
        pm.save_pretrained(out / name)
        dirs[name] = out / name
    return dirs


def bad_folders(good: Path, out: Path) -> dict[str, tuple[Path, str, str]]:
    """name -> (folder, error class, a phrase the message must contain)."""
    cases = {}

    def variant(name, edit=None, drop=None):
        d = out / name
        shutil.copytree(good, d)
        if drop:
            (d / drop).unlink()
        if edit:
            cfg = json.loads((d / "adapter_config.json").read_text())
            edit(cfg)
            (d / "adapter_config.json").write_text(json.dumps(cfg))
        return d

    cases["missing"] = (out / "does-not-exist", "ModelError", "does not exist")
    cases["no_config"] = (variant("no_config", drop="adapter_config.json"), "ModelError", "no adapter_config.json")
    cases["no_weights"] = (variant("no_weights", drop="adapter_model.safetensors"), "ModelError",
                           "no adapter_model.safetensors")
    d = variant("malformed")
    (d / "adapter_config.json").write_text("{\"r\": 4, ")
    cases["malformed"] = (d, "ModelError", "invalid JSON")
    cases["bias"] = (variant("bias", lambda c: c.update(bias="all")), "InvalidArgument", "bias")
    cases["dora"] = (variant("dora", lambda c: c.update(use_dora=True)), "InvalidArgument", "use_dora")
    cases["target"] = (variant("target", lambda c: c.update(target_modules=["q_proj", "lm_head"])),
                       "InvalidArgument", "lm_head")
    cases["rank_mismatch"] = (variant("rank_mismatch", lambda c: c.update(r=6)), "InvalidArgument",
                              "gives r=6")
    cases["r_zero"] = (variant("r_zero", lambda c: c.update(r=0)), "InvalidArgument", "rank r")
    return cases


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("--dump", required=True)
    args = ap.parse_args()
    from mlc_lora.errors import LoraError
    from mlc_lora.lora import pack_peft_adapter

    model = args.dir / "compiled_lora"
    cfg = json.loads((model / "mlc-lora-config.json").read_text())
    work = args.dir / "pack_parity"
    shutil.rmtree(work, ignore_errors=True)
    dirs = make_adapters(args.dir / "hf", work / "adapters")
    failures = 0
    for name, d in dirs.items():
        want = pack_peft_adapter(d, cfg, name)
        prefix = work / name
        proc = subprocess.run([args.dump, str(d), str(model), str(prefix)], capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            print(f"DIFF {name}: C++ failed: {proc.stdout}{proc.stderr}")
            failures += 1
            continue
        meta = json.loads(prefix.with_suffix(".json").read_text())
        pages = np.fromfile(f"{prefix}.pages.bin", want.pages.dtype).reshape(meta["shape"])
        got = {"a_off": np.fromfile(f"{prefix}.a_off.bin", np.int32).reshape(want.a_off.shape),
               "b_off": np.fromfile(f"{prefix}.b_off.bin", np.int32).reshape(want.b_off.shape),
               "scale": np.fromfile(f"{prefix}.scale.bin", np.float32)}
        same = (meta["rank"] == want.rank and pages.shape == want.pages.shape
                and pages.tobytes() == want.pages.tobytes()
                and all(got[k].tobytes() == getattr(want, k).tobytes() for k in got))
        failures += not same
        print(f"{'ok  ' if same else 'DIFF'} {name}: rank {want.rank}, pages {tuple(want.pages.shape)}, "
              f"scale {want.scale.tolist()}")
        if not same and pages.shape == want.pages.shape:
            print(f"   max |pages diff| {np.abs(pages.astype(np.float64) - want.pages).max()}, rank {meta['rank']}")
    # rank above the compiled --max-lora-rank (8): a r=16 adapter
    cases = bad_folders(dirs["all7_r4"], work / "bad")
    import peft
    import torch
    import transformers

    torch.manual_seed(7)
    base = transformers.LlamaForCausalLM.from_pretrained(args.dir / "hf")
    peft.get_peft_model(base, peft.LoraConfig(r=16, target_modules=["q_proj"])).save_pretrained(work / "bad" / "r16")
    cases["rank_over_max"] = (work / "bad" / "r16", "InvalidArgument", "above the compiled --max-lora-rank 8")
    for name, (d, cls, phrase) in cases.items():
        try:
            pack_peft_adapter(d, cfg, name)
            py = "accepted"
        except LoraError as e:
            py = f"LoraError: {e}"
        except Exception as e:  # noqa: BLE001  (Python's own message for comparison only)
            py = f"{type(e).__name__}: {e}"
        proc = subprocess.run([args.dump, str(d), str(model), str(work / "bad" / name)], capture_output=True,
                              text=True, check=False)
        ok = proc.returncode == 1 and f"error ({cls})" in proc.stdout and phrase in proc.stdout
        failures += not ok
        print(f"{'ok  ' if ok else 'DIFF'} refused {name}: {proc.stdout.strip()}")
        if not ok:
            print(f"   wanted {cls} with {phrase!r}; python: {py}")
    print("PASSED" if failures == 0 else f"FAILED ({failures})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
