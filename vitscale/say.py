"""vitscale's own lines on the terminal: the one prefix, written in one place.

Every line vitscale prints for its user starts with `PREFIX`, so the console (`launch/console.py`) can
tell them from the libraries' chatter in a worker's output and route them to the terminal.
"""

from __future__ import annotations

from typing import TextIO

PREFIX = "[vitscale]"


def line(text: str) -> str:
    """`text` as one of vitscale's lines."""
    return f"{PREFIX} {text}"


def say(text: str, *, file: TextIO | None = None) -> None:
    """Print `text` as one of vitscale's lines, at once (workers' output is read as it comes)."""
    print(line(text), file=file, flush=True)
