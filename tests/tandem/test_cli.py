"""`tandem --help`: every subcommand has a description and every option a help text with its default."""

from __future__ import annotations

import argparse
import re

import pytest

from tandem.cli.main import SUBCOMMANDS, HelpFormatter, build_parser, main


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("tandem",)):
    """(path, parser, {subcommand: help}) for the parser and every sub(sub)command under it."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {c.dest: c.help for s in subs for c in s._choices_actions}
    yield path, parser, helps
    for s in subs:
        for name, child in s.choices.items():
            yield from _parsers(child, (*path, name))


ALL = list(_parsers(build_parser()))


def test_the_walk_reaches_every_subcommand():
    names = {p[1] for p, _, _ in ALL if len(p) > 1}
    assert names == set(SUBCOMMANDS)
    assert {("tandem", "bench", "serve"), ("tandem", "bench", "sweep")} <= {p for p, _, _ in ALL}


@pytest.mark.parametrize(("path", "parser", "helps"), ALL, ids=[" ".join(p) for p, _, _ in ALL])
def test_every_subcommand_and_option_has_help(path, parser, helps):
    assert all((h or "").strip() for h in helps.values()), f"{' '.join(path)}: subcommands without help: {helps}"
    if len(path) > 1:
        assert (parser.description or "").strip(), f"{' '.join(path)} has no description"
    assert parser.formatter_class is HelpFormatter, f"{' '.join(path)} does not show defaults"
    missing = [a.option_strings[0] for a in parser._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not missing, f"{' '.join(path)}: options without help: {missing}"


def test_help_shows_descriptions_and_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name, (summary, _, _) in SUBCOMMANDS.items():
        assert name in out and summary.split()[0] in out
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # undo the line wrapping
    assert "--dtype" in out and "(default: auto)" in out and "(default: 50051)" in out
    assert "tokens per KV page" in out and "(default: 16)" in out
    assert "(default: None)" not in out and "(default: False)" not in out  # unset options explain themselves


def _help_entries(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """(section titles in order, {section: [each option's entry, line wrapping undone]}). An entry
    starts with its option strings, then two spaces: "--colocated N, --dp-size N  co-located ..."."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            sections[current] = []
        elif current is not None and re.match(r"  -", line):
            sections[current].append(line.strip() + "  ")
        elif current is not None and line.startswith("    ") and sections[current]:
            sections[current][-1] += line.strip() + " "
    return list(sections), sections


def _flag_of(entry: str) -> list[str]:
    """The option strings an entry starts with."""
    head = entry.split("  ", 1)[0]
    return [w.rstrip(",") for w in head.split() if w.startswith("-")]


SHARED_GROUPS = ("model", "engine", "scheduler", "speculative decoding", "LoRA adapters", "deployment",
                 "P/D disaggregation and KV transfer", "routing", "SLO planner", "admission and request limits", "security",
                 "resilience", "observability")


def test_up_help_shows_every_flag_once_in_its_group_with_its_default_once():
    parser = next(p for path, p, _ in ALL if path == ("tandem", "up"))
    titles, sections = _help_entries(parser.format_help())
    assert [t for t in titles if t in SHARED_GROUPS] == list(SHARED_GROUPS)   # all present, in this order
    assert [e.split()[0] for e in sections["options"]] == ["-h,"]              # nothing left ungrouped
    shown = [f for t in titles if t != "options" for e in sections[t] for f in _flag_of(e)]
    defined = [s for a in parser._actions if not isinstance(a, argparse._HelpAction) for s in a.option_strings]
    assert sorted(shown) == sorted(defined) and len(shown) == len(set(shown)), "a flag missing or shown twice"
    for title in titles:
        for entry in sections[title]:
            assert entry.count("(default:") <= 1 and entry.lower().count("default:") <= 1, entry
            assert not re.search(r"\(default: (True|False|None|)\)", entry), entry
    entries = {f: e for t in titles for e in sections[t] for f in _flag_of(e)}
    assert "(default: on)" in entries["--enable-mixed-chunk"] and "default" not in entries["--disable-mixed-chunk"]
    from tandem.services.worker.config import WorkerConfig
    assert f"(default: {WorkerConfig(role='').drain_timeout_s})" in entries["--drain-timeout"]
    assert entries["--policy"].rstrip().endswith("(cache_aware) (default: cache_aware)")


@pytest.mark.parametrize(("path", "parser"), [(p, parser) for p, parser, _ in ALL if len(p) > 1],
                         ids=[" ".join(p) for p, _, _ in ALL if len(p) > 1])
def test_every_subcommands_help_builds_with_each_flag_in_one_group(path, parser):
    text = parser.format_help()
    titles, sections = _help_entries(text)
    for title in titles:
        for entry in sections[title]:
            assert entry.lower().count("default:") <= 1, f"{' '.join(path)}: {entry}"
    groups = [g for g in parser._action_groups if g._group_actions]
    for action in parser._actions:
        homes = [g.title for g in groups if action in g._group_actions]
        assert len(homes) == 1, (action.option_strings, homes)
    if path[1] in ("up", "prefill", "decode", "colocated", "router", "gateway", "generate"):
        ungrouped = [a.option_strings for a in parser._actions
                     if a.option_strings and not isinstance(a, argparse._HelpAction)
                     and a in parser._optionals._group_actions]
        assert not ungrouped, f"{' '.join(path)}: flags outside any group: {ungrouped}"
        assert set(titles) - {"options"} <= set(SHARED_GROUPS) | {"prompt and sampling"}
