"""A small progress display for long writes: a redrawn bar on a terminal, periodic lines otherwise.

Both forms show count, rate and ETA, e.g.
``write train  [#######.............]  3500/10000  35%  812.4 img/s  ETA 0:00:08``.
"""

from __future__ import annotations

import math
import sys
import time
from types import TracebackType
from typing import Self, TextIO

__all__ = ["Progress", "format_duration", "format_progress"]


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` for a non-negative number of seconds; ``?`` when unknown (inf/nan)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def format_progress(
    desc: str, done: int, total: int | None, elapsed_s: float, unit: str = "it", width: int = 20
) -> str:
    """One progress line: bar (when ``total`` is known), count, percent, rate and ETA."""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    parts = [desc] if desc else []
    if total:
        frac = min(1.0, done / total)
        filled = int(frac * width)
        parts.append("[" + "#" * filled + "." * (width - filled) + "]")
        parts.append(f"{done}/{total}")
        parts.append(f"{100 * frac:3.0f}%")
    else:
        parts.append(str(done))
    parts.append(f"{rate:.1f} {unit}/s")
    if total:
        eta = (total - done) / rate if rate > 0 else float("inf")
        parts.append(f"ETA {format_duration(max(0.0, eta))}")
    else:
        parts.append(f"elapsed {format_duration(elapsed_s)}")
    return "  ".join(parts)


class Progress:
    """Counts work and shows it at most every ``interval_s`` seconds (redrawn in place on a TTY).

    Use as a context manager; ``update(n)`` adds finished items; ``close()`` prints the final line.
    With ``enabled=False`` it only counts.
    """

    def __init__(
        self,
        total: int | None,
        desc: str = "",
        *,
        unit: str = "it",
        enabled: bool = True,
        stream: TextIO | None = None,
        interval_s: float | None = None,
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        # Redraws are cheap on a terminal; in logs a line every 10 s keeps them readable.
        self.interval_s = interval_s if interval_s is not None else (0.2 if self._tty else 10.0)
        self.done = 0
        self._start = time.monotonic()
        self._last = self._start
        self._closed = False
        self._shown = False  # a line (or a bar) has been written
        self._drawn = 0  # length of the bar last drawn on the terminal: a shorter one must cover all of it

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
            return
        # Failed: the error's own line follows; a drawn bar is ended so that line starts clean.
        self._closed = True
        if self.enabled and self._tty and self._shown:
            self.stream.write("\n")
            self.stream.flush()

    @property
    def elapsed_s(self) -> float:
        """Seconds since the display started."""
        return time.monotonic() - self._start

    def line(self) -> str:
        """The current progress line."""
        return format_progress(self.desc, self.done, self.total, self.elapsed_s, self.unit)

    def update(self, n: int = 1) -> None:
        """Record ``n`` more finished items; redraw when the interval has passed."""
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self._last >= self.interval_s:
            self._last = now
            self._emit(final=False)

    def _emit(self, final: bool) -> None:
        self._shown = True
        if self._tty:
            # A redraw only overwrites: where this line is shorter (a rate that lost a digit), the last one's
            # tail would stay on screen after it ("ETA 0:00:01" reading "ETA 0:00:010"), so spaces cover it.
            text = self.line()
            self.stream.write("\r" + text.ljust(self._drawn) + ("\n" if final else ""))
            self._drawn = 0 if final else len(text)
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Print the final line once: on a terminal always; in a log only after periodic lines (work
        shorter than one interval leaves the log alone)."""
        if not self._closed:
            self._closed = True
            if self.enabled and (self._tty or self._shown):
                self._emit(final=True)
