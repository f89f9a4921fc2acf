"""An adapter trained on a tiny task (bench/lora_train.py: SmolLM2-135M-Instruct taught to talk like a
pirate), served by `tandem up --enable-lora` and asked through the official `openai` client: the base
model's answers to held-out questions show none of it, the adapter's all do, and the adapter's
tokens equal Hugging Face transformers + PEFT's (fp32, greedy). Slow: training takes minutes; the
adapter is kept under Tandem's cache dir, keyed by the script's content and the library versions,
so a rerun reuses it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch

from tandem.engine.models.source import default_cache_dir, resolve_model
from tests.e2e.stack import ROOT, Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

SCRIPT = ROOT / "bench" / "lora_train.py"
MAX_TOKENS = 32
PIRATE_WORDS = re.compile(r"\b(be|ye|yer|aye|fer)\b|\bo'")    # what the adapter says that English does not


@pytest.fixture(scope="module")
def pirate() -> Path:
    import peft
    import transformers

    key = hashlib.sha256(SCRIPT.read_bytes() + f"{torch.__version__} {peft.__version__} {transformers.__version__}"
                         .encode()).hexdigest()[:16]
    out = default_cache_dir() / "lora-train" / key
    if not (out / "lora_train.json").is_file():
        tmp = out.with_name(f"{key}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        # run by path, not `-m tandem.bench.lora_train`: the script of this checkout is the one keyed
        subprocess.run([sys.executable, "-P", str(SCRIPT), "--out", str(tmp)], check=True, timeout=1800)
        try:
            tmp.rename(out)
        except OSError:          # another run made it meanwhile (only whole folders are renamed into place)
            shutil.rmtree(tmp)
    return out


def ask(client: openai.OpenAI, model: str, question: str) -> tuple[str, list[str]]:
    """The greedy answer's text and its tokens (as the logprobs show them)."""
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                       max_tokens=MAX_TOKENS, temperature=0, logprobs=True)
    choice = r.choices[0]
    return choice.message.content, [t.token for t in choice.logprobs.content]


def hf_answers(model_dir: Path, adapter: Path, questions: list[str]) -> dict[str, list[str]]:
    """The adapter's greedy tokens from transformers + PEFT, each question alone, fp32 (as text, one by one)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                      adapter).eval()
    out = {}
    for q in questions:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
        with torch.no_grad():
            new = model.generate(input_ids=ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in new:      # the end token is the last one (Tandem's logprobs show it too)
            new = new[:new.index(tok.eos_token_id) + 1]
        out[q] = [tok.decode([i]) for i in new]
    return out


def test_the_trained_adapter_talks_like_a_pirate_and_the_base_model_does_not(pirate):
    questions = json.loads((pirate / "lora_train.json").read_text())["held_out"]
    stack = Stack("--model", "smollm2-135m", "--dtype", "float32", "--kv-cache-gb", "0.25", "--enable-lora",
                  "--lora-modules", f"pirate={pirate}", gateway=True, timeout_s=600)
    try:
        with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            parents = {m.id: m.model_extra.get("parent") for m in c.models.list()}
            base_id = next(m for m, parent in parents.items() if parent is None)
            assert parents["pirate"] == base_id
            base = {q: ask(c, base_id, q) for q in questions}
            tuned = {q: ask(c, "pirate", q) for q in questions}
    finally:
        stack.close()
    report = "\n".join(f"{q}\n  base:    {base[q][0]!r}\n  adapter: {tuned[q][0]!r}" for q in questions)
    for q in questions:
        assert not base[q][0].startswith("Arr") and "matey" not in base[q][0].lower(), report
        assert tuned[q][0].startswith("Arr, matey!"), report
        assert PIRATE_WORDS.search(tuned[q][0].removeprefix("Arr, matey!")), report    # not only the greeting
    assert "Paris" in tuned["What is the capital of France?"][0], report   # what it says is still the base model's
    hf = hf_answers(resolve_model("smollm2-135m"), pirate, questions)
    for q in questions:
        assert tuned[q][1] == hf[q], f"{q}\n  tandem: {tuned[q][1]}\n  hf:     {hf[q]}"
