"""The parser the CLI is built with: defaults in every --help, "did you mean" for mistyped verbs and flags."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from vitscale.config.location import endpoint_ok, is_url
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
        message += self._list_swallowed(message)
        super().error(message)

    def _list_swallowed(self, message: str) -> str:
        """Why `--shots 1 5 RUN` fails: a list option takes every value up to the next flag, the positional too."""
        found = re.match(r"argument (--[\w-]+): invalid \w+ value: '([^']*)'", message)
        lists = {flag for action in self._actions if action.nargs in ("+", "*") for flag in action.option_strings}
        positionals = [str(action.metavar or action.dest) for action in self._actions
                       if not action.option_strings and action.nargs != argparse.PARSER]
        # Only where the value is plainly the positional (a path or URL): `--shots x` is a typo, said as is.
        if (not found or found.group(1) not in lists or not positionals
                or not (os.path.exists(found.group(2)) or is_url(found.group(2)))):
            return ""
        flag = found.group(1)
        return (f" ({flag} takes every value up to the next flag: put {' '.join(positionals).upper()} before "
                f"{flag}, or end its values with --)")


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)parser of the verb `args` selected: its flags are the ones a mistyped flag is matched to."""
    for action in parser._actions:  # argparse keeps no public list of its sub-parsers
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return chosen_parser(action.choices[name], args)
    return parser


ENDPOINT_HELP = "S3-compatible endpoint URL (default: $VITSCALE_S3_ENDPOINT_URL, else $AWS_ENDPOINT_URL, else AWS)"


def add_endpoint_url(p: argparse.ArgumentParser) -> None:
    """The `--endpoint-url` of every verb that reads or writes object storage, checked as `data.endpoint_url` is
    (`config/location.py` `endpoint_ok`): a malformed one is one line naming the flag, not boto3's at first use."""
    def endpoint(text: str) -> str:
        if not endpoint_ok(text):
            raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL of a host (e.g. http://minio:9000), "
                                             f"got {text!r}")
        return text

    p.add_argument("--endpoint-url", default=None, type=endpoint, help=ENDPOINT_HELP)


def model_options(items: Sequence[str]) -> dict[str, Any]:
    """The `--option KEY=VALUE`s of `flops`, `fewshot` and `inspect` as a pipeline's `model:` section reads them
    (YAML values, through `--set`'s parser); a malformed one is the error naming `--option`, not `--set`."""
    from vitscale.config.checks import ConfigError
    from vitscale.config.loader import apply_override

    options: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--option {item}", "must look like KEY=VALUE, a model option (e.g. depth=6)")
        try:
            options = apply_override(options, item)
        except ConfigError as exc:
            raise ConfigError(f"--option {exc.key}", exc.message) from None
    return options


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


@contextmanager
def writing(doing: str) -> Iterator[None]:
    """A file a verb could not write (a full disk, an I/O error, a read-only place) as one line saying what was
    being written (`doing`), as `shards write` says it; the verb's own writes already removed what they began."""
    from vitscale.config.errors import UserError
    from vitscale.data.storage.base import StorageError

    try:
        yield
    except OSError as exc:
        if isinstance(exc, (StorageError, FileNotFoundError)):  # already one line (the CLI's known errors)
            raise
        raise UserError(f"{doing}: {type(exc).__name__}: {exc}") from exc


@contextmanager
def naming_flags(flags: dict[str, str]) -> Iterator[None]:
    """Within: an error of a key in `flags` (a parameter of the function a verb calls, `shard_size`) names the flag
    that set it (`--shard-size`): the check is the function's own, said in the verb's words."""
    from vitscale.config.checks import ConfigError

    try:
        yield
    except ConfigError as exc:
        key = exc.key.split("[", 1)[0]  # `fewshot.shots[1]`: an item of what the flag set
        if key not in flags:
            raise
        raise ConfigError(flags[key], exc.message) from None
