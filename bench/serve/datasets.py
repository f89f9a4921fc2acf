"""Workloads: random prompts of exact token counts, shared-prefix groups, ShareGPT-format files.

Every dataset is a function `(DatasetConfig, tokenizer) -> list[BenchRequest]` in `DATASETS`.
The tokenizer is a Hugging Face `tokenizers.Tokenizer` loaded straight from `tokenizer.json`
(no torch, no transformers). Random text is built from whole-word vocabulary tokens (" cat",
" house", ...) that the tokenizer's pre-tokenizer keeps apart, so a prompt of N such tokens
re-encodes to exactly those N ids; the result is checked, and tokenizers where that does not hold
fall back to decode / re-encode / trim until the count is exact.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from tandem.bench.serve.records import BenchRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "random"                 # random | shared-prefix | sharegpt | multi-turn
    num_prompts: int = 100
    input_len: int = 256                 # random: prompt tokens; shared-prefix: tokens after the prefix
    output_len: int | None = 64          # None: sharegpt takes the reference reply's length
    range_ratio: float = 0.0             # lengths uniform in [L * (1 - r), L * (1 + r)]
    prefix_len: int = 256                # shared-prefix: tokens of each group's common prefix
    num_prefix_groups: int = 4
    path: str | None = None              # sharegpt: a JSON file
    sharegpt_max_prompt_len: int = 1024
    sharegpt_max_total_len: int = 2048
    seed: int = 0
    # (priority, share) classes: each request gets one priority, in these proportions (exact counts,
    # shuffled with the seed); () sends none. See parse_priority_mix.
    priority_mix: tuple[tuple[int, float], ...] = ()
    # multi-turn (bench/serve/multiturn.py): closed-loop conversations; num_prompts and input_len unused
    multi_turn_conversations: int = 32
    multi_turn_turns: int = 6
    multi_turn_user_len: int = 200       # user tokens each turn adds (range_ratio applies)
    multi_turn_think_time: float = 1.0   # mean s between a turn's end and the next turn (exponential)


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """A tokenizer from a tokenizer.json file, a model folder holding one, or a Tandem model alias."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return Tokenizer.from_file(str(path))
    if not (path / "tokenizer.json").is_file():
        from tandem.engine.models.source import resolve_model  # torch-free; imports an alias on first use

        path = resolve_model(name_or_path)
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


class TokenSampler:
    """Draws random prompts of an exact token count for one tokenizer."""

    _WORD = re.compile(r"^ [a-z]{2,9}$")

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        words = []
        for token, i in tok.get_vocab().items():
            if token.startswith("<") or len(token) > 12:
                continue  # special tokens and long pieces; the decode below settles the rest
            text = tok.decode([i])
            if self._WORD.match(text) and encode(tok, text) == [i]:
                words.append(i)
        self.words = sorted(words)
        self.special = set(tok.get_added_tokens_decoder())
        self._clean: list[int] | None = None
        if len(self.words) < 100:
            log.warning("tokenizer has only %d whole-word tokens; prompts use re-encode trimming", len(self.words))

    def sample(self, n: int, rng: random.Random) -> tuple[str, list[int]]:
        """(text, ids) where encode(text) == ids and len(ids) == n."""
        if n <= 0:
            return "", []
        if len(self.words) >= 100:
            ids = [rng.choice(self.words) for _ in range(n)]
            text = self.tok.decode(ids)
            if encode(self.tok, text) == ids:
                return text, ids
        return self._trimmed(n, rng)

    def _trimmed(self, n: int, rng: random.Random) -> tuple[str, list[int]]:
        if self._clean is None:
            # Tokens that survive a round trip alone (no partial UTF-8, no specials): joining them
            # can only merge across boundaries, which trimming and padding settle in a few rounds.
            self._clean = [i for i in range(self.tok.get_vocab_size())
                           if i not in self.special and encode(self.tok, self.tok.decode([i])) == [i]]
        vocab = self._clean
        ids = [rng.choice(vocab) for _ in range(n)]
        for _ in range(50):
            text = self.tok.decode(ids)
            got = encode(self.tok, text)
            if len(got) == n:
                return text, got
            ids = (got + [rng.choice(vocab) for _ in range(n)])[:n]
        raise RuntimeError(f"could not build a prompt of exactly {n} tokens with this tokenizer")


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {ratio}")
    lo, hi = max(1, math.floor(mean * (1 - ratio))), max(1, math.ceil(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_dataset(cfg: DatasetConfig, tok: Tokenizer) -> list[BenchRequest]:
    rng = random.Random(cfg.seed)
    sampler = TokenSampler(tok)
    out_mean = cfg.output_len if cfg.output_len is not None else 64
    ins = _lengths(cfg.input_len, cfg.range_ratio, cfg.num_prompts, rng)
    outs = _lengths(out_mean, cfg.range_ratio, cfg.num_prompts, rng)
    reqs = []
    for n_in, n_out in zip(ins, outs, strict=True):
        text, ids = sampler.sample(n_in, rng)
        reqs.append(BenchRequest(prompt=text, prompt_len=len(ids), output_len=n_out, prompt_ids=tuple(ids)))
    return reqs


def shared_prefix_dataset(cfg: DatasetConfig, tok: Tokenizer) -> list[BenchRequest]:
    """`num_prefix_groups` prefixes of `prefix_len` tokens; each prompt is one of them + a random suffix.

    Groups are assigned round-robin and the order shuffled, so a group's requests interleave with
    the others' (what a prefix cache under load sees).
    """
    if cfg.num_prefix_groups < 1:
        raise ValueError("num_prefix_groups must be >= 1")
    rng = random.Random(cfg.seed)
    sampler = TokenSampler(tok)
    prefixes = [sampler.sample(cfg.prefix_len, rng) for _ in range(cfg.num_prefix_groups)]
    out_mean = cfg.output_len if cfg.output_len is not None else 64
    ins = _lengths(cfg.input_len, cfg.range_ratio, cfg.num_prompts, rng)
    outs = _lengths(out_mean, cfg.range_ratio, cfg.num_prompts, rng)
    reqs = []
    for i, (n_in, n_out) in enumerate(zip(ins, outs, strict=True)):
        p_text, p_ids = prefixes[i % cfg.num_prefix_groups]
        s_text, s_ids = sampler.sample(n_in, rng)
        ids = p_ids + s_ids
        reqs.append(BenchRequest(prompt=p_text + s_text, prompt_len=len(ids), output_len=n_out, prompt_ids=tuple(ids)))
    rng.shuffle(reqs)
    return reqs


def sharegpt_dataset(cfg: DatasetConfig, tok: Tokenizer) -> list[BenchRequest]:
    """First human turn as the prompt, the first reply's length as the output length.

    The file is a JSON list of {"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
    ...}, ...]} (ShareGPT's format; "role"/"content" keys are accepted too). Pairs with fewer than 4
    tokens on either side, a prompt over `sharegpt_max_prompt_len` or a total over
    `sharegpt_max_total_len` are skipped. With fewer usable pairs than `num_prompts` they repeat.
    """
    if not cfg.path:
        raise ValueError("the sharegpt dataset needs --dataset-path FILE.json")
    entries = json.loads(Path(cfg.path).read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{cfg.path}: expected a JSON list of conversations")
    rng = random.Random(cfg.seed)
    order = list(range(len(entries)))
    rng.shuffle(order)
    reqs: list[BenchRequest] = []
    for i in order:
        turns = entries[i].get("conversations") or entries[i].get("messages") or []
        if len(turns) < 2:
            continue
        prompt = turns[0].get("value", turns[0].get("content", ""))
        reply = turns[1].get("value", turns[1].get("content", ""))
        n_in = len(encode(tok, prompt))
        n_out = cfg.output_len if cfg.output_len is not None else len(encode(tok, reply))
        if n_in < 4 or n_out < 4 or n_in > cfg.sharegpt_max_prompt_len or n_in + n_out > cfg.sharegpt_max_total_len:
            continue
        reqs.append(BenchRequest(prompt=prompt, prompt_len=n_in, output_len=n_out))
        if len(reqs) == cfg.num_prompts:
            break
    if not reqs:
        raise ValueError(f"{cfg.path}: no usable conversations (need two turns of 4+ tokens each)")
    if len(reqs) < cfg.num_prompts:
        log.warning("%s has %d usable conversations; repeating them to make %d", cfg.path, len(reqs), cfg.num_prompts)
        reqs = [reqs[i % len(reqs)] for i in range(cfg.num_prompts)]
    return reqs


DATASETS: dict[str, Callable[[DatasetConfig, Tokenizer], list[BenchRequest]]] = {
    "random": random_dataset,
    "shared-prefix": shared_prefix_dataset,
    "sharegpt": sharegpt_dataset,
}


def build_dataset(cfg: DatasetConfig, tok: Tokenizer) -> list[BenchRequest]:
    if cfg.name == "multi-turn":
        raise ValueError("multi-turn prompts depend on the server's answers: build them with bench.serve.multiturn")
    if cfg.name not in DATASETS:
        raise ValueError(f"unknown dataset {cfg.name!r}; choose one of {', '.join(DATASETS)}")
    if cfg.num_prompts < 1:
        raise ValueError("num_prompts must be >= 1")
    return with_priorities(DATASETS[cfg.name](cfg, tok), cfg.priority_mix, cfg.seed)


_PRIORITY_SEED_OFFSET = 20_000  # the classes' shuffle does not replay the prompts' random stream


def parse_priority_mix(text: str) -> tuple[tuple[int, float], ...]:
    """'10:1,0:3' -> ((10, 0.25), (0, 0.75)): priority values and their weights, normalised to shares."""
    pairs: dict[int, float] = {}
    for part in filter(None, (t.strip() for t in text.split(","))):
        prio, sep, weight = part.partition(":")
        try:
            p, w = int(prio), float(weight) if sep else math.nan
        except ValueError:
            p, w = 0, math.nan
        if not (sep and w > 0 and math.isfinite(w)):
            raise ValueError(f"priority mix entries are PRIORITY:WEIGHT with an integer priority and a "
                             f"weight > 0, e.g. 10:1,0:3; got {part!r}")
        if p in pairs:
            raise ValueError(f"priority {p} appears twice in the priority mix {text!r}")
        pairs[p] = w
    total = sum(pairs.values())
    return tuple((p, w / total) for p, w in pairs.items())


def with_priorities(reqs: list[BenchRequest], mix: Sequence[tuple[int, float]], seed: int) -> list[BenchRequest]:
    """`reqs` with priorities in `mix`'s proportions: exact counts (largest remainder), in an order
    shuffled with `seed`, so the classes interleave through the arrival schedule."""
    if not mix:
        return reqs
    n = len(reqs)
    counts = [math.floor(share * n) for _, share in mix]
    by_rest = sorted(range(len(mix)), key=lambda i: (-(mix[i][1] * n - counts[i]), i))
    for i in by_rest[:n - sum(counts)]:
        counts[i] += 1
    prios = [p for (p, _), k in zip(mix, counts, strict=True) for _ in range(k)]
    random.Random(seed + _PRIORITY_SEED_OFFSET).shuffle(prios)
    return [dataclasses.replace(r, priority=p) for r, p in zip(reqs, prios, strict=True)]


def describe(reqs: Sequence[BenchRequest]) -> str:
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    return (f"{len(reqs)} prompts, input tokens {min(ins)}-{max(ins)} (mean {sum(ins) / len(ins):.0f}), "
            f"output tokens {min(outs)}-{max(outs)} (mean {sum(outs) / len(outs):.0f})")
