"""What the user's terminal shows during `vitscale run`: vitscale's own lines, not the libraries' chatter.

Ray forwards every worker's and actor's stdout/stderr to the driver (Ray Train's per-report
dumps, DeepSpeed's config tables, accelerator warnings) and prints each line to the driver's
`sys.stdout` or `sys.stderr` behind a `(ActorName pid=..., ip=...)` prefix, as Ray's logging guide
describes. Unless `--verbose`, the driver's `sys.stdout` and `sys.stderr` are a `TerminalFilter`:
forwarded lines go to `RUN_DIR/logs/ray.log` in full, and only those vitscale printed itself (they
hold "[vitscale]") also reach the terminal. The driver's own lines pass through. The driver's Ray
loggers are treated the same way: warnings and errors still show, INFO goes to the log file.

Only public behaviour is relied on (Python's standard streams, the documented line prefix, the
`RAY_COLOR_PREFIX` variable); no Ray module is patched. A Ray that changed its prefix would show its
forwarded lines on the terminal, as Ray itself does, never hide vitscale's.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from vitscale.data.storage.atomic import AppendOnly
from vitscale.data.storage.space import no_space_line
from vitscale.say import PREFIX

_WORKERS_QUIET = threading.Event()
"""Set while workers' own lines go to the log only (`workers_off_terminal`)."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FORWARDED = re.compile(r"^\((?:[^()]*\bpid=[^()]*|raylet[^()]*|autoscaler[^()]*)\) ?")
"""The prefix Ray puts before a line it forwards from a worker, actor, raylet or autoscaler."""


class RunLog(io.TextIOBase):
    """A log file of the run as this process writes it: whole lines only, and never an error.

    Lines go through :class:`AppendOnly` (data/storage/atomic.py): one that does not fit is cut back,
    never left torn. A log must not end a run, nor throw a traceback into the thread that printed (Ray's
    output forwarder, a logging call): on a full disk the lines are left out, one ``[vitscale]`` line on
    the terminal says so, and once space is back the log says how many it lost. The run itself ends in
    its own one line when a write it needs (metrics, a checkpoint) meets the same disk.
    """

    def __init__(self, path: Path, warn: TextIO | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self._file = AppendOnly(self.path)
        self._warn = warn
        self._partial = ""
        self._lost = 0
        self._warned = False
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            if self.closed:  # a logger or thread that outlives the run: its lines have nowhere to go
                return len(text)
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            for line in lines:
                self._append(line)
        return len(text)

    def flush(self) -> None:
        """Nothing to do: every whole line is written as it comes (`AppendOnly` has no buffer)."""

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            if self._partial:
                self._append(self._partial)
                self._partial = ""
            self._file.close()
            if _LOGS.get(str(self.path)) is self:
                del _LOGS[str(self.path)]
            super().close()

    def _append(self, line: str) -> None:
        # The note of lost lines and the next line go in one append: both fit, or neither (no note of 0 lines).
        note = f"{PREFIX} {self._lost} line(s) of this log were lost here: its disk was full\n" if self._lost else ""
        try:
            self._file.append(note + line)
            self._lost = 0
        except OSError as exc:
            if not self._warned:  # once: the log itself counts every later gap
                self._warned = True
                self._say(f"{PREFIX} {self.path}: lines left out until space is freed: "
                          + no_space_line(self.path, exc.strerror or str(exc)))
            self._lost += 1

    def _say(self, line: str) -> None:
        warn = self._warn or sys.__stderr__
        if warn is not None:
            with contextlib.suppress(OSError, ValueError):
                warn.write(line + "\n")
                warn.flush()


_LOGS: dict[str, RunLog] = {}
"""This process's open run logs by path: Ray's output and the driver's loggers share one writer per file."""


def run_log(path: Path, warn: TextIO | None = None) -> RunLog:
    """The open :class:`RunLog` of ``path`` (opened once per process, its folder made)."""
    log = _LOGS.get(str(path))
    if log is None or log.closed:
        log = _LOGS[str(path)] = RunLog(path, warn)
    return log


class _RunLogHandler(logging.FileHandler):
    """A `logging` handler writing into a :class:`RunLog` (a FileHandler by type, so code that looks for the
    file handlers of a path finds it; it never opens a stream of its own: a full disk raises nothing)."""

    def __init__(self, log: RunLog) -> None:
        super().__init__(log.path, delay=True)
        self.run_log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.run_log.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 -- a record that does not format: logging's own report of it
            self.handleError(record)

    def close(self) -> None:
        logging.Handler.close(self)  # the RunLog belongs to the run, not to this handler


class TerminalFilter(io.TextIOBase):
    """Stands in for the driver's `sys.stdout` or `sys.stderr` during a run (see module doc).

    Every forwarded line is written to `log`; of those, only vitscale's own lines also reach the
    terminal, from "[vitscale]" on (Ray's prefix dropped). The driver's own lines go to the terminal,
    or, within `library_lines_to`, to a library's log unless they are vitscale's.
    """

    def __init__(self, terminal: TextIO, log: TextIO | io.TextIOBase):
        super().__init__()
        self.terminal = terminal
        self.log = log
        self.library_log: TextIO | io.TextIOBase | None = None
        self.run_ended = False
        """Set by `run_ended`: forwarded lines go to the log only."""
        self._partial = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.terminal, "encoding", None) or "utf-8"

    def isatty(self) -> bool:
        return self.terminal.isatty()

    def fileno(self) -> int:
        return self.terminal.fileno()

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            for line in lines:
                self._route(line)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self.log.flush()
            self.terminal.flush()

    def log_only(self, text: str) -> None:
        """`text`, whole lines, into the log and not the terminal, between the lines being routed."""
        with self._lock:
            self.log.write(text.rstrip("\n") + "\n")

    def end_run(self) -> None:
        """Forwarded lines go to the log only from now on (`run_ended`); a line being routed now is routed
        whole first, so it lands before the driver's next line."""
        with self._lock:
            self.run_ended = True

    def _route(self, line: str) -> None:
        plain = _ANSI.sub("", line)
        forwarded = _FORWARDED.match(plain)
        if forwarded:
            self.log.write(plain + "\n")
            at = plain.find(PREFIX)
            if at >= 0 and not (_WORKERS_QUIET.is_set() or self.run_ended):
                self.terminal.write(plain[at:] + "\n")
        elif self.library_log is not None and not plain.lstrip().startswith(PREFIX):
            self.library_log.write(line + "\n")
        else:
            self.terminal.write(line + "\n")


class _Labelled(io.TextIOBase):
    """A stream that puts `label` after the "[vitscale]" of each vitscale line written to `inner`."""

    def __init__(self, inner: TextIO, label: str):
        super().__init__()
        self.inner = inner
        self.label = label
        self._at_line_start = True

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.inner.fileno()

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start and piece.startswith(PREFIX + " "):
                piece = f"{PREFIX} [{self.label}] {piece[len(PREFIX) + 1:]}"
            out.append(piece)
            self._at_line_start = piece.endswith("\n")
        self.inner.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.inner.flush()


@contextlib.contextmanager
def labelled_lines(label: str | None) -> Iterator[None]:
    """Within: this process's "[vitscale] ..." lines read "[vitscale] [label] ...". A sweep's trials run
    at once; their workers' step lines name the trial and its hyper-parameters this way."""
    if not label:
        yield
        return
    previous = sys.stdout
    sys.stdout = _Labelled(previous, label)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = previous


def trial_label(trial_id: str, params: dict[str, object]) -> str:
    """`trial 3f2a1_00002 base_lr=0.003`: a trial and its hyper-parameters (last part of each dotted key)."""
    values = " ".join(f"{k.rsplit('.', 1)[-1]}={v:g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
                      for k, v in params.items())
    return f"trial {trial_id} {values}".strip()


def quiet_driver_logs(log_path: Path, *, verbose: bool) -> None:
    """Before `ray.init`: Ray's and DeepSpeed's driver-side INFO lines go to `log_path`; warnings stay visible."""
    if verbose:
        return
    file_handler = _RunLogHandler(run_log(log_path))
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("ray", "DeepSpeed", "deepspeed"):
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                handler.setLevel(max(handler.level, logging.WARNING))
                handler.addFilter(_for_the_terminal)
        logger.addHandler(file_handler)
    # Documented in Ray's logging guide: forwarded lines without colour codes around their prefix.
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")


NOTICES = ("authentication_token_setup",)
"""Modules whose warnings are notices, not problems: Ray's "token authentication is enabled" (what
vitscale wants; docs say how to pass the token). They go to the log file only."""


UNFETCHED = "Unhandled error"
"""How Ray's driver begins its report of an error held in a result nobody fetched: a trial's or a worker's
exception as an interrupted or failed run shuts down (a Ctrl-C'd sweep's trial thread ended with "release
unlocked lock" after vitscale's last line). vitscale reports the run's outcome in its own line; these go to
the run's log only."""


def _for_the_terminal(record: logging.LogRecord) -> bool:
    """Whether a Ray or DeepSpeed driver-side record is shown on the terminal (the log file has them all)."""
    return record.module not in NOTICES and not (record.name.startswith("ray")
                                                 and record.getMessage().startswith(UNFETCHED))


def route_ray_output(log_path: Path, *, verbose: bool) -> str | None:
    """Send worker output to `log_path`, keep vitscale's lines on the terminal (module doc).

    Returns a line saying where the full log is, or None when nothing was rerouted (verbose). A
    later run in the same process points the filters at its own log.
    """
    if verbose:
        return None
    for name in ("stdout", "stderr"):
        current = getattr(sys, name)
        log = run_log(log_path, current.terminal if isinstance(current, TerminalFilter) else current)
        if isinstance(current, TerminalFilter):
            current.run_ended = False
            previous, current.log = current.log, log
            if previous is not log and not isinstance(previous, RunLog):
                previous.close()
        else:
            setattr(sys, name, TerminalFilter(current, log))
    return f"workers' full output: {log_path} (--verbose shows it here)"


def restore_output() -> None:
    """Undo `route_ray_output`: the standard streams are the ones it found again."""
    for name in ("stdout", "stderr"):
        current = getattr(sys, name)
        if isinstance(current, TerminalFilter):
            if current._partial:
                current.write("\n")
            current.flush()
            setattr(sys, name, current.terminal)
            with contextlib.suppress(ValueError):
                current.log.close()


def run_ended() -> None:
    """From now on, workers' lines go to the log only: the run has ended (done, failed or interrupted).

    Ray forwards a worker's output from a thread of its own, and workers still running when the driver
    stops (a sweep's trial at Ctrl-C, a Train run's teardown) print on: one such line used to land after
    the CLI's last line, the one that says how to resume, or after the summary's JSON line that scripts
    read. The next `route_ray_output` shows them again."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, TerminalFilter):
            stream.end_run()


def to_log(text: str) -> bool:
    """Write `text` into the run's log (where `route_ray_output` sends the workers' output), not the terminal.
    False where output is not routed (`--verbose`, or a caller of `run_pipeline` that did not route it)."""
    stream = sys.stderr
    if not isinstance(stream, TerminalFilter):
        return False
    stream.log_only(text)
    return True


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

    vitscale's own lines, the driver's and the workers', still reach the terminal.
    """
    if verbose:
        yield
        return
    filters = [s for s in (sys.stdout, sys.stderr) if isinstance(s, TerminalFilter)]
    with contextlib.closing(RunLog(log_path, filters[0].terminal if filters else sys.__stderr__)) as log:
        if not filters:  # output not routed (a caller of run_pipeline without route_ray_output)
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                yield
            return
        for f in filters:
            f.library_log = log
        try:
            yield
        finally:
            for f in filters:
                f.library_log = None


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
