"""A dev split carved from a training split (the paper's minival), as a pure function of the sample key.

App. B.1.1: hyper-parameters are selected on a dev split held out from the training set (10% for
Pets and Flowers, 2% for CIFAR, 1% for ImageNet); the winner is retrained on the whole training
split and tested once. A sample belongs to the dev part when a keyed hash of (seed, key) falls
below `fraction`. So the carve is:

- reproducible: the same (seed, fraction) always selects the same samples, on any machine, in any
  shard layout, with no file written;
- nested: a smaller fraction selects a subset of a larger one (same seed);
- disjoint and complete: every sample of the split is in exactly one of "dev" and "rest".
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise ValueError(f"carve fraction must be in (0, 1), got {self.fraction}")
        if self.part not in PARTS:
            raise ValueError(f"carve part must be one of {PARTS}, got {self.part!r}")

    def select(self, keys: Iterable[str]) -> np.ndarray:
        """(n,) bool: which of `keys` this part holds."""
        dev = in_dev(keys, self.fraction, self.seed)
        return dev if self.part == "dev" else ~dev


def key_hash(key: str, seed: int) -> float:
    """A uniform number in [0, 1) from (seed, key): blake2b, so stable across Python versions."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "little") / _SCALE


def in_dev(keys: Iterable[str], fraction: float, seed: int) -> np.ndarray:
    """(n,) bool: True where the sample with that key is in the dev carve of `fraction`."""
    return np.fromiter((key_hash(k, seed) < fraction for k in keys), dtype=bool)
