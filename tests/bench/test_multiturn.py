"""The multi-turn workload: its seeded script, prompts that grow by the real answers, the closed loop,
failed turns, per-turn metrics, and `tandem bench serve|sweep --dataset-name multi-turn` end to end
against the fake gRPC and OpenAI HTTP servers (no model, no torch)."""

import argparse
import asyncio
import json
import math
import random
import re
import statistics
import time

import pytest
from tokenizers import Tokenizer

from tandem.bench.serve import sweep
from tandem.bench.serve.datasets import DatasetConfig, encode, parse_priority_mix
from tandem.bench.serve.metrics import compute_metrics, format_multi_turn_summary, multi_turn_metrics
from tandem.bench.serve.multiturn import build_conversations, first_request, next_request, run_conversations
from tandem.bench.serve.records import BenchRequest, RequestRecord
from tandem.bench.serve.runner import LoadConfig, arrival_offsets
from tandem.cli import bench_cmd
from tests.bench.fakes import FakeOpenAIServer, FakeServer, byte_level_bpe


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return byte_level_bpe()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return d


def mt(**kw) -> DatasetConfig:
    base = dict(name="multi-turn", output_len=5, multi_turn_conversations=4, multi_turn_turns=3,
                multi_turn_user_len=12, multi_turn_think_time=0.0, seed=1)
    return DatasetConfig(**{**base, **kw})


# --- the script and the prompts ---

def test_script_shapes_and_exact_user_tokens(tok):
    convs = build_conversations(mt(multi_turn_think_time=0.5), tok)
    assert [c.index for c in convs] == [0, 1, 2, 3] and all(len(c.turns) == 3 for c in convs)
    for c in convs:
        for k, t in enumerate(c.turns):
            assert len(t.ids) == 12 and encode(tok, t.text) == list(t.ids) and t.output_len == 5
            assert (t.think_s == 0.0) == (k == 0)          # no pause before a conversation's first turn
    assert len({c.turns[0].ids for c in convs}) == 4       # conversations do not share a start
    ranged = build_conversations(mt(range_ratio=0.5, multi_turn_conversations=20), tok)
    lens = [len(t.ids) for c in ranged for t in c.turns]
    assert 6 <= min(lens) and max(lens) <= 18 and len(set(lens)) > 3


def test_same_seed_same_texts_and_think_times(tok):
    a = build_conversations(mt(multi_turn_think_time=0.5), tok)
    assert build_conversations(mt(multi_turn_think_time=0.5), tok) == a
    other = build_conversations(mt(multi_turn_think_time=0.5, seed=2), tok)
    assert [c.turns for c in other] != [c.turns for c in a]
    # The think times have a stream of their own: their mean does not change the texts.
    slower = build_conversations(mt(multi_turn_think_time=2.0), tok)
    assert [[t.ids for t in c.turns] for c in slower] == [[t.ids for t in c.turns] for c in a]
    assert [t.think_s for t in slower[0].turns[1:]] == pytest.approx([4 * t.think_s for t in a[0].turns[1:]])


def test_think_times_are_exponential_with_the_given_mean(tok):
    convs = build_conversations(mt(multi_turn_think_time=0.5, multi_turn_conversations=400, multi_turn_turns=2,
                                   multi_turn_user_len=1), tok)
    thinks = [c.turns[1].think_s for c in convs]
    assert statistics.fmean(thinks) == pytest.approx(0.5, rel=0.15)
    assert statistics.pstdev(thinks) == pytest.approx(0.5, rel=0.2)   # exponential: sd == mean


def test_each_turn_is_the_conversation_so_far_with_the_answer_verbatim(tok):
    conv = build_conversations(mt(multi_turn_turns=4), tok)[0]
    req = first_request(conv)
    assert req.prompt == conv.turns[0].text and req.messages == (("user", conv.turns[0].text),)
    assert list(req.prompt_ids) == encode(tok, req.prompt) and req.prompt_len == 12
    answers = [" river mountain", "\nok, and 42!", " forest"]
    for k, answer in enumerate(answers, start=1):
        nxt = next_request(req, answer, conv.turns[k], tok)
        assert nxt.prompt == req.prompt + answer + conv.turns[k].text
        assert nxt.messages == (*req.messages, ("assistant", answer), ("user", conv.turns[k].text))
        assert nxt.prompt_len == len(encode(tok, nxt.prompt)) and list(nxt.prompt_ids) == encode(tok, nxt.prompt)
        assert nxt.prompt_len > req.prompt_len + 12       # grows by the answer and the user's turn
        assert nxt.output_len == conv.turns[k].output_len
        req = nxt


def test_bad_settings_are_rejected(tok):
    for bad in (dict(multi_turn_conversations=0), dict(multi_turn_turns=0), dict(multi_turn_user_len=0),
                dict(multi_turn_think_time=-1.0), dict(multi_turn_think_time=math.inf)):
        with pytest.raises(ValueError, match="multi-turn"):
            build_conversations(mt(**bad), tok)


# --- the closed loop, with a fake backend ---

class Answering:
    """Answers each request with `tokens` token events `gap` s apart and the text " ans{n}" (the n-th
    request); fails the requests `fail` says so of."""

    def __init__(self, tokens=2, gap=0.002, fail=lambda req: False):
        self.tokens, self.gap, self.fail = tokens, gap, fail
        self.sent: list[tuple[BenchRequest, float]] = []

    async def start(self): ...

    async def close(self): ...

    async def send(self, req: BenchRequest) -> RequestRecord:
        rec = RequestRecord(prompt_len=req.prompt_len, output_len=req.output_len, priority=req.priority,
                            start=time.perf_counter())
        self.sent.append((req, rec.start))
        if self.fail(req):
            await asyncio.sleep(self.gap)
            rec.error = "HTTP 500: told to fail"
        else:
            for _ in range(self.tokens):
                await asyncio.sleep(self.gap)
                rec.token_times.append(time.perf_counter())
            rec.output_text = f" ans{len(self.sent)}"
            rec.output_tokens, rec.success = self.tokens, True
        rec.end = time.perf_counter()
        return rec


def by_conversation(records):
    out: dict[int, list[RequestRecord]] = {}
    for r in records:
        out.setdefault(r.conversation, []).append(r)
    return out


def test_next_turn_waits_for_the_answer_plus_the_think_time(tok):
    convs = build_conversations(mt(multi_turn_think_time=0.03, multi_turn_conversations=3), tok)
    backend = Answering()
    result = asyncio.run(run_conversations(backend, convs, LoadConfig(request_rate=50.0, seed=3), tok))
    assert [(r.conversation, r.turn) for r in result.records] == [(c, k) for c in range(3) for k in (1, 2, 3)]
    prompts = {start: req for req, start in backend.sent}     # what each record's request was
    for c, recs in by_conversation(result.records).items():
        for k in (1, 2):
            prev, nxt = recs[k - 1], recs[k]
            assert nxt.start >= prev.end + convs[c].turns[k].think_s    # never early
            assert nxt.start - prev.end < convs[c].turns[k].think_s + 2.0   # only a gross stall
            # The answer that came back is in the next prompt, verbatim, after the previous prompt.
            assert prompts[nxt.start].prompt == prompts[prev.start].prompt + prev.output_text + convs[c].turns[k].text
    offsets = arrival_offsets(3, 50.0, 1.0, random.Random(3))
    for c, at in enumerate(offsets):
        assert by_conversation(result.records)[c][0].start - result.t0 >= at - 1e-3


def test_a_thinking_conversation_holds_no_concurrency_slot(tok):
    convs = build_conversations(mt(multi_turn_think_time=0.05, multi_turn_conversations=2, multi_turn_turns=2), tok)
    backend = Answering(gap=0.001)
    result = asyncio.run(run_conversations(backend, convs, LoadConfig(max_concurrency=1), tok))
    assert all(r.success for r in result.records) and len(result.records) == 4
    spans = sorted((r.start, r.end) for r in result.records)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))  # one at a time
    # Both first turns ran before either second turn: the thinking conversation left the slot free
    # (holding it, conversation 1 would have waited for all of conversation 0).
    assert [r.turn for r in sorted(result.records, key=lambda r: r.start)] == [1, 1, 2, 2]


def test_a_failed_turn_ends_its_conversation(tok):
    convs = build_conversations(mt(multi_turn_conversations=3, multi_turn_turns=4), tok)
    doomed = convs[1].turns[0].text

    def fail(req):  # conversation 1's second turn
        return req.messages[0][1] == doomed and len(req.messages) == 3

    backend = Answering(fail=fail)
    result = asyncio.run(run_conversations(backend, convs, LoadConfig(), tok))
    turns = {c: [(r.turn, r.success) for r in recs] for c, recs in by_conversation(result.records).items()}
    assert turns == {0: [(k, True) for k in (1, 2, 3, 4)], 1: [(1, True), (2, False)],
                     2: [(k, True) for k in (1, 2, 3, 4)]}
    assert len(backend.sent) == 10                       # turns 3 and 4 of conversation 1 were never sent
    m = multi_turn_metrics(result.records, conversations=3, turns=4)
    assert (m.conversations_completed, m.conversations_failed, m.turns_sent, m.turns_not_sent) == (2, 1, 10, 2)
    assert (m.by_turn[2].sent, m.by_turn[2].failed, m.by_turn[3].sent) == (3, 1, 2)
    overall = compute_metrics(result.records, result.duration_s)
    assert (overall.completed, overall.failed) == (9, 1)


def test_priorities_are_drawn_per_conversation(tok):
    convs = build_conversations(mt(multi_turn_conversations=4, priority_mix=parse_priority_mix("5:1,0:1")), tok)
    assert sorted(c.priority for c in convs) == [0, 0, 5, 5]
    backend = Answering()
    result = asyncio.run(run_conversations(backend, convs, LoadConfig(), tok))
    for c, recs in by_conversation(result.records).items():
        assert {r.priority for r in recs} == {convs[c].priority}


# --- per-turn metrics, by hand ---

def rec(conversation, turn, ttft, ok=True, prompt_len=10):
    r = RequestRecord(prompt_len=prompt_len, output_len=2, start=0.0, end=ttft + 0.1, success=ok,
                      token_times=[ttft, ttft + 0.1] if ok else [], output_tokens=2 if ok else 0,
                      error="" if ok else "boom")
    r.conversation, r.turn = conversation, turn
    return r


def test_per_turn_metrics_by_hand():
    records = [rec(0, 1, 0.100, prompt_len=10), rec(0, 2, 0.020, prompt_len=30), rec(0, 3, 0.040, prompt_len=50),
               rec(1, 1, 0.300, prompt_len=20), rec(1, 2, 0.060, prompt_len=40), rec(1, 3, 9.0, ok=False),
               rec(2, 1, 0.200, prompt_len=30), rec(2, 2, 0.5, ok=False)]
    m = multi_turn_metrics(records, conversations=3, turns=3, percentiles=(90.0,))
    assert (m.conversations_completed, m.conversations_failed, m.turns_sent, m.turns_not_sent) == (1, 2, 8, 1)
    assert m.ttft_turn_1.n == 3 and m.ttft_turn_1.p(50) == pytest.approx(200.0)
    assert m.ttft_turn_1.p(99) == pytest.approx(200.0 + 0.98 * 100.0)
    assert m.ttft_turns_2_plus.n == 3                    # 20, 40, 60 ms; the failed turns have no TTFT
    assert m.ttft_turns_2_plus.p(50) == pytest.approx(40.0) and m.ttft_turns_2_plus.p(90) == pytest.approx(56.0)
    t1, t2, t3 = m.by_turn[1], m.by_turn[2], m.by_turn[3]
    assert (t1.sent, t1.completed, t1.failed, t1.mean_prompt_len) == (3, 3, 0, 20.0)
    assert (t2.sent, t2.completed, t2.failed) == (3, 2, 1) and t2.ttft.p(50) == pytest.approx(40.0)
    assert (t3.sent, t3.completed, t3.failed) == (2, 1, 1) and t3.ttft.mean == pytest.approx(40.0)
    d = m.to_dict()
    assert set(d["by_turn"]) == {1, 2, 3} and d["ttft_turns_2_plus"]["percentiles"]["p50"] == pytest.approx(40.0)
    text = format_multi_turn_summary(m)
    row1 = next(line for line in text.splitlines() if line.startswith("TTFT turn 1"))
    row2 = next(line for line in text.splitlines() if line.startswith("TTFT turns >= 2"))
    assert row1.split()[3:] == ["3", "200.0", "200.0", "298.0"]
    assert row2.split()[4:] == ["3", "40.0", "40.0", "59.6"]
    assert "3 x 3 turns: 1 completed, 2 ended by a failed turn" in text


# --- the command, end to end ---

def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    bench_cmd.add_arguments(parser)
    return bench_cmd.run(parser.parse_args(list(argv)))


ANSWER = re.compile(r" a\d+w0")   # FakeOpenAIServer's answers start so
MT_ARGS = ("--dataset-name", "multi-turn", "--multi-turn-conversations", "3", "--multi-turn-turns", "3",
           "--multi-turn-user-len", "10", "--multi-turn-think-time", "0.01", "--output-len", "4")


def test_serve_multi_turn_over_grpc(tokenizer_dir, tok, tmp_path, capsys):
    out = tmp_path / "mt.json"
    with FakeServer(gap=0.001) as fake:
        rc = cli("serve", "--backend", "tandem-grpc", "--base-url", f"127.0.0.1:{fake.port}", "--model",
                 str(tokenizer_dir), *MT_ARGS, "--request-rate", "100", "--num-warmups", "1", "--out", str(out),
                 "--no-progress", "--no-plot", "--slo", "ttft=5s")
        sent = [list(r.token_ids.ids) for r in fake.servicer.requests]
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT turn 1" in printed and "TTFT turns >= 2" in printed and "3 conversations x 3 turns" in printed
    run = json.loads(out.read_text())["runs"][0]
    assert run["metrics"]["completed"] == 9 and run["metrics"]["good_requests"] == 9
    m = run["multi_turn"]
    assert (m["conversations"], m["turns"], m["turns_sent"], m["turns_not_sent"]) == (3, 3, 9, 0)
    assert m["ttft_turn_1"]["n"] == 3 and m["ttft_turns_2_plus"]["n"] == 6
    assert {"p50", "p99"} <= set(m["ttft_turns_2_plus"]["percentiles"])
    assert list(m["by_turn"]) == ["1", "2", "3"] and all(t["completed"] == 3 for t in m["by_turn"].values())
    assert m["by_turn"]["1"]["mean_prompt_len"] < m["by_turn"]["2"]["mean_prompt_len"] < m["by_turn"]["3"]["mean_prompt_len"]
    reqs = run["requests"]
    assert sorted((r["conversation"], r["turn"]) for r in reqs) == [(c, k) for c in range(3) for k in (1, 2, 3)]
    assert len(sent) == 1 + 9                             # one warm-up, not measured
    # The fake answers " t0 t1 t2 t3": each later turn is the previous prompt, that answer, the new user text.
    texts = [tok.decode(ids) for ids in sent[1:]]
    later = [t for t in texts if " t0 t1 t2 t3" in t]
    assert sorted(t.count(" t0 t1 t2 t3") for t in later) == [1, 1, 1, 2, 2, 2]
    for t in later:
        head = t[:t.rindex(" t0 t1 t2 t3")]
        assert encode(tok, head) in sent[1:]              # the previous turn's prompt, as it was sent


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_serve_multi_turn_over_http(tokenizer_dir, tmp_path, endpoint):
    out = tmp_path / "mt.json"
    with FakeOpenAIServer(gap=0.001) as fake:
        rc = cli("serve", "--base-url", fake.url, "--endpoint", endpoint, "--model", str(tokenizer_dir), *MT_ARGS,
                 "--num-warmups", "0", "--out", str(out), "--no-progress", "--no-plot")
        bodies = list(fake.bodies)
    assert rc == 0 and len(bodies) == 9
    answers = {}    # request n answered " a{n}w0 a{n}w1 a{n}w2 a{n}w3"
    for n, body in enumerate(bodies):
        answers[n] = "".join(f" a{n}w{i}" for i in range(4))
        assert body["max_tokens"] == 4
    run = json.loads(out.read_text())["runs"][0]
    assert run["metrics"]["completed"] == 9 and run["multi_turn"]["turns_not_sent"] == 0
    if endpoint == "/v1/chat/completions":
        by_len = sorted(bodies, key=lambda b: len(b["messages"]))
        assert [len(b["messages"]) for b in by_len] == [1] * 3 + [3] * 3 + [5] * 3
        for b in by_len[3:]:
            roles = [m["role"] for m in b["messages"]]
            assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
            n = next(i for i, p in enumerate(bodies) if p["messages"] == b["messages"][:-2])
            assert b["messages"][-2]["content"] == answers[n]   # the previous answer, verbatim
    else:
        later = [b for b in bodies if ANSWER.search(b["prompt"])]
        assert len(later) == 6
        for b in later:      # the previous turn's prompt, then its answer verbatim, then the new user text
            assert any(b["prompt"].startswith(p["prompt"] + answers[i]) for i, p in enumerate(bodies) if p is not b)


def test_failed_turn_over_http_ends_the_conversation(tokenizer_dir, tok, tmp_path):
    # The script is a function of the seed: the test knows conversation 0's first words in advance.
    convs = build_conversations(mt(multi_turn_conversations=3, multi_turn_turns=4, multi_turn_user_len=10,
                                   output_len=4, seed=0), tok)
    start = convs[0].turns[0].text

    def fail(body):  # conversation 0's third turn (its prompt holds two answers)
        return body["prompt"].startswith(start) and len(ANSWER.findall(body["prompt"])) == 2

    out = tmp_path / "mt.json"
    with FakeOpenAIServer(gap=0.001, fail=fail) as fake:
        rc = cli("serve", "--base-url", fake.url, "--model", str(tokenizer_dir), *MT_ARGS,
                 "--multi-turn-turns", "4", "--num-warmups", "0", "--out", str(out), "--no-progress", "--no-plot")
        sent = len(fake.bodies)
    assert rc == 0 and sent == 11
    run = json.loads(out.read_text())["runs"][0]
    m = run["multi_turn"]
    assert (m["conversations_failed"], m["turns_sent"], m["turns_not_sent"]) == (1, 11, 1)
    assert run["metrics"]["failed"] == 1 and "told to fail" in next(iter(run["metrics"]["failures"]))
    failed = [r for r in run["requests"] if not r["success"]]
    assert [(r["conversation"], r["turn"]) for r in failed] == [(0, 3)]


def test_num_prompts_must_agree_and_bad_settings_are_usage_errors(tokenizer_dir, capsys):
    assert cli("serve", "--model", str(tokenizer_dir), *MT_ARGS, "--num-prompts", "10") == 2
    assert "= 9 requests per rate; --num-prompts 10 disagrees" in capsys.readouterr().err
    assert cli("serve", "--model", str(tokenizer_dir), *MT_ARGS, "--num-prompts", "9", "--num-warmups", "0",
               "--base-url", "http://127.0.0.1:9", "--timeout", "5", "--no-progress") == 1   # agrees: runs (and fails)
    assert cli("serve", "--model", str(tokenizer_dir), *MT_ARGS, "--multi-turn-think-time", "-1",
               "--base-url", "http://127.0.0.1:9") == 2


def test_sweep_takes_the_multi_turn_flags(tokenizer_dir, tmp_path, monkeypatch, capsys):
    from tests.bench.test_serve_and_sweep import FakeDeployment

    monkeypatch.setattr(sweep, "make_deployment", lambda name, cfg, echo=print: FakeDeployment(name))
    monkeypatch.setattr(sweep, "auto_dtype", lambda model: "float32")
    out = tmp_path / "sweep.json"
    rc = cli("sweep", "--model", str(tokenizer_dir), "--deployments", "colocated", "--request-rates", "inf",
             *MT_ARGS, "--num-warmups", "0", "--out", str(out), "--no-progress")
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["config"]["dataset"]["multi_turn_turns"] == 3
    m = res["deployments"]["colocated"]["runs"][0]["multi_turn"]
    assert m["turns_sent"] == 9 and m["ttft_turns_2_plus"]["n"] == 6
    # The tables put turns >= 2 beside the overall TTFT, side by side across deployments.
    head, _, row = out.with_suffix(".md").read_text().splitlines()[:3]
    cells = [c.strip() for c in row.strip("|").split("|")]
    columns = [c.strip() for c in head.strip("|").split("|")]
    at = columns.index("TTFT turns ≥ 2 p50 / p99 ms")
    p50 = m["ttft_turns_2_plus"]["percentiles"]["p50"]
    assert cells[at].startswith(f"{p50:.0f} / ") and len(cells) == len(columns)
    printed = capsys.readouterr().out
    assert "TTFT>=2 p50 ms" in printed[printed.rindex("goodput = "):]
