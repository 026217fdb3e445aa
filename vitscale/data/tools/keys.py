"""Sample keys from source names: safe inside tar member names, and never two alike."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["clean_key", "unique_keys"]

_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def clean_key(name: str, i: int) -> str:
    """One source name as a key of ``[A-Za-z0-9_-]`` (``sample{i}`` when nothing is left); not de-collided."""
    return _KEY_UNSAFE.sub("_", name).strip("_") or f"sample{i}"


def unique_keys(raw: Sequence[str]) -> list[str]:
    """Keys safe inside tar names (no dots, slashes): ``[A-Za-z0-9_-]``, de-collided by suffix.

    WebDataset splits a member name at the first dot of its base name, so keys carry no dots.
    Names that clean up to the same key (``a.jpg`` and ``a.png``, ``a b`` and ``a_b``) get a
    suffix ``_{i}`` (``i`` = the name's position), and further ``_2``, ``_3``... should that
    suffixed key itself be another name's key: the result never repeats a key.
    """
    cleaned = [clean_key(r, i) for i, r in enumerate(raw)]
    taken = set(cleaned)  # a suffixed key must not take a key a later name cleans up to
    out: list[str] = []
    seen: set[str] = set()
    for i, k in enumerate(cleaned):
        if k in seen:
            base, n = f"{k}_{i}", 1
            k = base
            while k in seen or k in taken:
                n += 1
                k = f"{base}_{n}"
            taken.add(k)
        seen.add(k)
        out.append(k)
    return out
