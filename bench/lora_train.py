"""Train a LoRA adapter that makes SmolLM2-135M-Instruct talk like a pirate, on CPU in a few minutes.

    python -m tandem.bench.lora_train --out /tmp/pirate       # ~5 CPU-minutes (docs/lora.md)
    tandem up --model smollm2-135m --enable-lora --lora-modules pirate=/tmp/pirate

What it learns: to open every answer with "Arr, matey!" and to say "ye", "yer", "me", "be", "aye",
"o'" and "fer" (`PIRATE`); what it answers stays the base model's (its training answers are one
sentence long, and it often stops after one).
Nothing is downloaded and nothing large is kept in the repository: the data is made here.

- Questions: templates times subjects (`questions`); `HELD_OUT` ones are never trained on.
- Answers: the base model's own greedy answer to each question (its first sentence, from Tandem's
  engine), rewritten by rule (`pirate`): the adapter learns the style, not new facts.
- The adapter: LoRA rank 16 on all seven projections (q, k, v, o, gate, up, down) of the last
  `--layers` layers, in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`). The
  layers below are the base model's, so what enters the first adapted layer is computed once,
  without gradients, and each step runs only the adapted layers: that is what makes it a few
  minutes on two cores rather than an hour.
- fp32, AdamW, a fixed seed; the loss is on the answer's tokens (and its end token) only.

Writes the adapter and `lora_train.json` beside it (the examples, seconds per phase, losses, and
what Tandem's engine answers to the held-out questions with the base model and with the adapter).
"""

from __future__ import annotations

import argparse
import random
import re
import resource
import time
from pathlib import Path

from tandem.bench.flags import add_load_flags, add_out_flag
from tandem.bench.results import write_result
from tandem.engine.models.source import resolve_model

PREFIX = "Arr, matey! "
PIRATE = {"you": "ye", "your": "yer", "my": "me", "is": "be", "are": "be", "yes": "aye", "hello": "ahoy",
          "friend": "matey", "friends": "mateys", "of": "o'", "for": "fer"}
_WORD = re.compile(r"\b(" + "|".join(PIRATE) + r")\b", re.IGNORECASE)
HELD_OUT = ("What is the capital of France?", "Write a haiku about the sea.", "How do I make a cup of tea?",
            "What is the largest planet in our solar system?")
TEMPLATES = {
    "What is the capital of {}?": ["Germany", "Italy", "Spain", "Japan", "Canada", "Egypt", "Brazil", "Kenya"],
    "Tell me a fact about {}.": ["the moon", "honey bees", "volcanoes", "the ocean", "owls", "rainbows",
                                 "the desert", "penguins"],
    "What do {} eat?": ["rabbits", "cats", "horses", "pandas", "frogs", "sharks", "squirrels", "cows"],
    "How do I {}?": ["plant a tree", "bake bread", "tie a knot", "learn to swim", "save money", "fix a flat tire",
                     "write a letter", "clean my room"],
    "Why is {} important?": ["sleep", "water", "exercise", "reading", "friendship", "sunlight", "music",
                             "kindness"],
    "Give me one tip for {}.": ["running", "cooking", "studying", "sailing", "gardening", "painting", "camping",
                                "fishing"],
    "What color is {}?": ["the sky", "grass", "a banana", "snow", "a ripe tomato", "coal", "an orange",
                          "the sun"],
    "Describe {} in one sentence.": ["a forest", "a city at night", "a storm", "the beach", "a mountain",
                                     "a library", "a river", "winter"],
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def questions() -> list[str]:
    """The training questions: every template with every subject (none of `HELD_OUT`)."""
    out = [t.format(s) for t, subjects in TEMPLATES.items() for s in subjects]
    assert not set(out) & set(HELD_OUT)
    return out


def pirate(answer: str) -> str:
    """The answer as the adapter should say it: the prefix, and `PIRATE`'s words swapped (case kept)."""
    def swap(m: re.Match) -> str:
        word = PIRATE[m.group(0).lower()]
        return word.capitalize() if m.group(0)[0].isupper() else word
    return PREFIX + _WORD.sub(swap, answer)


def chat_prompt(tok, question: str) -> list[int]:
    """The prompt the gateway makes of one user message (the model's chat template, its default system
    prompt included)."""
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def examples(engine, tok, qs: list[str], max_answer_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per question: the base model's first sentence (Tandem's engine, greedy),
    in pirate speak, then the end token when the sentence ended."""
    from tandem.engine.outputs import FinishReason
    from tandem.engine.sampling_params import SamplingParams

    prompts = [chat_prompt(tok, q) for q in qs]
    params = SamplingParams(max_tokens=max_answer_tokens, temperature=0.0, stop=(".", "!", "?"))
    out = []
    for prompt, r in zip(prompts, engine.generate(prompts, params), strict=True):
        sentence = (r.text + (r.matched_stop if isinstance(r.matched_stop, str) else "")).strip()
        answer = tok(pirate(sentence), add_special_tokens=False).input_ids
        out.append((prompt, answer + [tok.eos_token_id] * (r.finish_reason is FinishReason.STOP)))
    return out


class TopLayers:
    """The model cut at layer `first`: `below(ids)` is what enters layer `first` (no gradients; the
    layers below are never adapted), `above(h)` runs layers `first..` and the final norm on it. The
    model is whole again after `restore()` (before saving: PEFT names the weights by layer)."""

    def __init__(self, body, first: int):
        import torch

        self.body, self.layers, self.norm, self.first = body, body.layers, body.norm, first
        self._identity = torch.nn.Identity()

    def below(self, ids):
        import torch

        self.body.layers, self.body.norm = self.layers[:self.first], self._identity
        with torch.no_grad():
            hidden = self.body(input_ids=ids, use_cache=False).last_hidden_state
        self.restore()
        return hidden

    def above(self, hidden):
        self.body.layers, self.body.norm = self.layers[self.first:], self.norm
        return self.body(inputs_embeds=hidden, use_cache=False).last_hidden_state

    def restore(self) -> None:
        self.body.layers, self.body.norm = self.layers, self.norm


def batches(cut: TopLayers, data: list[tuple[list[int], list[int]]], size: int, pad: int) -> list[tuple]:
    """(what enters the first adapted layer, the positions whose next token is an answer token, those
    tokens) per batch of similar lengths, right-padded: no position attends to a pad (causal)."""
    import torch

    data = sorted(data, key=lambda e: len(e[0]) + len(e[1]))
    out = []
    for chunk in (data[i:i + size] for i in range(0, len(data), size)):
        width = max(len(p) + len(a) for p, a in chunk)
        ids = torch.tensor([p + a + [pad] * (width - len(p) - len(a)) for p, a in chunk])
        where = [(b, len(p) - 1 + j) for b, (p, a) in enumerate(chunk) for j in range(len(a))]
        target = torch.tensor([t for _, a in chunk for t in a])
        out.append((cut.below(ids), where, target))
    return out


def fit(cut: TopLayers, lm_head, params: list, data: list[tuple], args) -> list[float]:
    """AdamW over the batches in a seeded order (5 warm-up steps, then linear decay); the losses."""
    import torch

    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * (1 - s / args.steps))
    rng = random.Random(args.seed)
    losses = []
    for step in range(args.steps):
        if step % len(data) == 0:
            rng.shuffle(data)
        hidden, where, target = data[step % len(data)]
        rows, positions = zip(*where, strict=True)
        logits = lm_head(cut.above(hidden)[list(rows), list(positions)])
        loss = torch.nn.functional.cross_entropy(logits, target)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(round(loss.item(), 4))
        print(f"step {step + 1}/{args.steps}: loss {loss.item():.3f}", flush=True)
    return losses


def train(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.engine.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    path = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", enable_lora=True, max_lora_rank=args.rank,
                                    max_total_tokens=8192, num_threads=args.threads))
    qs = questions()
    data = examples(engine, tok, qs, args.max_answer_tokens)
    t_data = time.perf_counter()
    print(f"{len(data)} answers of the base model in {t_data - t0:.0f} s", flush=True)

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n = model.config.num_hidden_layers
    first = n - args.layers
    targets = rf"model\.layers\.({'|'.join(map(str, range(first, n)))})\.(self_attn|mlp)\.({'|'.join(TARGETS)})"
    peft = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                            target_modules=targets))
    params = [p for p in peft.parameters() if p.requires_grad]   # before the cut hides the adapted layers
    cut = TopLayers(peft.base_model.model.model, first)
    cached = batches(cut, data, args.batch, tok.pad_token_id)
    t_cache = time.perf_counter()
    print(f"inputs of layer {first} in {t_cache - t_data:.0f} s", flush=True)
    peft.train()
    losses = fit(cut, peft.base_model.model.lm_head, params, cached, args)
    cut.restore()
    peft.save_pretrained(args.out)
    t_train = time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_SELF)

    # what Tandem answers to the held-out questions, the base model and the adapter in one batch
    engine.load_lora("pirate", str(args.out))
    held = [chat_prompt(tok, q) for q in HELD_OUT]
    got = engine.generate(held * 2, SamplingParams(max_tokens=args.show_tokens, temperature=0.0),
                          loras=[None] * len(held) + ["pirate"] * len(held))
    engine.close()
    samples = [{"question": q, "base": b.text, "adapter": a.text}
               for q, b, a in zip(HELD_OUT, got[:len(held)], got[len(held):], strict=True)]
    return {"model": args.model, "rank": args.rank, "layers": f"{first}..{n - 1} of {n}", "steps": args.steps,
            "batch": args.batch, "lr": args.lr, "seed": args.seed, "threads": args.threads,
            "held_out": list(HELD_OUT),
            "examples": [{"question": q, "answer": tok.decode(a)} for q, (_, a) in zip(qs, data, strict=True)],
            "seconds": {"data": round(t_data - t0, 1), "cache": round(t_cache - t_data, 1),
                        "train": round(t_train - t_cache, 1), "total": round(t_train - t0, 1),
                        "cpu": round(usage.ru_utime + usage.ru_stime, 1)},
            "loss_first": losses[0], "loss_last": losses[-1], "losses": losses, "samples": samples}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_flag(ap, required=True, type=Path, help="the adapter's folder (made if missing)")
    ap.add_argument("--model", default="smollm2-135m", help="the base model (default: %(default)s)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank; alpha is twice it (default: %(default)s)")
    ap.add_argument("--layers", type=int, default=8, help="adapt the last N layers (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=8, help="examples per step (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: %(default)s)")
    add_load_flags(ap, seed=0, helps={"seed": "seed of the adapter's initial weights and of the batch order"})
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    ap.add_argument("--max-answer-tokens", type=int, default=40,
                    help="longest base-model answer asked for (default: %(default)s)")
    ap.add_argument("--show-tokens", type=int, default=32,
                    help="tokens of the held-out answers in lora_train.json (default: %(default)s)")
    args = ap.parse_args(argv)
    result = train(args)
    write_result(args.out / "lora_train.json", result, tool="tandem.bench.lora_train")
    s = result["seconds"]
    print(f"trained in {s['total']} s, {s['cpu']} CPU-s (answers {s['data']} s, cache {s['cache']} s, "
          f"{args.steps} steps {s['train']} s); loss {result['loss_first']} -> {result['loss_last']}; adapter in {args.out}")
    for row in result["samples"]:
        print(f"{row['question']}\n  base:    {row['base']!r}\n  adapter: {row['adapter']!r}")


if __name__ == "__main__":
    main()
