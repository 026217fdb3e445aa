""""Did you mean" for a name a user mistyped: a config key, a CLI verb or flag, a choice."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: str, choices: Iterable[str]) -> str | None:
    """The choice nearest to `name` by spelling, or None when nothing is close (difflib's ratio >= 0.6)."""
    found = difflib.get_close_matches(name, sorted(set(choices)), n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`" (did you mean 'x'?)"` for the nearest choice, or "" when none is near: ready to append to a message."""
    found = closest(name, choices)
    return f" (did you mean {found!r}?)" if found else ""
