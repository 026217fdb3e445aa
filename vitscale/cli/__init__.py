"""The `vitscale` command. Thin on purpose: parse arguments, load config, call one function per verb.

Each group of verbs lives in its own module with its arguments next to its command (`models.py`,
`run.py`, `weights.py`, `shards.py`, `study.py`); this module builds the parser from them and turns
errors into one line. Heavy imports (torch, ray, deepspeed) happen inside the verb that needs them,
so `vitscale config` and `--help` answer instantly.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
from collections.abc import Callable, Sequence
from typing import Any

from vitscale.cli import models, run, shards, study, weights
from vitscale.cli.interrupt import Signalled, as_interruptions, is_writing
from vitscale.cli.parser import Parser, chosen_parser
from vitscale.config.suggest import did_you_mean

GROUPS = (run, models, weights, study, shards)
"""The verb groups, in the order `vitscale --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    """The whole `vitscale` parser: every group's verbs."""
    from vitscale._version import __version__

    parser = Parser(prog="vitscale",
                    description="Pre-train Vision Transformers at scale on Ray Train + DeepSpeed ZeRO.")
    parser.add_argument("--version", action="version", version=f"vitscale {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, func: Callable[[argparse.Namespace], int], help: str,
             into: Any = None) -> argparse.ArgumentParser:
        p = (verbs if into is None else into).add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    for group in GROUPS:
        group.add_verbs(verbs, verb)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `vitscale` console script.

    Errors that are the user's to fix (a setting, the data, storage, a file: `launch/errors.py`) are one
    line and exit 2; a failed stage is one line after the workers' own output and exits 1; Ctrl-C is one
    line and exits 130; SIGTERM or SIGHUP to a verb that writes files (`interrupt.writes`) cleans up as
    Ctrl-C does and exits 128 + the signal's number; a reader that closed the pipe early (`| head`) ends
    the verb quietly, exit 141 (128 + SIGPIPE, as a shell's own commands). Anything else is a bug and
    keeps its traceback.
    """
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, where it is handled, not at the interpreter's exit
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe (a socket, a child process): a bug's traceback
        # Nothing more can reach the reader: later writes and the exit's flush go nowhere, silently.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _stdout_closed() -> bool:
    """Whether the broken pipe is our standard output: a pipe whose reader is gone polls as an error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or no file behind stdout: not ours to judge
        return False


def _main(argv: Sequence[str] | None) -> int:
    from vitscale.config.checks import ConfigError
    from vitscale.launch.errors import PipelineFailed, known_errors

    # Before Ray is imported (it reads the variable then; Ray's logging guide documents it): the console
    # routes every forwarded line itself, and Ray's de-duplication would hold repeated lines back and
    # print them late, after the summary and the final JSON line.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        chosen = chosen_parser(parser, args)
        flags = [flag for action in chosen._actions for flag in action.option_strings]
        hints = "".join(did_you_mean(item.partition("=")[0], flags) for item in extra if item.startswith("-"))
        chosen.error(f"unrecognized arguments: {' '.join(extra)}{hints}")
    args.command_line = ["vitscale", *(sys.argv[1:] if argv is None else argv)]  # what an interrupted run repeats
    try:
        with as_interruptions(is_writing(args.func)):  # SIGTERM/SIGHUP clean up as Ctrl-C does
            return int(args.func(args))
    except Signalled as exc:
        print(f"vitscale: {exc}", file=sys.stderr)  # "interrupted by SIGTERM"
        return exc.exit_code
    except KeyboardInterrupt as exc:  # `vitscale run` says where the run is kept and how to resume it
        print(f"vitscale: {str(exc) or 'interrupted'}", file=sys.stderr)
        return int(getattr(exc, "exit_code", 130))
    except known_errors() as exc:
        text = from_set(exc, getattr(args, "set", ())) if isinstance(exc, ConfigError) else str(exc)
        print(f"vitscale: error: {one_line(text)}", file=sys.stderr)
        return 2
    except PipelineFailed as exc:
        # Each failed rank's traceback is in the run's log (`launch/ray_train.py`); end with who failed and why.
        print(f"vitscale: error: {one_line(str(exc))}", file=sys.stderr)
        return 1


def one_line(text: str) -> str:
    """An error as the one line the CLI promises, whatever a library's message held (newlines, tabs)."""
    return " ".join(text.split())


def from_set(exc: Exception, overrides: Sequence[str]) -> str:
    """The error's line, naming the `--set KEY=VALUE` the bad value came from (not the pipeline file)."""
    key = getattr(exc, "key", "")
    for item in reversed(list(overrides)):  # the last --set of a key is the one that counts
        given = item.partition("=")[0].strip()
        for blamed in (key, *getattr(exc, "also", ())):
            if blamed == given or blamed.startswith((f"{given}.", f"{given}[")) or given.startswith(f"{blamed}."):
                return f"{key}: {getattr(exc, 'message', exc)} (from --set {item})"
    return str(exc)


if __name__ == "__main__":
    raise SystemExit(main())
