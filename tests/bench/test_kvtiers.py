"""The KV-tiers benchmark's pure parts: configurations and their flags, the KV budget against the working
set, vLLM's exact KV size, the report's math, and the warm restart's kill-and-hold backend (no servers,
no model, no torch)."""

import asyncio
import time

import pytest

from tandem.bench.serve import kvtiers, kvtiers_report
from tandem.bench.serve.kvtiers_restart import KillOnce, turn_of
from tandem.bench.serve.metrics import SLO, compute_metrics, multi_turn_metrics
from tandem.bench.serve.multiturn import Conversation, UserTurn
from tandem.bench.serve.records import BenchRequest, RequestRecord
from tandem.bench.serve.serve import RateRun
from tandem.bench.serve.sweep import VllmServe
from tests.bench.fakes import byte_level_bpe


def conv(index: int, users: list[int], outs: list[int]) -> Conversation:
    return Conversation(index, tuple(UserTurn("x", tuple(range(u)), o, 0.0) for u, o in zip(users, outs, strict=True)))


# --- configurations and flags ---

def test_configs_parse_in_order_and_reject_unknown_names():
    assert kvtiers.parse_configs("vllm, colo-tiers,1p1d") == ("vllm", "colo-tiers", "1p1d")
    with pytest.raises(ValueError, match="colo-tier"):
        kvtiers.parse_configs("colo,colo-tier")
    with pytest.raises(ValueError):
        kvtiers.parse_configs(" , ")


def test_tandem_flags_set_l1_in_tokens_and_tiers_only_where_asked():
    cfg = kvtiers.KVTiersConfig(host_cache_gb=0.5, disk_cache_gb=3)
    colo = kvtiers.tandem_args("colo", cfg, 1024, "/d")
    assert colo[:2] == ["--mode", "colocated"] and colo[-2:] == ["--max-total-tokens", "1024"]
    assert not any(a.startswith("--kv-") for a in colo)
    tiers = kvtiers.tandem_args("1p1d-tiers", cfg, 1024, "/d")
    assert tiers[:6] == ["--mode", "disagg", "--prefill", "1", "--decode", "1"]
    assert tiers[tiers.index("--kv-disk-cache-dir") + 1] == "/d"
    assert tiers[tiers.index("--kv-host-cache-gb") + 1] == "0.5"
    assert tiers[tiers.index("--kv-disk-cache-gb") + 1] == "3"


def test_vllm_gets_exactly_the_l1_budget_and_no_kvcache_space_variable(tmp_path):
    args = kvtiers_report.vllm_kv_args(2048, 128, 23040)
    blocks = int(args[args.index("--num-gpu-blocks-override") + 1])
    assert blocks == 2048 // 128 + 1          # + the null block vLLM's pool keeps back
    assert int(args[args.index("--kv-cache-memory-bytes") + 1]) == blocks * 128 * 23040
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args
    with pytest.raises(ValueError, match="multiple"):
        kvtiers_report.vllm_kv_args(2000, 128, 23040)
    cfg = kvtiers.KVTiersConfig(vllm_venv=str(tmp_path), vllm_max_model_len=2048)
    small = kvtiers.vllm_config(cfg, cfg.sweep_config("bfloat16"), 1024, 23040)
    assert small.vllm_max_model_len == 1024 and small.dtype == "bfloat16"
    env = VllmServe(small).env({"VLLM_CPU_KVCACHE_SPACE": "4", "PATH": "/bin"})
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override --kv-cache-memory-bytes
    argv = VllmServe(small).argv("py", "/m")
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "9"


def test_vllm_capacity_is_read_from_its_log_line():
    line = "(EngineCore pid=1) INFO [kv_cache_utils.py:2327] CPU KV cache size: 2,176 tokens, Maximum concurrency"
    assert kvtiers.vllm_pool_tokens(["noise", line]) == 2176
    assert kvtiers.vllm_pool_tokens(["noise"]) is None


def test_tandem_pool_and_tier_hits_are_read_from_worker_metrics():
    text = ('# HELP tandem_kv_pages KV pages\ntandem_kv_pages{state="free"} 30.0\ntandem_kv_pages{state="total"} 40.0\n'
            'tandem_kv_tier_hits_total{tier="L2"} 12.0\ntandem_kv_tier_hits_total{tier="L3"} 3.0\n')
    assert kvtiers.pool_tokens(text) == 40 * kvtiers.TANDEM_PAGE_SIZE
    assert kvtiers.tier_hits(text) == {"L2": 12, "L3": 3}
    assert kvtiers.pool_tokens("") is None and kvtiers.tier_hits("") == {}


# --- the KV budget ---

def test_working_set_and_l1_choice():
    convs = [conv(0, [200, 210], [40, 50]), conv(1, [100], [30])]
    assert kvtiers_report.conversation_tokens(convs[0]) == 500
    assert kvtiers_report.script_working_set(convs) == 630
    assert kvtiers_report.largest_request(convs) == 500
    l1 = kvtiers_report.choose_l1_tokens(46847, 4.0, 128)
    assert l1 == 11648 and l1 % 128 == 0 and 46847 >= 4 * l1 and 46847 < 4 * (l1 + 128)
    with pytest.raises(ValueError, match="largest request"):
        kvtiers_report.check_l1(384, 500, 128)
    with pytest.raises(ValueError, match="multiple of 128"):
        kvtiers_report.check_l1(600, 500, 128)
    kvtiers_report.check_l1(512, 500, 128)


def test_plan_records_the_budget_and_says_when_the_working_set_is_below_the_ratio():
    tok = byte_level_bpe()
    cfg = kvtiers.KVTiersConfig(conversations=24, turns=3, user_len=40, output_len=8, think_time_s=0.0)
    p = kvtiers.plan(cfg, tok, "bfloat16")
    b = p.budget
    assert p.l1_tokens % kvtiers.GRANULE == 0 and b["working_set_ge_target"]
    assert b["working_set_tokens"] == kvtiers_report.script_working_set(p.convs)
    assert b["working_set_ge_target"] is (b["working_set_tokens"] >= 4 * b["l1_tokens"])
    forced = kvtiers.plan(kvtiers.KVTiersConfig(**{**cfg.__dict__, "l1_tokens": 4096}), tok, "bfloat16")
    assert forced.l1_tokens == 4096 and not forced.budget["working_set_ge_target"]


def test_measured_working_set_takes_each_conversations_largest_successful_turn():
    reqs = [{"conversation": 0, "turn": 1, "prompt_len": 100, "output_tokens": 10, "success": True},
            {"conversation": 0, "turn": 2, "prompt_len": 300, "output_tokens": 10, "success": True},
            {"conversation": 1, "turn": 1, "prompt_len": 50, "output_tokens": 5, "success": True},
            {"conversation": 1, "turn": 2, "prompt_len": 999, "output_tokens": 0, "success": False}]
    assert kvtiers_report.measured_working_set(reqs) == 310 + 55


# --- the report ---

def rec(conversation: int, turn: int, ttft: float, prompt: int = 100, cached: int = 0, ok: bool = True,
        start: float = 0.0) -> RequestRecord:
    r = RequestRecord(prompt_len=prompt, output_len=4, start=start, end=start + ttft + 0.03,
                      token_times=[start + ttft + 0.01 * i for i in range(4)] if ok else [], output_tokens=4 if ok else 0,
                      cached_tokens=cached, success=ok, conversation=conversation, turn=turn)
    return r


def run_of(records: list[RequestRecord], slo=SLO(ttft=1.0)) -> dict:
    m = compute_metrics(records, 10.0, slo)
    mt = multi_turn_metrics(records, 2, 2)
    return RateRun(0.5, m, [r.to_dict(0.0) for r in records], multi_turn=mt).to_dict(save_requests=True)


def test_config_summary_splits_first_and_later_turns():
    s = kvtiers_report.config_summary(run_of([rec(0, 1, 0.2), rec(0, 2, 0.8, 200, 150),
                                              rec(1, 1, 0.3), rec(1, 2, 1.5, 200, 50)]))
    assert s["completed"] == 4 and s["failed"] == 0
    assert s["ttft_turn_1_ms"]["p50"] == pytest.approx(250.0)
    assert s["ttft_turns_2_plus_ms"]["p50"] == pytest.approx(1150.0)
    assert s["ttft_p50_by_turn_ms"] == {"1": pytest.approx(250.0), "2": pytest.approx(1150.0)}
    assert s["cached_prompt_share_turns_2_plus"] == pytest.approx(0.5)
    assert s["prompt_tokens_turns_2_plus"] == {"prompt": 400, "computed": 200}
    assert s["good_requests"] == 3 and s["goodput"] == pytest.approx(0.3)


def summary(t2_p50: float, goodput: float, t2_p99: float | None = None) -> dict:
    return {"ttft_turns_2_plus_ms": {"p50": t2_p50, "p99": t2_p99 or 2 * t2_p50}, "goodput": goodput}


def test_ratios_and_targets():
    r = kvtiers_report.ratios({"colo": summary(1000, 0.2), "colo-tiers": summary(250, 0.4),
                               "1p1d": summary(1000, 0.1), "1p1d-tiers": summary(800, 0.1), "vllm": summary(600, 0.25)})
    t = r["ttft_turns_2_plus_tiers_over_no_tiers"]
    assert t["colo"]["p50"] == pytest.approx(0.25) and t["colo"]["met"] is True
    assert t["1p1d"]["p50"] == pytest.approx(0.8) and t["1p1d"]["met"] is False
    g = r["goodput_best_tandem_over_vllm"]
    assert g["best"] == "colo-tiers" and g["ratio"] == pytest.approx(1.6) and g["met"] is True
    assert "ttft_turns_2_plus_d2p_over_no_d2p" not in r
    r = kvtiers_report.ratios({"1p1d-tiers": summary(300, 0.1, 900), "1p1d-tiers-no-d2p": summary(600, 0.1, 1000)})
    assert r["ttft_turns_2_plus_d2p_over_no_d2p"] == {"p50": pytest.approx(0.5), "p99": pytest.approx(0.9)}
    assert kvtiers.tandem_args("1p1d-tiers-no-d2p", kvtiers.KVTiersConfig(), 1024, "/d")[6:8] == [
        "--kv-reuse-policy", "never"]
    # vLLM with no good request: no ratio, no verdict; a pair half measured: not reported
    r = kvtiers_report.ratios({"colo-tiers": summary(250, 0.4), "vllm": summary(600, 0.0)})
    assert r["ttft_turns_2_plus_tiers_over_no_tiers"] == {}
    assert r["goodput_best_tandem_over_vllm"]["ratio"] is None and r["goodput_best_tandem_over_vllm"]["met"] is None


def test_summary_text_and_plot(tmp_path):
    run = run_of([rec(0, 1, 0.2), rec(0, 2, 0.8, 200, 150), rec(1, 1, 0.3), rec(1, 2, 1.5, 200, 50)])
    summaries = {"colo": kvtiers_report.config_summary(run), "colo-tiers": kvtiers_report.config_summary(run)}
    results = {"kv_budget": {"l1_tokens": 640, "working_set_tokens": 2600, "working_set_over_l1": 2600 / 640,
                             "working_set_ge_target": True, "working_set_ratio_target": 4.0},
               "dtype": "bfloat16", "slo": "ttft<=1000ms", "slo_text": "goodput = ...", "summaries": summaries,
               "ratios": kvtiers_report.ratios(summaries)}
    text = kvtiers_report.summary_text(results)
    assert "| colo-tiers | 1150 / " in text and "1.00x" in text and "50%" in text
    png = kvtiers_report.plot(results, tmp_path / "k.png")
    assert png is None or png.stat().st_size > 0


def test_first_turns_after_the_restart_and_the_comparison():
    reqs = [{"conversation": 0, "turn": 2, "sent_ms": 900.0, "success": True, "ttft_ms": 50.0, "prompt_len": 100, "cached_tokens": 0},
            {"conversation": 0, "turn": 3, "sent_ms": 2100.0, "success": True, "ttft_ms": 80.0, "prompt_len": 400, "cached_tokens": 320},
            {"conversation": 0, "turn": 4, "sent_ms": 3000.0, "success": True, "ttft_ms": 70.0, "prompt_len": 600, "cached_tokens": 500},
            {"conversation": 1, "turn": 1, "sent_ms": 2200.0, "success": True, "ttft_ms": 40.0, "prompt_len": 100, "cached_tokens": 0},
            {"conversation": 1, "turn": 2, "sent_ms": 2500.0, "success": True, "ttft_ms": 120.0, "prompt_len": 400, "cached_tokens": 80}]
    firsts = kvtiers_report.first_turns_after(reqs, back_ms=2000.0)
    assert [(t["conversation"], t["turn"]) for t in firsts] == [(0, 3), (1, 2)]
    assert firsts[0]["cached_share"] == pytest.approx(0.8)
    s = kvtiers_report.restart_summary(firsts)
    assert s["completed"] == 2 and s["cached_share"] == pytest.approx(0.5) and s["ttft_ms"]["p50"] == pytest.approx(100.0)
    cold = [{**t, "ttft_ms": 4 * t["ttft_ms"]} for t in firsts] + [{**firsts[0], "conversation": 7}]
    c = kvtiers_report.restart_comparison(firsts, cold)
    assert c["matched_turns"] == 2 and c["ttft_ratio_p50"] == pytest.approx(0.25)
    assert kvtiers_report.restart_summary([])["ttft_ms"]["p50"] is None


# --- the warm restart's backend ---

class ScriptedBackend:
    """Answers after `delay` s; fails every request in flight once `down` is set, until `down` is cleared."""

    def __init__(self, delay: float = 0.02):
        self.delay, self.down, self.sent = delay, False, []

    async def start(self):
        pass

    async def close(self):
        pass

    async def send(self, req: BenchRequest) -> RequestRecord:
        self.sent.append((req.prompt, time.perf_counter(), self.down))
        r = RequestRecord(prompt_len=req.prompt_len, output_len=1, start=time.perf_counter())
        await asyncio.sleep(self.delay)
        r.end = time.perf_counter()
        r.success = not self.down
        if r.success:
            r.token_times, r.output_tokens = [r.end], 1
        else:
            r.error = "worker gone"
        return r


def req(turn: int) -> BenchRequest:
    msgs = tuple(("user" if i % 2 == 0 else "assistant", "x") for i in range(2 * turn - 1))
    return BenchRequest(prompt="x", prompt_len=1, output_len=1, messages=msgs)


def test_turn_of_counts_the_history():
    assert [turn_of(req(k)) for k in (1, 2, 5)] == [1, 2, 5]
    assert turn_of(BenchRequest(prompt="x", prompt_len=1, output_len=1)) == 1


def test_kill_once_holds_requests_while_down_and_resends_the_ones_it_broke():
    inner = ScriptedBackend(delay=0.05)
    kills = []

    def kill():
        kills.append(time.perf_counter())
        inner.down = True

    def wait_back():
        time.sleep(0.1)
        inner.down = False

    async def go():
        warm = BenchRequest(prompt="warm-up", prompt_len=1, output_len=1)
        k = KillOnce(inner, turn=2, count=1, kill=kill, wait_back=wait_back, warmup=warm)
        await k.start()
        trigger = asyncio.create_task(k.send(req(2)))
        await asyncio.sleep(0.02)
        in_flight = asyncio.create_task(k.send(req(3)))   # spans the kill: failed, then sent again
        await trigger
        later = await k.send(req(1))                        # sent while down: held until back
        results = [await trigger, await in_flight, later, await k.send(req(2))]
        await k.close()
        return k, results

    k, results = asyncio.run(go())
    assert len(kills) == 1                                  # once, even though turn 2 succeeded again
    assert all(r.success for r in results)
    assert k.retried == 1 and k.killed_at is not None and k.back_at >= k.killed_at + 0.1
    after = [prompt for prompt, t, _ in inner.sent if t > k.killed_at]
    assert after[0] == "warm-up" and k.warmup_record.success   # the restarted worker's first request
    assert not any(down for _, t, down in inner.sent if t > k.back_at)
    assert all(not (k.killed_at < t < k.back_at) for p, t, _ in inner.sent if p != "warm-up")   # held while down
