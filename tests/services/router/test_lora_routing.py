"""LoRA-aware routing on constructed states (torch-free): a request of an adapter prefers workers that
have it loaded, spreads when they are much busier, and base-model requests are routed as if LoRA did
not exist (and so are adapter requests under `--lora-routing blind`); an adapter's prompt is hashed in a
key space of its own in the router's prefix index."""

from __future__ import annotations

import pytest

from tandem.cli.main import build_parser
from tandem.cli.up_cmd import router_args
from tandem.services.router.cache_view import PrefixCacheView, PromptKey
from tandem.services.router.config import RouterConfig
from tandem.services.router.lora_routing import adapter_of, served_adapters
from tandem.services.router.planner import RoutePlanner, prompt_key
from tandem.services.router.route_config import RouteConfig
from tandem.v1 import generation_pb2, worker_pb2

C = worker_pb2.WORKER_ROLE_COLOCATED
PROMPT = list(range(64))


def _w(wid: str, running=0, loaded=(), known=("sql", "chat")) -> worker_pb2.WorkerInfo:
    lora = worker_pb2.LoraLoad(adapters=[worker_pb2.LoraAdapterLoad(name=n, loaded=n in loaded) for n in known],
                               max_loras=4, max_cpu_loras=4)
    return worker_pb2.WorkerInfo(worker_id=wid, load=worker_pb2.WorkerLoad(running=running, lora=lora))


def _route(policy: str, workers, adapter: str = "", **cfg) -> str:
    planner = RoutePlanner(policy, RouteConfig(**cfg), (C,))
    return planner.plan(PromptKey.of(token_ids=PROMPT, adapter=adapter), {C: workers}).decode.worker_id


def test_an_adapter_request_prefers_a_worker_that_has_it_loaded():
    workers = [_w("a", running=0), _w("b", running=3, loaded=("sql",))]
    for policy in ("least_load", "cache_aware", "round_robin"):
        assert _route(policy, workers, "sql") == "b", policy
    assert _route("least_load", workers, "chat") == "a"   # nobody has chat loaded: by load


def test_a_hot_adapter_spreads_to_idle_workers_when_its_workers_are_much_busier():
    workers = [_w("a", running=1), _w("b", running=10, loaded=("sql",))]
    assert _route("least_load", workers, "sql", balance_abs_threshold=4, balance_rel_threshold=2.0) == "a"
    # A smaller gap keeps it where it is loaded.
    assert _route("least_load", workers, "sql", balance_abs_threshold=16, balance_rel_threshold=2.0) == "b"
    # Among several loaded workers, the policy balances them.
    two = [_w("a", running=6, loaded=("sql",)), _w("b", running=2, loaded=("sql",)), _w("c", running=0)]
    assert _route("least_load", two, "sql") == "b"


def test_base_requests_are_blind_to_lora():
    plain = [_w("a", running=2, known=()), _w("b", running=1, known=())]
    with_loras = [_w("a", running=2, loaded=("sql", "chat")), _w("b", running=1)]
    for policy in ("least_load", "cache_aware"):
        assert _route(policy, plain) == _route(policy, with_loras) == "b"


def test_blind_routing_picks_an_adapter_request_as_a_base_one():
    workers = [_w("a", running=0), _w("b", running=3, loaded=("sql",))]
    for policy in ("least_load", "cache_aware"):
        assert _route(policy, workers, "sql") == "b"                        # aware: where it is loaded
        assert _route(policy, workers, "sql", lora_routing="blind") == "a"  # blind: by load alone
        assert _route(policy, workers, "sql", lora_routing="blind") == _route(policy, workers)
    with pytest.raises(ValueError, match="--lora-routing"):
        RouteConfig(lora_routing="sticky").validate()


def test_lora_routing_is_a_router_flag_that_tandem_up_forwards():
    parse = build_parser().parse_args
    static = ["router", "--prefill", "a:1", "--decode", "b:2"]
    assert RouterConfig.from_args(parse(static)).route.lora_routing == "aware"
    assert RouterConfig.from_args(parse([*static, "--lora-routing", "blind"])).route.lora_routing == "blind"
    assert "--lora-routing" not in router_args(parse(["up"]))          # not given: the router's default
    forwarded = router_args(parse(["up", "--lora-routing", "blind"]))
    assert RouterConfig.from_args(parse([*static, *forwarded])).route.lora_routing == "blind"
    with pytest.raises(SystemExit):
        parse(["up", "--lora-routing", "sticky"])


def test_the_prefix_index_keys_an_adapter_prompt_by_its_adapter():
    base, sql, chat = (PromptKey.of(token_ids=PROMPT, adapter=a) for a in ("", "sql", "chat"))
    assert base.blocks and not set(base.blocks) & set(sql.blocks) and not set(sql.blocks) & set(chat.blocks)
    assert PromptKey.of(token_ids=PROMPT, adapter="sql") == sql
    view = PrefixCacheView()
    view.record("w", base)
    assert view.cached_tokens("w", base) == 64 and view.cached_tokens("w", sql) == 0
    view.record("w", sql)
    assert view.cached_tokens("w", sql) == 64 and view.cached_tokens("w", chat) == 0
    # The router's key of a GenerateRequest naming an adapter is in that adapter's space.
    workers = [_w("w")]
    req = generation_pb2.GenerateRequest(model="sql", token_ids=generation_pb2.TokenIds(ids=PROMPT))
    assert prompt_key(req, adapter_of(req.model, workers)) == sql
    base_req = generation_pb2.GenerateRequest(model="base", token_ids=generation_pb2.TokenIds(ids=PROMPT))
    assert prompt_key(base_req, adapter_of(base_req.model, workers)) == base


def test_the_planner_records_an_adapter_prompt_under_its_key():
    planner = RoutePlanner("cache_aware", RouteConfig(), (C,))
    workers = [_w("a", loaded=("sql",)), _w("b", loaded=("sql",))]
    sql = PromptKey.of(token_ids=PROMPT, adapter="sql")
    plan = planner.plan(sql, {C: workers})
    planner.begin(plan)
    planner.end(plan)
    again = planner.plan(sql, {C: workers})
    assert again.decode.worker_id == plan.decode.worker_id and again.considered[0].cached_tokens + \
        again.considered[1].cached_tokens == 64
    base = planner.plan(PromptKey.of(token_ids=PROMPT), {C: workers})
    assert all(c.cached_tokens == 0 for c in base.considered)


def test_served_adapters_come_from_the_load_report_or_the_announcement():
    assert served_adapters(_w("a", known=("x", "y"))) == ["x", "y"]
    old = worker_pb2.WorkerInfo(worker_id="o", lora_adapters=["z"])
    assert served_adapters(old) == ["z"]
    assert served_adapters(_w("a", known=())) == []   # reported, none known (all unloaded)
    assert adapter_of("x", [_w("a", known=("x",))]) == "x" and adapter_of("q", [_w("a")]) == ""


def test_the_exact_view_hashes_an_adapter_prompt_from_the_adapter_key():
    from tandem.kvblocks.blocks import Tier
    from tandem.kvblocks.events import BlockRef, KVSnapshot
    from tandem.kvblocks.keys import Namespace
    from tandem.services.router.kv_events import KVEventIndex, block_keys
    from tandem.services.router.kv_feed import EventPrefixView
    from tandem.services.worker.kv_events import event_source

    ns, digest = Namespace("fp", "float32", 4, 2, 1, 8), "ab" * 32
    prompt = list(range(1, 42))                       # 10 full pages before the last token
    root = bytes.fromhex(digest)[:16]
    keys = block_keys(ns, prompt, root)       # what a worker publishes for the adapter's cached prompt
    parents = [root.hex(), *keys[:-1]]
    index = KVEventIndex(lambda wid: None)
    index.apply(KVSnapshot("w", 1, 0, tuple(BlockRef(k, p, Tier.DEVICE) for k, p in zip(keys, parents, strict=True))))
    w = _w("w", loaded=("sql",))
    w.load.lora.adapters[0].digest = digest
    w.kv_events.CopyFrom(event_source("t", "w", ns))
    planner = RoutePlanner("cache_aware", RouteConfig(), (C,), exact=EventPrefixView(index))
    assert planner._candidate(w, PromptKey.of(token_ids=prompt, adapter="sql")).cached_tokens == 40
    assert planner._candidate(w, PromptKey.of(token_ids=prompt)).cached_tokens == 0          # base: other keys
    w.load.lora.adapters[0].digest = ""          # not reported: the approximate view (nothing routed yet)
    assert planner._candidate(w, PromptKey.of(token_ids=prompt, adapter="sql")).cached_tokens == 0


def test_a_worker_this_router_sent_the_adapter_to_counts_as_warm_until_its_report_says_so():
    planner = RoutePlanner("least_load", RouteConfig(), (C,))
    sql = PromptKey.of(token_ids=PROMPT, adapter="sql")
    first = planner.plan(sql, {C: [_w("a"), _w("b")]})
    planner.begin(first)                       # in flight there; no report says it is loaded yet
    workers = [_w("a", running=1 if first.decode.worker_id == "a" else 0),
               _w("b", running=1 if first.decode.worker_id == "b" else 0)]
    second = planner.plan(sql, {C: workers})
    assert second.decode.worker_id == first.decode.worker_id   # least_load alone would pick the other
    planner.end(first)
    assert not planner.inflight_adapters
    assert planner.plan(PromptKey.of(token_ids=PROMPT), {C: workers}).decode.worker_id != first.decode.worker_id


def test_a_cold_adapter_avoids_workers_whose_loaded_adapters_are_all_in_use():
    full = _w("a", loaded=("x", "y"), known=("x", "y", "sql"))
    full.load.lora.max_cpu_loras = 2
    for a in full.load.lora.adapters[:2]:
        a.running = 1
    idle_slot = _w("b", running=5, loaded=("x",), known=("x", "sql"))
    assert _route("least_load", [full, idle_slot], "sql") == "b"
    assert _route("least_load", [full, idle_slot]) == "a"          # the base model: by load
    full.load.lora.adapters[0].running = 0                          # x idle: it can be evicted
    assert _route("least_load", [full, idle_slot], "sql") == "a"
