"""Label members parsed with bounded size and depth: the one parser for training, indexing and verify.

A label member is bytes from a tar someone else wrote. Python's own parsers trust them too much:
``int()`` of a million digits is slow (and refused past 4,300 digits only by an interpreter
setting), ``json.loads`` of ``[[[[...`` thousands deep ends in ``RecursionError``, and a class id of
10^12 later becomes a class table of 10^12 names. Here every label is checked before it is
parsed:

- at most :data:`MAX_LABEL_BYTES` bytes and UTF-8 (``.cls`` ASCII);
- ``.cls``: an optional sign and at most :data:`MAX_ID_DIGITS` decimal digits;
- ``.json``: nested at most :data:`MAX_JSON_DEPTH` deep (counted on the raw text, strings
  skipped, before ``json.loads`` runs), at most :data:`MAX_LABELS` labels per sample;
- class ids in ``[0, num_classes)`` where the class count is known, else below
  :data:`MAX_CLASSES`.

Anything else raises :class:`LabelError` (a ``ValueError``), never another exception: callers
turn it into a bad sample (the training loader's ``BadSample``, ``shards index``'s ``bad_samples``).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_CLASSES", "MAX_ID_DIGITS", "MAX_JSON_DEPTH", "MAX_LABELS", "MAX_LABEL_BYTES", "LabelError",
           "check_class_ids", "json_depth", "parse_class_id", "parse_json_label", "parse_text_label"]

MAX_LABEL_BYTES = 64 << 10
"""A label member larger than this is not a label (JFT-style multi-label json stays far below)."""
MAX_ID_DIGITS = 18
"""Digits of a ``.cls`` id: anything longer cannot be a class id (and stays inside an int64)."""
MAX_JSON_DEPTH = 32
"""Nesting of ``[``/``{`` in a ``.json`` label; real labels nest two or three deep."""
MAX_LABELS = 100_000
"""Labels of one sample (JFT-300M averages 1.26; its whole class list is 18,291)."""
MAX_CLASSES = 1 << 20
"""Ids at or above this are absurd when no class count is given (ImageNet-21k has 21,843 classes)."""


class LabelError(ValueError):
    """A label member that cannot be a label: too large, too deep, not a number or name, out of range."""


def _text(data: bytes, what: str) -> str:
    if len(data) > MAX_LABEL_BYTES:
        raise LabelError(f"malformed {what} label: {len(data)} bytes (at most {MAX_LABEL_BYTES})")
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise LabelError(f"malformed {what} label: not UTF-8: {data[:32]!r}") from None


def parse_class_id(data: bytes) -> int:
    """The integer class id in a ``.cls`` member (sign checked later, against the class count)."""
    text = _text(data, ".cls")
    digits = text[1:] if text[:1] in "+-" else text
    if not digits or not digits.isascii() or not digits.isdigit() or len(digits) > MAX_ID_DIGITS:
        raise LabelError(f"malformed .cls label {text[:32]!r} (a class id has 1 to {MAX_ID_DIGITS} digits)")
    return int(text)


def parse_text_label(data: bytes) -> str:
    """The class name in a ``.txt`` member (one line, not empty)."""
    text = _text(data, ".txt")
    if not text or "\n" in text:
        raise LabelError(f"malformed .txt label {text[:32]!r} (one class name per sample)")
    return text


def json_depth(text: str) -> int:
    """Deepest nesting of ``[``/``{`` in ``text``, ignoring brackets inside JSON strings (pure, linear)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json_label(data: bytes, key: str) -> list[int | str]:
    """The labels under ``key`` of a ``.json`` member: one id or name, or a list of them."""
    text = _text(data, ".json")
    if json_depth(text) > MAX_JSON_DEPTH:
        raise LabelError(f"malformed .json label: nested deeper than {MAX_JSON_DEPTH}")
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError cannot happen below the depth bound
        raise LabelError(f"malformed .json label {text[:48]!r}: {exc}") from None
    if not isinstance(obj, dict) or key not in obj:
        raise LabelError(f"malformed .json label: no key {key!r} in {text[:48]!r}")
    value: Any = obj[key]
    values = value if isinstance(value, list) else [value]
    if len(values) > MAX_LABELS:
        raise LabelError(f"malformed .json label: {len(values)} labels (at most {MAX_LABELS})")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise LabelError(f"malformed .json label: {str(v)[:32]!r} is neither a class id nor a name")
        if isinstance(v, int) and abs(v) >= 10**MAX_ID_DIGITS:
            raise LabelError(f"malformed .json label: {str(v)[:32]}... is not a class id")
    return list(values)


def check_class_ids(ids: list[int], num_classes: int | None) -> None:
    """Every id in ``[0, num_classes)`` (or below :data:`MAX_CLASSES` when the count is not known)."""
    bound = MAX_CLASSES if num_classes is None else num_classes
    for v in ids:
        if not 0 <= v < bound:
            raise LabelError(f"class id {v} outside [0, {bound})" +
                             ("" if num_classes is not None else " (no class count given: pass the class names)"))
