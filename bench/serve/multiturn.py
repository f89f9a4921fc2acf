"""The multi-turn workload: conversations that grow turn by turn, each turn sent after the previous answer.

Open loop across conversations, closed loop within one: conversation starts follow the request-rate
process (Poisson / gamma, as `runner.arrival_offsets`); turn k+1 of a conversation is sent only once
turn k has finished, plus a think time. Its prompt is the conversation so far, with the model's
actual answer:

    turn 1      user_1
    turn k + 1  prompt_k + answer_k + user_{k+1}      (text, for /v1/completions and tandem-grpc)
                [user_1, assistant answer_1, ..., user_{k+1}]   (messages, for /v1/chat/completions)

The script (user texts, answer lengths, think times, priorities) is drawn up front from the seed, so
the same seed gives the same user texts and think times whatever the server answers; the think
times have a random stream of their own, so changing their mean does not change the texts. Prompt
token counts come from the workload's tokenizer (the text prompt re-encoded each turn; a chat
template's own tokens are not counted, as for the other datasets).

A failed turn ends its conversation: it is recorded as failed, its later turns are not sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from tandem.bench.serve.backends import Backend
from tandem.bench.serve.datasets import DatasetConfig, TokenSampler, _lengths, encode, with_priorities
from tandem.bench.serve.records import BenchRequest, RequestRecord
from tandem.bench.serve.runner import LoadConfig, RunResult, _progress_bar, arrival_offsets, run_warmups

NAME = "multi-turn"
_THINK_SEED_OFFSET = 30_000   # the think times do not replay the texts' random stream


@dataclass(frozen=True)
class UserTurn:
    text: str                             # what the user adds this turn; encode(text) == ids
    ids: tuple[int, ...]
    output_len: int                       # the answer's requested length
    think_s: float                        # pause between the previous turn's end and this one (0 for turn 1)


@dataclass(frozen=True)
class Conversation:
    index: int
    turns: tuple[UserTurn, ...]
    priority: int | None = None           # every turn's priority (--priority-mix draws one per conversation)


def validate(cfg: DatasetConfig) -> None:
    if cfg.multi_turn_conversations < 1 or cfg.multi_turn_turns < 1:
        raise ValueError("multi-turn needs at least 1 conversation of at least 1 turn")
    if cfg.multi_turn_user_len < 1:
        raise ValueError("multi-turn user tokens per turn must be >= 1")
    if not (cfg.multi_turn_think_time >= 0.0 and math.isfinite(cfg.multi_turn_think_time)):
        raise ValueError(f"multi-turn think time must be >= 0 s, got {cfg.multi_turn_think_time}")


def build_conversations(cfg: DatasetConfig, tok: Tokenizer) -> list[Conversation]:
    """The seeded script: `multi_turn_conversations` conversations of `multi_turn_turns` user turns."""
    validate(cfg)
    n, turns = cfg.multi_turn_conversations, cfg.multi_turn_turns
    rng = random.Random(cfg.seed)
    think_rng = random.Random(cfg.seed + _THINK_SEED_OFFSET)
    sampler = TokenSampler(tok)
    user_lens = _lengths(cfg.multi_turn_user_len, cfg.range_ratio, n * turns, rng)
    out_lens = _lengths(cfg.output_len if cfg.output_len is not None else 64, cfg.range_ratio, n * turns, rng)
    mean_think = cfg.multi_turn_think_time
    convs = []
    for c in range(n):
        script = []
        for k in range(turns):
            text, ids = sampler.sample(user_lens[c * turns + k], rng)
            think = think_rng.expovariate(1.0 / mean_think) if k > 0 and mean_think > 0 else 0.0
            script.append(UserTurn(text=text, ids=tuple(ids), output_len=out_lens[c * turns + k], think_s=think))
        convs.append(Conversation(index=c, turns=tuple(script)))
    if cfg.priority_mix:
        firsts = with_priorities([first_request(c) for c in convs], cfg.priority_mix, cfg.seed)
        convs = [Conversation(c.index, c.turns, r.priority) for c, r in zip(convs, firsts, strict=True)]
    return convs


def first_request(conv: Conversation) -> BenchRequest:
    t = conv.turns[0]
    return BenchRequest(prompt=t.text, prompt_len=len(t.ids), output_len=t.output_len, prompt_ids=t.ids,
                        priority=conv.priority, messages=(("user", t.text),))


def next_request(prev: BenchRequest, answer: str, turn: UserTurn, tok: Tokenizer) -> BenchRequest:
    """The turn after `prev`, whose answer was `answer` (verbatim, as streamed back)."""
    text = prev.prompt + answer + turn.text
    ids = tuple(encode(tok, text))
    assert prev.messages is not None, "a conversation's requests carry their chat history"
    return BenchRequest(prompt=text, prompt_len=len(ids), output_len=turn.output_len, prompt_ids=ids,
                        priority=prev.priority, messages=(*prev.messages, ("assistant", answer), ("user", turn.text)))


def warmup_requests(cfg: DatasetConfig, n: int, seed: int, tok: Tokenizer) -> list[BenchRequest]:
    """`n` first turns of conversations of their own (seed `seed`): the shape of a conversation's start."""
    if n < 1:
        return []
    warm = dataclasses.replace(cfg, multi_turn_conversations=n, multi_turn_turns=1, seed=seed, priority_mix=())
    return [first_request(c) for c in build_conversations(warm, tok)]


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def run_conversations(backend: Backend, convs: Sequence[Conversation], load: LoadConfig, tok: Tokenizer,
                            warmups: Sequence[BenchRequest] = (), progress: bool = False,
                            desc: str = "") -> RunResult:
    """Every conversation to its end (or its first failed turn); records sorted by (conversation, turn).

    `load.max_concurrency` caps requests in flight, not conversations: a conversation that is
    thinking holds no slot.
    """
    warm = await run_warmups(backend, warmups)
    offsets = arrival_offsets(len(convs), load.request_rate, load.burstiness, random.Random(load.seed))
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = _progress_bar(sum(len(c.turns) for c in convs), desc, progress)
    records: list[RequestRecord] = []

    async def send(req: BenchRequest) -> RequestRecord:
        if sem is None:
            return await backend.send(req)
        async with sem:
            return await backend.send(req)

    async def converse(conv: Conversation, at: float) -> None:
        await _sleep_until(t0 + at)
        req, rec = first_request(conv), None
        for k, turn in enumerate(conv.turns, start=1):
            if rec is not None:
                # Closed loop: never before the previous turn ended plus the think time.
                await _sleep_until(rec.end + turn.think_s)
                req = next_request(req, rec.output_text, turn, tok)
            rec = await send(req)
            rec.conversation, rec.turn = conv.index, k
            records.append(rec)
            bar.update(1)
            if not rec.success:
                bar.update(len(conv.turns) - k)   # not sent: the conversation ends here
                return

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(converse(c, at) for c, at in zip(convs, offsets, strict=True)))
    finally:
        bar.close()
    records.sort(key=lambda r: (r.conversation, r.turn))
    end = max((r.end for r in records), default=t0)
    return RunResult(records=records, warmups=warm, t0=t0, duration_s=max(end - t0, 1e-9))


def describe(convs: Sequence[Conversation]) -> str:
    turns = [t for c in convs for t in c.turns]
    users = [len(t.ids) for t in turns]
    outs = [t.output_len for t in turns]
    thinks = [t.think_s for c in convs for t in c.turns[1:]]
    think = f"think time mean {sum(thinks) / len(thinks):.2f} s (drawn)" if thinks else "no think time"
    return (f"{len(convs)} conversations x {len(convs[0].turns)} turns, user tokens per turn "
            f"{min(users)}-{max(users)} (mean {sum(users) / len(users):.0f}), output tokens {min(outs)}-{max(outs)} "
            f"(mean {sum(outs) / len(outs):.0f}), {think}")
