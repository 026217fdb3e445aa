"""Near-duplicate images by perceptual hash: the 64-bit pHash and the exact search for hashes within
``threshold`` bits (what ``vitscale shards dedup``, :mod:`vitscale.data.tools.dedup`, removes by).

Each image gets a 64-bit DCT perceptual hash (pHash, our own numpy implementation rather than
the ``imagehash`` package: grey, 32x32, 2-D DCT-II, the 8x8 lowest frequencies thresholded at their
median). Two images are near-duplicates when their hashes differ in at most ``threshold`` bits.

Search is a multi-index hash, not an all-pairs scan: the 64 bits are cut into ``m`` bands; if two
hashes are within ``T`` bits, some band differs in at most ``T // m`` bits (pigeonhole). Each band
of the training hashes is sorted once; every query band is probed with all bit flips of weight
``<= T // m`` by binary search, and only the candidates this yields are compared in full. ``m`` (the
:class:`BandLayout`) is chosen by a cost model (probes x expected bucket size). The result is
exact, same as brute force.
"""

from __future__ import annotations

import io
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image

from vitscale.config.checks import check
from vitscale.data.tools.images import pil_quiet

__all__ = ["DEFAULT_THRESHOLD", "BandLayout", "band_layout", "hamming", "near_duplicate_pairs", "phash",
           "phash_pixels"]

DEFAULT_THRESHOLD = 10
"""Bits (of 64): catches resized, re-encoded and slightly cropped copies; distinct images sit
around 32 bits apart, and a pair below 16 is rare (see tests/test_dedup.py)."""

_HASH_SIDE = 32  # DCT input side
_LOW = 8  # low-frequency block side: 8x8 = 64 bits


@lru_cache(maxsize=4)
def _dct_matrix(n: int) -> np.ndarray:
    """Orthonormal DCT-II matrix (n, n): ``C @ x`` is the DCT of column vector ``x``."""
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    c = np.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    c[0] /= math.sqrt(2.0)
    return c


def phash_pixels(grey: np.ndarray) -> int:
    """pHash of a (32, 32) grey image array: 64 bits, row-major over the 8x8 low frequencies."""
    if grey.shape != (_HASH_SIDE, _HASH_SIDE):
        raise ValueError(f"phash_pixels needs a ({_HASH_SIDE}, {_HASH_SIDE}) array, got {grey.shape}")
    c = _dct_matrix(_HASH_SIDE)
    coeffs = c @ grey.astype(np.float64) @ c.T  # (32, 32) 2-D DCT-II
    low = coeffs[:_LOW, :_LOW]  # (8, 8), DC included (as imagehash's phash does)
    bits = (low > np.median(low)).ravel()  # (64,)
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def phash(image: Image.Image | bytes) -> int:
    """64-bit pHash of a PIL image or encoded image bytes."""
    with pil_quiet():  # an adopted tar's photo with damaged EXIF: its hash, not PIL's warning mid-bar
        img = image if isinstance(image, Image.Image) else Image.open(io.BytesIO(image))
    if img.format == "JPEG":
        img.draft("L", (2 * _HASH_SIDE, 2 * _HASH_SIDE))  # let libjpeg decode at reduced scale
    grey = img.convert("L").resize((_HASH_SIDE, _HASH_SIDE), Image.Resampling.LANCZOS)
    return phash_pixels(np.asarray(grey, dtype=np.float64))


def hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bitwise Hamming distance of uint64 arrays (broadcasting)."""
    return np.bitwise_count(np.asarray(a, np.uint64) ^ np.asarray(b, np.uint64)).astype(np.int64)


@dataclass(frozen=True)
class BandLayout:
    """How the 64 bits are cut for the multi-index search."""

    widths: tuple[int, ...]
    """Bits per band, summing to 64, most significant band first."""
    radius: int
    """Bit flips probed per band: ``threshold // len(widths)``."""

    @property
    def shifts(self) -> tuple[int, ...]:
        """Right shift that brings each band to the low bits."""
        ends = np.cumsum(self.widths)
        return tuple(int(64 - e) for e in ends)


def _band_widths(m: int) -> tuple[int, ...]:
    return tuple(64 // m + (1 if j < 64 % m else 0) for j in range(m))


_TABLE_MAX_BITS = 24  # bands up to this wide get a dense bucket table (2^w int64 entries)


def band_layout(n_index: int, threshold: int, n_queries: int | None = None) -> BandLayout:
    """Pick the band count with the least estimated work for the multi-index search.

    Pure function. Work = queries x probes x (lookup + expected bucket size) + table building.
    ``threshold + 1`` bands make every probe exact (radius 0) but narrow bands mean big buckets
    on large sets; fewer, wider bands need Hamming-ball probes and give tiny buckets.
    """
    check(0 <= threshold < 64, "threshold", f"must be in [0, 63] bits, got {threshold}")
    n_q = n_index if n_queries is None else n_queries
    best: tuple[float, BandLayout] | None = None
    for m in range(1, min(threshold + 1, 64) + 1):
        widths = _band_widths(m)
        r = threshold // m
        probes = sum(sum(math.comb(w, k) for k in range(r + 1)) for w in widths)
        table = max(widths) <= _TABLE_MAX_BITS
        lookup = 1.0 if table else math.log2(n_index + 2)
        build = sum(2.0**w for w in widths) if table else m * n_index * math.log2(n_index + 2)
        cost = n_q * probes * (lookup + n_index / 2.0 ** min(widths)) + build
        if best is None or cost < best[0]:
            best = (cost, BandLayout(widths, r))
    if best is None:  # unreachable: the loop runs at least once (m = 1)
        raise RuntimeError("band_layout found no layout")
    return best[1]


def _flip_masks(width: int, radius: int) -> np.ndarray:
    """All ``width``-bit masks with at most ``radius`` bits set, (P,) uint64."""
    masks = [0]
    for k in range(1, radius + 1):
        masks += [sum(1 << b for b in bits) for bits in itertools.combinations(range(width), k)]
    return np.array(masks, dtype=np.uint64)


def near_duplicate_pairs(
    queries: np.ndarray, index: np.ndarray, threshold: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All (query i, index j) with ``hamming(queries[i], index[j]) <= threshold``.

    Returns ``(qi, ij, dist)`` int64 arrays sorted by (qi, ij); exactly the brute-force answer.
    """
    q = np.asarray(queries, dtype=np.uint64)
    x = np.asarray(index, dtype=np.uint64)
    empty = (np.zeros(0, np.int64),) * 3
    if len(q) == 0 or len(x) == 0:
        return empty
    layout = band_layout(len(x), threshold, len(q))
    found: list[np.ndarray] = []
    for width, shift in zip(layout.widths, layout.shifts):
        band_mask = np.uint64((1 << width) - 1)
        xb = (x >> np.uint64(shift)) & band_mask  # (N,) band values
        order = np.argsort(xb, kind="stable")
        qb = (q >> np.uint64(shift)) & band_mask  # (Q,)
        if width <= _TABLE_MAX_BITS:
            # Dense table: bucket v holds order[bucket_at[v]:bucket_at[v + 1]]; O(1) per probe.
            bucket_at = np.zeros((1 << width) + 1, dtype=np.int64)
            np.cumsum(np.bincount(xb.astype(np.int64), minlength=1 << width), out=bucket_at[1:])
        else:
            xs = xb[order]  # sorted band values, probed by binary search
        for flip in _flip_masks(width, layout.radius):
            probe = qb ^ flip
            if width <= _TABLE_MAX_BITS:
                p64 = probe.astype(np.int64)
                lo, hi = bucket_at[p64], bucket_at[p64 + 1]
            else:
                lo, hi = np.searchsorted(xs, probe, "left"), np.searchsorted(xs, probe, "right")
            counts = hi - lo  # (Q,) bucket sizes
            total = int(counts.sum())
            if total == 0:
                continue
            qi = np.repeat(np.arange(len(q)), counts)
            # Positions lo[i] .. hi[i]-1 for every query, concatenated.
            first = np.repeat(lo - np.cumsum(counts) + counts, counts)
            ij = order[first + np.arange(total)]
            keep = hamming(q[qi], x[ij]) <= threshold
            found.append(qi[keep] * len(x) + ij[keep])
    if not found:
        return empty
    flat = np.unique(np.concatenate(found))  # a pair can surface in several bands
    qi, ij = flat // len(x), flat % len(x)
    return qi.astype(np.int64), ij.astype(np.int64), hamming(q[qi], x[ij])
