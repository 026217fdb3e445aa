"""Reading the paper's transfer datasets from the files they are distributed in: shared helpers.

Each of those sources (``cifar10``, ``cifar100``, ``pets``, ``flowers``, ``imagenet``: one module
each, registered in :mod:`vitscale.data.tools.sources`) has **predefined splits**
(:meth:`Source.predefined_splits`): the dataset's own train/test lists, written as they are
(``--split`` fractions are refused). Nothing is downloaded and nothing is unpickled; every check
runs when the source is opened, before a shard is written, and a bad file is a one-line
``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vitscale.config.errors import UserError
from vitscale.data.tools.source_base import Source

__all__ = ["PredefinedSplitSource", "load_mat", "need_dir", "need_file", "read_mat_ints", "read_names",
           "split_indices"]


class PredefinedSplitSource(Source):
    """A source whose samples belong to the dataset's own splits (``self._splits``: name -> indices)."""

    _splits: dict[str, np.ndarray]

    def predefined_splits(self) -> dict[str, np.ndarray]:
        return {name: idx.copy() for name, idx in self._splits.items()}


def need_dir(path: Path, kind: str) -> Path:
    if not path.is_dir():
        raise UserError(f"{kind}: {path} is not a directory")
    return path


def need_file(path: Path, kind: str, what: str = "") -> Path:
    if not path.is_file():
        raise UserError(f"{kind}: {path} does not exist" + (f" ({what})" if what else ""))
    return path


def read_names(path: Path, kind: str, count: int) -> tuple[str, ...]:
    """Class names, one a line (blank lines dropped); exactly ``count`` of them."""
    need_file(path, kind, "class names, one a line")
    names = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if len(names) != count:
        raise UserError(f"{kind}: {path} names {len(names)} classes, expected {count}")
    return names


def load_mat(path: Path, variable: str, kind: str, **kwargs: Any) -> np.ndarray:
    """One variable of a MATLAB ``.mat`` file (``scipy.io.loadmat``: v4 to v7.2 files)."""
    from scipy.io import loadmat

    need_file(path, kind)
    try:
        mat = loadmat(path, variable_names=[variable], **kwargs)
    except Exception as exc:  # noqa: BLE001 - scipy raises MatReadError, ValueError, IndexError, ...
        raise UserError(f"{kind}: cannot read {path} as a .mat file ({type(exc).__name__}: {exc})") from None
    if variable not in mat:
        raise UserError(f"{kind}: {path} has no variable {variable!r}")
    return np.asarray(mat[variable])


def read_mat_ints(path: Path, variable: str, kind: str) -> np.ndarray:
    """A ``.mat`` variable of integers as a flat int64 array."""
    values = load_mat(path, variable, kind).ravel()
    if values.size == 0 or not np.issubdtype(values.dtype, np.number) or np.any(values != np.round(values)):
        raise UserError(f"{kind}: {path} variable {variable!r} must hold integers")
    return values.astype(np.int64)


def split_indices(sizes: Sequence[tuple[str, int]]) -> dict[str, np.ndarray]:
    """Consecutive index ranges, one per (split, count), in order; a split may span several files."""
    out: dict[str, list[np.ndarray]] = {}
    start = 0
    for split, n in sizes:
        out.setdefault(split, []).append(np.arange(start, start + n, dtype=np.int64))
        start += n
    return {s: np.concatenate(parts) for s, parts in out.items()}
