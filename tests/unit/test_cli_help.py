"""The `pdserve` command line reads well: every option of every subcommand has a help line that
shows its default (or says what leaving it out means), list-valued options say they take lists,
`--log-level` works after the subcommand, and `generate` against a dead port says what to check.
"""

from __future__ import annotations

import argparse
import socket

import pytest

from deploy.cli import build_parser, main
from deploy.cli_help import DefaultsHelpFormatter, shown_default, subcommand_parsers

PARSER = build_parser()
SUBCOMMANDS = subcommand_parsers(PARSER)


def _options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if not isinstance(a, argparse._HelpAction)]


def _in_required_group(p: argparse.ArgumentParser, action: argparse.Action) -> bool:
    """One of a required either-or group (`--prompt | --token-ids`): it has no default."""
    return any(g.required and action in g._group_actions for g in p._mutually_exclusive_groups)


def test_there_are_subcommands_to_check() -> None:
    assert {"make-model", "batch", "up", "generate", "bench", "demo", "plan"} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_option_has_help_that_shows_its_default(name: str) -> None:
    p = SUBCOMMANDS[name]
    assert p.formatter_class is DefaultsHelpFormatter
    formatter = p._get_formatter()
    for action in _options(p):
        flag = "/".join(action.option_strings) or action.dest
        assert action.help and action.help is not argparse.SUPPRESS, f"{name} {flag}: no help"
        text = formatter._expand_help(action)
        default = shown_default(action)
        if default is not None:
            assert f"(default: {default})" in text or "default" in action.help.lower(), (
                f"{name} {flag}: help does not show the default {default!r}: {text!r}"
            )
        elif not (action.required or action.nargs == 0 or _in_required_group(p, action)):
            # No argparse default (None): the help must say what happens when it is left out.
            assert "default" in text.lower(), f"{name} {flag}: what is the default? {text!r}"


def test_list_valued_options_say_they_take_lists() -> None:
    checked = 0
    for name, p in SUBCOMMANDS.items():
        for action in _options(p):
            if isinstance(action.default, tuple) or getattr(action.type, "__name__", "") in (
                "_ints",
                "_floats",
                "_names",
            ):
                assert "comma list" in (action.help or ""), f"{name} {action.option_strings}"
                assert action.metavar and "," in str(action.metavar), action.option_strings
                checked += 1
    assert checked >= 5  # plan --chunk-tokens/--max-num-seqs, bench --configs/--rates/...


def test_the_issues_examples_show_their_defaults() -> None:
    def help_of(cmd: str) -> str:
        return " ".join(SUBCOMMANDS[cmd].format_help().split())

    assert "(default: tiny)" in help_of("make-model")
    assert "(default: models/smollm2-135m-instruct)" in help_of("demo")
    assert "(default: auto)" in help_of("batch")  # --dtype
    bench = help_of("bench")
    for shown in ("(default: summarize)", "(default: poisson)", "(default: 5.0)", "(default: 2)"):
        assert shown in bench
    generate = help_of("generate")
    assert "(default: 1.0, off)" in generate and "(default: 0)" in generate


def test_log_level_is_accepted_before_or_after_the_subcommand() -> None:
    base = ["generate", "--addr", "h:1", "--prompt", "x"]
    assert PARSER.parse_args(base).log_level is None
    assert PARSER.parse_args(["--log-level", "DEBUG", *base]).log_level == "DEBUG"
    assert PARSER.parse_args([*base, "--log-level", "DEBUG"]).log_level == "DEBUG"
    up = PARSER.parse_args(["up", "--model", "m", "--log-level", "WARNING"])
    assert (up.log_level, up.default_log_level) == ("WARNING", "INFO")


def test_generate_against_a_dead_port_says_what_to_check(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = main(["generate", "--addr", f"127.0.0.1:{port}", "--prompt", "hi", "--timeout", "10"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "UNAVAILABLE" in err and "is `pdserve up` running there?" in err, err
