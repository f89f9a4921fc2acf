"""The flags that `tandem bench serve|sweep` and the load tests under bench/ share, declared once.

Each `add_*` function adds only the flags it is given a default for, with that default: a script
keeps its own. For example

    add_load_flags(p, request_rate=2.0, num_prompts=48, input_len=256, output_len=64)

adds --request-rate, --num-prompts, --input-len and --output-len (and nothing else). A flag's name,
type and help are the same everywhere; `helps={"num_prompts": "..."}` replaces the help where a
script's flag means something narrower. Every help ends with the flag's default unless it says one
already (or there is none), whatever the parser's formatter. Flags only one script has stay in it.
Stdlib only and light: `tandem`'s CLI imports it.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


OMIT: Any = _Marker("OMIT")          # the default of every keyword: that flag is not added
REQUIRED: Any = _Marker("REQUIRED")  # instead of a default: the flag must be given

_SAYS_DEFAULT = re.compile(r"\(default\b|\bdefault:", re.IGNORECASE)   # a help that says its default


def floats(text: str) -> tuple[float, ...]:
    """"0.5,1,inf" -> (0.5, 1.0, inf): the type of the comma-separated rate (and percentile) flags."""
    try:
        return tuple(math.inf if t.strip().lower() == "inf" else float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers or inf, got {text!r}") from None


@dataclass(frozen=True)
class _Flag:
    option: str
    type: Callable[[str], Any] | None
    help: str


LOAD_FLAGS: dict[str, _Flag] = {
    "request_rate": _Flag("--request-rate", float, "requests/s, Poisson arrivals (inf = all at once)"),
    "num_prompts": _Flag("--num-prompts", int, "requests per run"),
    "input_len": _Flag("--input-len", int, "prompt tokens of each request"),
    "output_len": _Flag("--output-len", int, "output tokens of each request"),
    "range_ratio": _Flag("--range-ratio", float, "lengths uniform in [L*(1-r), L*(1+r)]"),
    "seed": _Flag("--seed", int, "seed of the prompts and the arrival times"),
    "max_tokens": _Flag("--max-tokens", int, "max_tokens of each request"),
    "burstiness": _Flag("--burstiness", float, "gamma shape of arrival gaps: 1 = Poisson"),
    "max_concurrency": _Flag("--max-concurrency", int, "at most this many requests in flight"),
    "num_warmups": _Flag("--num-warmups", int, "requests sent one by one before measuring"),
    "slo": _Flag("--slo", None, "goodput SLOs, e.g. ttft=2s,tpot=150ms (bare numbers are ms)"),
}
# A tuple default makes --request-rate a comma-separated list: one run per rate.
_RATES = _Flag("--request-rate", floats, "requests/s, comma-separated for several runs (inf = all at once)")

STACK_FLAGS: dict[str, _Flag] = {
    "model": _Flag("--model", None, "model alias or local HF folder"),
    "up_args": _Flag("--up-args", None, "extra `tandem up` flags, e.g. \"--kv-cache-gb 0.5\""),
    "start_timeout": _Flag("--start-timeout", float, "seconds a deployment may take to come up"),
}


def _help(text: str, default: Any) -> str:
    if default is None or default is False or default in ("", ()) or default is REQUIRED or _SAYS_DEFAULT.search(text):
        return text
    return f"{text} (default: %(default)s)"


def _add(p, table: Mapping[str, _Flag], given: Mapping[str, Any], helps: Mapping[str, str] | None) -> None:
    unknown = set(helps or ()) - set(table)
    if unknown:
        raise TypeError(f"helps for flags that do not exist here: {sorted(unknown)}")
    for name, flag in table.items():
        default = given[name]
        if default is OMIT:
            continue
        if name == "request_rate" and isinstance(default, tuple):
            flag = _RATES
        text = (helps or {}).get(name, flag.help)
        kwargs: dict[str, Any] = {"help": _help(text, default)}
        if flag.type is not None:
            kwargs["type"] = flag.type
        if default is REQUIRED:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        p.add_argument(flag.option, **kwargs)


def add_load_flags(p, *, request_rate=OMIT, num_prompts=OMIT, input_len=OMIT, output_len=OMIT, range_ratio=OMIT,
                   seed=OMIT, max_tokens=OMIT, burstiness=OMIT, max_concurrency=OMIT, num_warmups=OMIT, slo=OMIT,
                   helps: Mapping[str, str] | None = None) -> None:
    """The workload and load flags given a default, in this order. `request_rate`: a float (one rate),
    or a tuple (comma-separated rates, one run each, `floats`). `slo` is the text SLO.parse takes."""
    _add(p, LOAD_FLAGS, locals(), helps)


def add_stack_flags(p, *, model=OMIT, up_args=OMIT, start_timeout=OMIT, helps: Mapping[str, str] | None = None) -> None:
    """The flags of a benchmark that starts `tandem up` itself: --model (REQUIRED: no default),
    --up-args (the text; split it with shlex), --start-timeout (s)."""
    _add(p, STACK_FLAGS, locals(), helps)


def add_out_flag(p, default: Any = None, *, help: str = "results JSON", type: Callable[[str], Any] | None = None,
                 required: bool = False) -> None:
    """--out: where the results go (JSON: written with tandem.bench.results.write_result). `type`:
    argparse's (None: the text; Path...)."""
    kwargs: dict[str, Any] = {"required": True} if required else {"default": default}
    if type is not None:
        kwargs["type"] = type
    p.add_argument("--out", help=help if required else _help(help, default), **kwargs)


def add_progress_flags(p, *, save_requests: bool = False) -> None:
    """--no-progress, and with `save_requests` --no-save-requests (per-request records left out)."""
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    if save_requests:
        p.add_argument("--no-save-requests", action="store_true", help="leave per-request records out of the JSON")
