"""Which patches masked patch prediction corrupts (Sec. 4.6, App. B.1.2): a pure function of (seed, epoch, key).

The paper corrupts 50% of an image's patch embeddings: of those, 80% are replaced by a learnable
``[mask]`` embedding, 10% by the embedding of another random patch, and 10% are left as they are; the
model predicts every corrupted patch. Here the counts are exact per image (``Corruption.counts``: 32 of
the 64 patches of an 8x8 grid, 26 masked, 3 swapped, 3 kept; 98 of ViT-B/16's 196 at 224 px, 78, 10,
10), and the positions come from a hash of the run's seed, the epoch and the sample's key:

- every position ``p`` of the grid gets a 64-bit score ``splitmix64(h + p * GOLDEN)``, where ``h`` is the
  BLAKE2b digest of (seed, epoch, key); the ``corrupted`` lowest scores are the corrupted positions, in
  score order, the first ``masked`` of them masked, the next ``swapped`` swapped, the rest kept;
- a swapped position ``p`` takes the embedding of position ``(p + 1 + s mod (N - 1)) mod N`` (never its
  own), ``s`` a second score of ``p``: "another random patch" of the same image, so the choice depends
  on nothing but the sample (a patch of another image would depend on how the step's batch is cut into
  micro-batches, which changes when an elastic run resizes).

BLAKE2b and the integer hash are fixed arithmetic, unlike numpy's generators (whose streams may change
between versions): a resumed, resized or re-installed run corrupts exactly the same patches. The loader
computes the plan beside each image (`data/loader/stream.py`), in its worker processes; the model applies
it (`models/masked_patch.py`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Corruption", "CorruptionError", "corrupted_positions"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _round(x: float) -> int:
    """Half up (Python's `round` rounds half to even: 0.5 * 5 = 2.5 would give 2)."""
    return int(x + 0.5)


class CorruptionError(ValueError):
    """A corruption that cannot be made; `setting` names the one at fault (rate, mask or swap)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


@dataclass(frozen=True)
class Corruption:
    """How many of an image's ``patches`` are corrupted, and how (the paper: 50%; 80/10/10)."""

    patches: int
    """Patches of the image's grid (N): 196 for ViT-B/16 at 224 px."""
    rate: float = 0.5
    """Share of the patches corrupted (and predicted)."""
    mask: float = 0.8
    """Share of the corrupted patches replaced by the [mask] embedding."""
    swap: float = 0.1
    """Share of the corrupted patches replaced by the embedding of another patch of the image."""

    def __post_init__(self) -> None:
        if self.patches < 1:
            raise CorruptionError("rate", f"an image has at least one patch, got {self.patches}")
        for name in ("rate", "mask", "swap"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise CorruptionError(name, f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.mask + self.swap > 1.0 + 1e-9:
            raise CorruptionError("swap", f"mask + swap must be at most 1, got {self.mask} + {self.swap}")
        corrupted, _, swapped = self.counts
        if corrupted < 1:
            raise CorruptionError("rate", f"a rate of {self.rate} corrupts no patch of {self.patches}")
        if swapped and self.patches < 2:
            raise CorruptionError("swap", "swapping a patch needs an image of at least two patches")

    @property
    def counts(self) -> tuple[int, int, int]:
        """(corrupted, masked, swapped) per image; the ``corrupted - masked - swapped`` others are kept."""
        corrupted = min(self.patches, _round(self.rate * self.patches))
        masked = min(corrupted, _round(self.mask * corrupted))
        swapped = min(corrupted - masked, _round(self.swap * corrupted))
        return corrupted, masked, swapped


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (wrapping arithmetic): a bijection that mixes every bit."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _sample_hash(seed: int, epoch: int, key: str) -> int:
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got {seed}, {epoch}")
    digest = hashlib.blake2b(f"{seed}\x00{epoch}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def corrupted_positions(seed: int, epoch: int, keys: Sequence[str],
                        corruption: Corruption) -> tuple[np.ndarray, np.ndarray]:
    """(positions, sources) of a batch of samples named by ``keys`` (see the module docstring).

    ``positions`` is int64 (B, corrupted): each row's corrupted patch indices (row-major over the grid),
    masked ones first, then swapped ones, then kept ones. ``sources`` is int64 (B, swapped): the patch
    whose embedding each swapped position takes, never the position itself.
    """
    n = corruption.patches
    corrupted, masked, swapped = corruption.counts
    hashes = np.array([_sample_hash(seed, epoch, k) for k in keys], dtype=np.uint64).reshape(-1, 1)  # (B, 1)
    grid = np.arange(n, dtype=np.uint64) * _GOLDEN  # (N,)
    with np.errstate(over="ignore"):
        scores = _splitmix64(hashes + grid)  # (B, N)
        second = _splitmix64(scores ^ _MIX2)  # (B, N): another independent score per position
    # Stable: ties (a 2^-64 event) keep grid order, so the result never depends on the sort's algorithm.
    order = np.argsort(scores, axis=1, kind="stable")[:, :corrupted].astype(np.int64)  # (B, corrupted)
    swap_at = order[:, masked:masked + swapped]  # (B, swapped)
    if n < 2:
        return order, swap_at.copy()
    offset = np.take_along_axis(second, swap_at, axis=1) % np.uint64(n - 1)  # (B, swapped) in [0, N-2]
    sources = (swap_at + 1 + offset.astype(np.int64)) % n
    return order, sources
