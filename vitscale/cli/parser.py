"""The parser the CLI is built with: defaults in every --help, "did you mean" for mistyped verbs and flags."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any, Protocol

from vitscale.config.suggest import did_you_mean


class VerbFn(Protocol):
    """Adds one verb: `verb(name, command, help[, into])` -> its parser (`into`: a group's sub-parsers)."""

    def __call__(self, name: str, func: Callable[[argparse.Namespace], int], help: str,
                 into: Any = None) -> argparse.ArgumentParser: ...


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it already says it or has none worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default == [] or default is argparse.SUPPRESS
                or "default" in text or not (action.option_strings or action.nargs in ("?", "*"))):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for a mistyped verb or choice, and defaults in every --help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # argparse's own signature; it exits
        found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if found:
            message += did_you_mean(found.group(1), re.findall(r"'([^']*)'", found.group(2)))
        super().error(message)


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)parser of the verb `args` selected: its flags are the ones a mistyped flag is matched to."""
    for action in parser._actions:  # argparse keeps no public list of its sub-parsers
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return chosen_parser(action.choices[name], args)
    return parser


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))
