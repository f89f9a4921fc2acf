"""`tandem --help`: every subcommand has a description and every option a help text with its default."""

from __future__ import annotations

import argparse

import pytest

from tandem.cli import SUBCOMMANDS, HelpFormatter, build_parser, main


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
