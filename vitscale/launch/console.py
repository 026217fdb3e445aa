"""What the user's terminal shows during `vitscale run`: vitscale's own lines, not the libraries' chatter.

Ray forwards every worker's and actor's stdout/stderr to the driver (Ray Train's per-report
dumps, DeepSpeed's config tables, accelerator warnings). Unless `--verbose`, that stream goes
to `RUN_DIR/logs/ray.log` in full, and only lines vitscale printed itself (they start with
"[vitscale]") reach the terminal. The driver's own Ray loggers are treated the same way:
warnings and errors still show, INFO goes to the log file.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

PREFIX = "[vitscale]"
_WORKERS_QUIET = threading.Event()
"""Set while workers' own lines go to the log only (`workers_off_terminal`)."""
_RAY_HANDLER = "ray_print_logs"  # the name ray.init gives its own printing handler


class LogRouter:
    """Routes Ray's forwarded worker output: everything to a file, vitscale's lines to the terminal."""

    def __init__(self, log_path: Path, console: TextIO | None = None):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "a", buffering=1)
        self.console = console or sys.stdout
        self._lock = threading.Lock()

    def __call__(self, data: dict[str, Any]) -> None:
        who = data.get("actor_name") or data.get("task_name") or "worker"
        tag = f"({who} pid={data.get('pid')}, ip={data.get('ip')})"
        with self._lock:
            for line in data.get("lines", ()):
                self.log.write(f"{tag} {line}\n")
                if line.lstrip().startswith(PREFIX) and not _WORKERS_QUIET.is_set():
                    self.console.write(line.lstrip() + "\n")
            self.console.flush()


def quiet_driver_logs(log_path: Path, *, verbose: bool) -> None:
    """Before `ray.init`: Ray's and DeepSpeed's driver-side INFO lines go to `log_path`; warnings stay visible."""
    if verbose:
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(log_path)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("ray", "DeepSpeed", "deepspeed"):
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setLevel(max(handler.level, logging.WARNING))
                handler.addFilter(_not_notices)
        logger.addHandler(file_handler)


NOTICES = ("authentication_token_setup",)
"""Modules whose warnings are notices, not problems: Ray's "token authentication is enabled" (what
vitscale wants; docs say how to pass the token). They go to the log file only."""


def _not_notices(record: logging.LogRecord) -> bool:
    return record.module not in NOTICES


def route_ray_output(log_path: Path, *, verbose: bool) -> str | None:
    """After `ray.init`: send worker output to `log_path`, keep vitscale's lines on the terminal.

    Returns a line saying where the full log is, or None when nothing was rerouted (verbose, or a
    Ray without the hook this relies on: then the terminal shows everything, as Ray does).
    """
    if verbose:
        return None
    try:
        from ray._private import worker as ray_worker

        dispatcher = ray_worker.global_worker_stdstream_dispatcher
        dispatcher.remove_handler(_RAY_HANDLER)
        dispatcher.remove_handler("vitscale")  # a previous run's router in this process
        dispatcher.add_handler("vitscale", LogRouter(log_path))
    except (ImportError, AttributeError, KeyError, ValueError):
        return None
    return f"workers' full output: {log_path} (--verbose shows it here)"


@contextlib.contextmanager
def workers_off_terminal() -> Iterator[None]:
    """Within: workers' own "[vitscale]" lines go to the log only. A study runs many trainings at
    once; their interleaved step lines would be noise, so it prints one line per cell instead."""
    _WORKERS_QUIET.set()
    try:
        yield
    finally:
        _WORKERS_QUIET.clear()


@contextlib.contextmanager
def library_output_to(log_path: Path, *, verbose: bool) -> Iterator[None]:
    """Within: what libraries print on the driver (Tune's progress tables, hints) goes to `log_path`.

    vitscale's own lines still reach the terminal: the Ray output router keeps the terminal it
    was given, and this only swaps `sys.stdout`/`sys.stderr` that `print` looks up at call time.
    """
    if verbose:
        yield
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", buffering=1) as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        yield


def summary_table(sections: list[tuple[str, list[tuple[str, str]]]]) -> str:
    """A short table: one block per stage, one `what  value` row per line."""
    rows = [(stage, what, value) for stage, lines in sections for what, value in lines]
    if not rows:
        return ""
    w_stage = max(len(r[0]) for r in rows)
    w_what = max(len(r[1]) for r in rows)
    out, previous = [], None
    for stage, what, value in rows:
        out.append(f"  {(stage if stage != previous else ''):<{w_stage}}  {what:<{w_what}}  {value}")
        previous = stage
    return "\n".join(out)
