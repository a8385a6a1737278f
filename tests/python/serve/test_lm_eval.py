"""lm-evaluation-harness `local-completions` against `mlc_lora serve` with its default settings
(token-id prompts in a batch list, `echo` + `logprobs` for loglikelihoods, `max_tokens=1`), on
SmolLM2-135M, for the base model and an adapter (`model` = the adapter's name), over two small
local task files: a multiple-choice task and a generate task.

References: HF transformers (+ PEFT for the adapter) scoring the same token ids, and greedy
generation of the same prompts.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from ..models.test_smollm2 import hf_model  # noqa: F401  (module fixture: HF Llama with our weights)
from .conftest import run_server

pytestmark = pytest.mark.slow

ADAPTER = Path(__file__).resolve().parents[3] / "adapters" / "pirate"
MC_DOCS = [
    {"question": "What is the capital of France?", "choices": [" Paris", " London", " Berlin"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": [" six", " eight", " four"], "answer": 1},
    {"question": "Which colour is the sky on a clear day?", "choices": [" green", " red", " blue"], "answer": 2},
]
GEN_DOCS = [{"question": "The capital of France is", "answer": " Paris"},
            {"question": "The three primary colours are", "answer": " red"}]
MAX_GEN = 8
EOS = "<|im_end|>"  # SmolLM2-Instruct's end of turn: the server stops there
LOGPROB_TOL = 2e-3  # per continuation (a few tokens): float32 through 30 layers, different order


def _write_tasks(root: Path) -> None:
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN_DOCS))
    (root / "mlc_mc.yaml").write_text(f"""task: mlc_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (root / "mlc_gen.yaml").write_text(f"""task: mlc_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN}
  do_sample: false
metric_list:
  - metric: exact_match
""")


@pytest.fixture(scope="module")
def setup(smollm2_lora_compiled, tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("lm_eval")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(smollm2_lora_compiled / "tokenizer.json"))
    tok.save_pretrained(root / "tokenizer")
    (root / "tasks").mkdir()
    _write_tasks(root / "tasks")
    return root


@pytest.fixture(scope="module")
def server(smollm2_lora_compiled):
    with run_server(smollm2_lora_compiled, "--served-model-name", "smol", "--adapter", f"pirate={ADAPTER}") as url:
        yield url


def _evaluate(url: str, model: str, root: Path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = f"model={model},base_url={url}/v1/completions,tokenizer={root / 'tokenizer'}"
    return lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["mlc_mc", "mlc_gen"],
                                   task_manager=TaskManager(include_path=str(root / "tasks")),
                                   log_samples=True, num_fewshot=0)


def _reference(hf, tok, context: str, continuation: str) -> float:
    """HF's log-likelihood of `continuation` after `context`, on lm-eval's own token split."""
    import torch

    whole = tok(context + continuation, add_special_tokens=False).input_ids
    n_ctx = len(tok(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), -1)
    return float(sum(lp[i - 1, whole[i]] for i in range(n_ctx, len(whole))))


def _greedy(hf, tok, context: str) -> str:
    import torch

    ids = tok(context, add_special_tokens=False).input_ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_GEN, do_sample=False,
                          eos_token_id=tok.convert_tokens_to_ids(EOS))
    return tok.decode(out[0, len(ids):], skip_special_tokens=True).split("\n")[0]


@pytest.mark.parametrize("model", ["smol", "pirate"])
def test_lm_eval_local_completions(server, setup, hf_model, model, monkeypatch):  # noqa: F811
    import peft
    import transformers

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    root = setup
    out = _evaluate(server, model, root)
    tok = transformers.AutoTokenizer.from_pretrained(root / "tokenizer")
    ref = copy.deepcopy(hf_model)
    if model == "pirate":
        ref = peft.PeftModel.from_pretrained(ref, ADAPTER).eval()
    mc = out["samples"]["mlc_mc"]
    assert len(mc) == len(MC_DOCS)
    worst = 0.0
    for s in mc:
        assert len(s["resps"]) == len(s["doc"]["choices"])
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            ll = resp[0][0]
            want = _reference(ref, tok, context, continuation)
            assert math.isfinite(ll)
            worst = max(worst, abs(ll - want))
    assert worst < LOGPROB_TOL, worst
    acc = out["results"]["mlc_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    gen = out["samples"]["mlc_gen"]
    assert len(gen) == len(GEN_DOCS)
    for s in gen:
        context = s["arguments"][0][0]
        assert s["resps"][0][0] == _greedy(ref, tok, context), context
    print(f"{model}: acc {acc}, worst log-likelihood error {worst:.1e}, generations "
          f"{[s['resps'][0][0] for s in gen]}")
