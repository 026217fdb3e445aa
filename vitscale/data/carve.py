"""A dev split carved from a training split (the paper's minival), as a pure function of the sample key.

App. B.1.1: hyper-parameters are selected on a dev split held out from the training set (10% for
Pets and Flowers, 2% for CIFAR, 1% for ImageNet; VTAB-1k: 200 of 1000); the winner is retrained
on the whole training split and tested once. Every sample gets a keyed hash of (seed, key) in
[0, 1); the dev part is the round(fraction x n) samples with the smallest hashes. So the carve is:

- exact: a 0.2 carve of 1000 samples has 200 dev samples, not "about 200";
- reproducible: the same (seed, fraction) always selects the same samples, on any machine, in any
  shard layout, with no file written;
- nested: a smaller fraction selects a subset of a larger one (same seed);
- disjoint and complete: every sample of the split is in exactly one of "dev" and "rest";
- by key: samples that share a key (a key written twice) share a part, so no copy of a dev sample trains;
  the dev count is then the nearest to round(fraction x n) that keeps them together.

Selecting needs the split's hashes once (`threshold`); then any shard's samples are placed by
comparing their own hashes with it, without the rest of the split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

PARTS = ("dev", "rest")
_SCALE = float(2**64)


@dataclass(frozen=True)
class Carve:
    """Which part of a split to read: the dev carve, or the rest of the split."""

    fraction: float
    """Share of the split in the dev part, in (0, 1)."""
    seed: int = 0
    """Seed of the carve (a different seed selects a different dev part)."""
    part: str = "rest"
    """"dev" (selection reads this) or "rest" (selection trains on this)."""
    threshold: float | None = None
    """Hashes below this are dev; set by `resolved` from the split's keys (None = not resolved yet)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"carve fraction must be in (0, 1), got {self.fraction}")
        if self.part not in PARTS:
            raise ValueError(f"carve part must be one of {PARTS}, got {self.part!r}")

    def resolved(self, split_keys: Iterable[str]) -> Carve:
        """This carve with its threshold computed from all keys of the split."""
        return replace(self, threshold=dev_threshold(split_keys, self.fraction, self.seed))

    def select(self, keys: Iterable[str]) -> np.ndarray:
        """(n,) bool: which of `keys` this part holds (the carve must be `resolved` on their split)."""
        if self.threshold is None:
            raise ValueError("resolve the carve on its split's keys first (Carve.resolved)")
        dev = hashes(keys, self.seed) < self.threshold
        return dev if self.part == "dev" else ~dev


def key_hash(key: str, seed: int) -> float:
    """A uniform number in [0, 1) from (seed, key): blake2b, so stable across Python versions."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / _SCALE


def hashes(keys: Iterable[str], seed: int) -> np.ndarray:
    """(n,) float64 keyed hashes of `keys`."""
    return np.fromiter((key_hash(k, seed) for k in keys), dtype=np.float64)


def dev_threshold(split_keys: Iterable[str], fraction: float, seed: int) -> float:
    """The hash below which exactly round(fraction x n) of the split's n samples fall; where one key names several
    samples across that boundary, the count nearest it that keeps them together (`_around_a_repeated_key`)."""
    h = np.sort(hashes(split_keys, seed))
    k = round(fraction * len(h))
    if k >= len(h):
        return 1.0
    if k == 0:
        return float(h[0])
    if h[k - 1] == h[k]:
        return _around_a_repeated_key(h, k)
    # Between the k-th and (k+1)-th smallest: exactly k below (64-bit hashes of distinct keys do not tie).
    return float((h[k - 1] + h[k]) / 2)


def _around_a_repeated_key(h: np.ndarray, k: int) -> float:
    """The threshold for sorted hashes `h` whose k-th and (k+1)-th smallest are one key's (a key written twice,
    as adopted WebDataset shards may hold): all its samples go to one part, so that a copy of a dev sample
    never trains, in whichever part leaves the dev count nearer k; an empty part only when there is no other."""
    tied = h[k]
    below = int(np.searchsorted(h, tied, "left"))  # the dev count with the key in "rest"
    above = int(np.searchsorted(h, tied, "right"))  # ... and in "dev"
    candidates = [c for c in (below, above) if 0 < c < len(h)] or [below]
    count = min(candidates, key=lambda c: (abs(c - k), c))
    if count == below:
        return float(tied)
    return float((tied + h[above]) / 2)


def in_dev(keys: Iterable[str], fraction: float, seed: int) -> np.ndarray:
    """(n,) bool: True where the sample is in the dev carve of `fraction` of these keys (all of a split)."""
    keys = list(keys)
    return hashes(keys, seed) < dev_threshold(keys, fraction, seed)


def subset(count: int, split_size: int, seed: int) -> Carve | None:
    """The first `count` samples of a split of `split_size` in the fixed keyed-hash permutation of
    `seed`, as the part of a carve a job reads (None: the whole split). The same machinery as the
    dev carve, so a subset is exact, reproducible and nested (a smaller one inside a larger one):
    the paper's 9M/30M/90M subsets of JFT-300M (Sec. 4.3) for any dataset."""
    if count >= split_size:
        return None
    return Carve(count / split_size, seed, "dev")  # dev_threshold rounds count / n x n back to count
