"""bench/flags.py: the load-test flags declared once; each script keeps its own defaults; no script
under bench/ (nor `tandem bench`) declares them again by hand."""

from __future__ import annotations

import argparse
import importlib
import math
import re
from pathlib import Path

import pytest

from tandem.bench import flags
from tandem.bench.flags import (
    REQUIRED,
    add_load_flags,
    add_out_flag,
    add_progress_flags,
    add_stack_flags,
    floats,
)
from tandem.cli.command import HelpFormatter

ROOT = Path(__file__).resolve().parents[2]


def test_only_the_flags_given_are_added_with_the_defaults_given():
    p = argparse.ArgumentParser()
    add_load_flags(p, request_rate=2.0, num_prompts=48, input_len=256, output_len=64, seed=0)
    a = p.parse_args([])
    assert (a.request_rate, a.num_prompts, a.input_len, a.output_len, a.seed) == (2.0, 48, 256, 64, 0)
    a = p.parse_args(["--request-rate", "inf", "--num-prompts", "5", "--input-len", "7", "--output-len", "3",
                      "--seed", "9"])
    assert (a.request_rate, a.num_prompts, a.input_len, a.output_len, a.seed) == (math.inf, 5, 7, 3, 9)
    with pytest.raises(SystemExit):
        p.parse_args(["--max-tokens", "3"])       # not asked for
    q = argparse.ArgumentParser()
    add_load_flags(q, num_prompts=None, output_len=1)
    assert vars(q.parse_args([])) == {"num_prompts": None, "output_len": 1}


def test_every_flag_parses_with_its_type():
    p = argparse.ArgumentParser()
    add_load_flags(p, **{name: None for name in flags.LOAD_FLAGS})
    add_stack_flags(p, **{name: None for name in flags.STACK_FLAGS})
    add_out_flag(p)
    add_progress_flags(p, save_requests=True)
    a = p.parse_args(["--request-rate", "1.5", "--num-prompts", "2", "--input-len", "3", "--output-len", "4",
                      "--range-ratio", "0.5", "--seed", "6", "--max-tokens", "7", "--burstiness", "0.5",
                      "--max-concurrency", "9", "--num-warmups", "1", "--slo", "ttft=2s", "--model", "m",
                      "--up-args", "--kv-cache-gb 0.5", "--start-timeout", "60", "--out", "o.json",
                      "--no-progress", "--no-save-requests"])
    assert vars(a) == {"request_rate": 1.5, "num_prompts": 2, "input_len": 3, "output_len": 4, "range_ratio": 0.5,
                       "seed": 6, "max_tokens": 7, "burstiness": 0.5, "max_concurrency": 9, "num_warmups": 1,
                       "slo": "ttft=2s", "model": "m", "up_args": "--kv-cache-gb 0.5", "start_timeout": 60.0,
                       "out": "o.json", "no_progress": True, "no_save_requests": True}


def test_a_tuple_of_rates_makes_a_comma_separated_flag():
    p = argparse.ArgumentParser()
    add_load_flags(p, request_rate=(math.inf,))
    assert p.parse_args([]).request_rate == (math.inf,)
    assert p.parse_args(["--request-rate", "0.5,1,inf"]).request_rate == (0.5, 1.0, math.inf)
    assert floats(" 1, 2 ,") == (1.0, 2.0)
    with pytest.raises(argparse.ArgumentTypeError):
        floats("1,x")


def test_required_model_out_types_and_unknown_helps():
    p = argparse.ArgumentParser()
    add_stack_flags(p, model=REQUIRED)
    add_out_flag(p, Path("r.json"), type=Path)
    with pytest.raises(SystemExit):
        p.parse_args([])
    a = p.parse_args(["--model", "m", "--out", "x.json"])
    assert a.model == "m" and a.out == Path("x.json")
    assert p.parse_args(["--model", "m"]).out == Path("r.json")
    with pytest.raises(TypeError, match="max_token"):
        add_load_flags(argparse.ArgumentParser(), max_tokens=1, helps={"max_token": "typo"})


@pytest.mark.parametrize("formatter", [argparse.HelpFormatter, argparse.ArgumentDefaultsHelpFormatter,
                                       argparse.RawDescriptionHelpFormatter, HelpFormatter])
def test_help_says_the_default_once_whatever_the_formatter(formatter):
    p = argparse.ArgumentParser(formatter_class=formatter)
    add_load_flags(p, num_prompts=48, output_len=None, slo="", helps={"num_prompts": "requests per policy"})
    add_stack_flags(p, model=None, helps={"model": "model path (default: the engine's)"})
    add_out_flag(p, "bench/results/x.json")
    text = " ".join(p.format_help().split())
    assert text.count("requests per policy (default: 48)") == 1 and text.count("default: 48") == 1
    assert text.count("(default: bench/results/x.json)") == 1
    assert text.count("model path (default: the engine's)") == 1
    if formatter is not argparse.ArgumentDefaultsHelpFormatter:   # that one shows every default, None too
        assert "default: None" not in text and "(default: )" not in text


def _parser_of(module: str) -> argparse.ArgumentParser:
    """The parser a script's main() (planner: parse_args()) builds, caught before it parses."""
    class Caught(Exception):
        pass

    def catch(self, args=None, namespace=None):
        raise Caught(self)

    mod = importlib.import_module(module)
    entry = mod.parse_args if module == "tandem.bench.planner" else mod.main
    mp = pytest.MonkeyPatch()
    mp.setattr(argparse.ArgumentParser, "parse_args", catch)
    mp.setattr("sys.argv", [module])
    try:
        entry([]) if entry.__code__.co_argcount else entry()
    except Caught as e:
        return e.args[0]
    finally:
        mp.undo()
    raise AssertionError(f"{module} did not build a parser")


# Each script's own defaults, as they were before the flags moved to bench/flags.py.
SCRIPT_DEFAULTS = {
    "tandem.bench.profile_serve": {"request_rate": 2.0, "num_prompts": 48, "input_len": 256, "output_len": 64,
                                   "up_args": "", "out": "bench/results/profile_serve.json"},
    "tandem.bench.tracing_overhead": {"request_rate": 2.0, "num_prompts": 200, "input_len": 512, "output_len": 128,
                                      "seed": 0, "model": "smollm2-135m", "up_args": "", "start_timeout": 600.0,
                                      "out": "bench/results/tracing_overhead.json"},
    "tandem.bench.routing": {"num_prompts": 32, "slo": "ttft=5s,tpot=500ms", "rate": "1"},
    "tandem.bench.sched_sim": {"num_prompts": 128, "input_len": 256, "output_len": 64, "slo": "ttft=2s,tpot=150ms",
                               "request_rates": "1,2", "out": None},
    "tandem.bench.planner": {"model": "smollm2-135m", "seed": 0, "burstiness": 1.0, "range_ratio": 0.0,
                             "max_concurrency": None, "num_warmups": 2, "slo": "ttft=2s,tpot=150ms", "up_args": "",
                             "start_timeout": 600.0, "out": "bench/results/planner.json", "no_progress": False,
                             "no_save_requests": False},
    "tandem.bench.chaos": {"max_tokens": 8, "rate": 4.0, "out": Path("bench/results/chaos.json")},
    "tandem.bench.gateway": {"model": "smollm2-135m", "max_tokens": 4, "out": Path("bench/results/gateway.json")},
    "tandem.bench.structured_pd": {"model": "smollm2-135m", "max_tokens": 128, "num_warmups": 2, "up_args": "",
                                   "start_timeout": 600.0, "out": "bench/results/structured_pd.json"},
    "tandem.bench.step_noise": {"input_len": 256, "out": None},
    "tandem.bench.lora_routing": {"request_rate": 1.0, "num_prompts": 60, "input_len": 64, "seed": 0, "max_tokens": 16,
                                  "num_warmups": 16, "model": "smollm2-135m", "up_args": "--local-prefill-max-tokens -1",
                                  "start_timeout": 600.0, "out": "bench/results/lora_routing.json"},
}


@pytest.mark.parametrize("module", sorted(SCRIPT_DEFAULTS))
def test_each_script_keeps_its_own_defaults(module):
    p = _parser_of(module)
    given = ["--model", "m"] if module == "tandem.bench.chaos" else ["shared-prefix", "--out", "o"] \
        if module == "tandem.bench.routing" else ["--step-cost", "1,2,3"] if module == "tandem.bench.sched_sim" else []
    a = vars(argparse.ArgumentParser.parse_args(p, given))
    expected = SCRIPT_DEFAULTS[module]
    assert {k: a[k] for k in expected} == expected


def test_kvtiers_keeps_its_defaults_and_parses_its_slo():
    from tandem.bench.serve import kvtiers
    from tandem.bench.serve.metrics import SLO

    p = argparse.ArgumentParser()
    kvtiers.add_arguments(p)
    d = kvtiers.KVTiersConfig()
    cfg = kvtiers.config_from_args(p.parse_args([]))
    assert (cfg.slo, cfg.output_len, cfg.range_ratio, cfg.seed, cfg.num_warmups, cfg.start_timeout_s, cfg.out) == \
        (d.slo, d.output_len, d.range_ratio, d.seed, d.num_warmups, d.start_timeout_s, d.out) == \
        (SLO(ttft=2.0, tpot=0.5), 48, 0.33, 0, 2, 600.0, "bench/results/kvtiers.json")
    assert kvtiers.config_from_args(p.parse_args(["--slo", "ttft=1s"])).slo == SLO(ttft=1.0)
    with pytest.raises(ValueError, match="bad SLO"):
        kvtiers.config_from_args(p.parse_args(["--slo", "fast"]))


def test_tandem_bench_serve_and_sweep_keep_their_flags():
    from tandem.cli.main import build_parser

    parse = build_parser().parse_args
    s = parse(["bench", "serve"])
    assert (s.request_rate, s.num_prompts, s.input_len, s.output_len, s.range_ratio, s.seed) == \
        ((math.inf,), None, 256, None, 0.0, 0)
    assert (s.burstiness, s.max_concurrency, s.num_warmups, s.slo, s.out, s.no_progress, s.no_save_requests) == \
        (1.0, None, 1, "", None, False, False)
    w = parse(["bench", "sweep"])
    assert (w.request_rates, w.num_prompts, w.num_warmups, w.slo, w.out, w.up_args, w.start_timeout) == \
        ((0.5, 1.0, 2.0, 4.0), None, 2, "ttft=2s,tpot=150ms", "bench/results/sweep.json", "", 600.0)
    assert parse(["bench", "serve", "--request-rate", "1,inf"]).request_rate == (1.0, math.inf)


# ---- no script declares them again ----------------------------------------------------------------

SHARED = ("--request-rate", "--num-prompts", "--input-len", "--output-len", "--range-ratio", "--seed",
          "--max-tokens", "--burstiness", "--max-concurrency", "--num-warmups", "--slo", "--up-args",
          "--start-timeout", "--out", "--no-progress", "--no-save-requests")
# (file, flag) declared by hand on purpose, with why.
BY_HAND = {
    ("tandem/cli/bench_cmd.py", "--seed"): "tests/tandem/test_flags.py knows the workload's --seed as "
                                           "tandem.cli.bench_cmd's (a homonym of `tandem generate --seed`)",
    ("bench/kvtransfer.py", "--seed"): "the seed of the pages it moves, not of a workload",
}
_DECLARED = re.compile(r"add_argument\(\s*[\"'](--[a-z0-9-]+)[\"']")


def test_no_script_declares_a_shared_flag_by_hand():
    sources = [*sorted((ROOT / "bench").rglob("*.py")), ROOT / "tandem" / "cli" / "bench_cmd.py"]
    found = []
    for path in sources:
        rel = path.relative_to(ROOT).as_posix()
        if rel == "bench/flags.py":
            continue
        for m in _DECLARED.finditer(path.read_text()):
            if m.group(1) in SHARED and (rel, m.group(1)) not in BY_HAND:
                found.append(f"{rel}: {m.group(1)}")
    assert not found, f"declared again instead of with tandem.bench.flags: {found}"
    for rel, flag in BY_HAND:
        assert re.search(rf"add_argument\(\s*[\"']{flag}[\"']", (ROOT / rel).read_text()), (rel, flag)
