"""How `pdserve` help reads: every option's line ends with its default.

Runs in the CLI process. `DefaultsHelpFormatter` appends ``(default: X)`` to an option's help
when the option has a default worth showing — not for flags (`store_true`), nor for None / an
empty value, nor when the help already says what the default is (it contains "default") — and
writes list defaults as the comma lists the options take (``0.25,0.5``). `shown_default(action)`
is that decision, for tests. `use_defaults_help(parser)` gives a parser and all its subcommands
the formatter (the subcommand modules build their parsers with `subparsers.add_parser`).
"""

from __future__ import annotations

import argparse


def shown_default(action: argparse.Action) -> str | None:
    """The text ``(default: X)`` shows for `action`, or None when no default is shown."""
    d = action.default
    if d is None or d is argparse.SUPPRESS or action.nargs == 0 or action.required:
        return None
    if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
        return None  # a required positional
    if isinstance(d, (list, tuple)):
        return ",".join(str(x) for x in d) if d else None
    text = str(d)
    return text or None


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, plus ``(default: X)`` where `shown_default` gives one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = shown_default(action)
        if default is None or "default" in text.lower():
            return text
        return f"{text} (default: {default.replace('%', '%%')})".lstrip()


def subcommand_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """name -> parser of every subcommand of `parser` (empty without subcommands)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def use_defaults_help(parser: argparse.ArgumentParser) -> None:
    """Give `parser` and each of its subcommands `DefaultsHelpFormatter`."""
    for p in (parser, *subcommand_parsers(parser).values()):
        p.formatter_class = DefaultsHelpFormatter
