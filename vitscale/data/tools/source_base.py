"""What every image source is: a random-access sequence of :class:`Sample`, and its registry entry.

A source module (one per source kind, registered in :mod:`vitscale.data.tools.sources`) imports
this module and nothing of the other sources, so adding one touches no other source: it defines
``SOURCE = SourceKind(...)`` and gets one line in the registry.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from PIL import Image

from vitscale.config.checks import check

__all__ = ["IMAGE_EXTENSIONS", "MAX_DRAWN_CLASSES", "MAX_DRAWN_IMAGES", "MAX_DRAWN_SIDE", "Sample", "Source",
           "SourceKind", "drawn_classes", "drawn_count", "drawn_side", "image_of"]

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm"})

MAX_DRAWN_SIDE = 4096
"""The largest side, in pixels, of an image a source draws itself (synthetic, fractal, digits): eight times the
paper's largest resolution (512 px). A side of 100,000 px was a 112-GiB array and a MemoryError's traceback."""


MAX_DRAWN_CLASSES = 100_000
"""The most classes a source draws itself (synthetic, fractal): five times JFT-300M's 18,291. Each has a name
in memory and in `dataset.json`; 10**9 of them ran out of memory before the first image."""


MAX_DRAWN_IMAGES = 100_000_000
"""The most images a source draws itself (synthetic, fractal): a third of JFT-300M, terabytes of JPEGs. The write
shuffles them into splits with a permutation in memory (8 bytes an image): 10**10 asked for 75 GiB, and 10**20
overflowed."""


def drawn_count(value: int, key: str) -> int:
    """`value`, the number of images a source draws, in [1, MAX_DRAWN_IMAGES]; returns it."""
    check(1 <= value <= MAX_DRAWN_IMAGES, key, f"must be in [1, {MAX_DRAWN_IMAGES:,}], got {value}")
    return value


def drawn_classes(value: int, key: str) -> int:
    """`value`, the number of classes a source draws, in [2, MAX_DRAWN_CLASSES]; returns it."""
    check(2 <= value <= MAX_DRAWN_CLASSES, key, f"must be in [2, {MAX_DRAWN_CLASSES}], got {value}")
    return value


def drawn_side(value: int, key: str, least: int) -> int:
    """`value`, the side of the images a source draws, in [least, MAX_DRAWN_SIDE]; returns it."""
    check(least <= value <= MAX_DRAWN_SIDE, key, f"must be in [{least}, {MAX_DRAWN_SIDE}] px, got {value}")
    return value


class Sample(NamedTuple):
    """One image: a dataset-unique ``key``, a PIL image or encoded bytes, class indices."""

    key: str
    image: Image.Image | bytes
    labels: tuple[int, ...]


class Source(Sequence[Sample]):
    """A random-access image source with class names and a multi-label flag.

    Random access lets the writer visit samples in a seeded shuffled order, so shards mix classes
    and splits are carved reproducibly.
    """

    name: str
    classes: tuple[str, ...]
    multi_label: bool

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, i: int) -> Sample:  # type: ignore[override]
        raise NotImplementedError

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self[i]

    def predefined_splits(self) -> dict[str, np.ndarray] | None:
        """The dataset's own splits (name -> source indices, disjoint), or None: carve by fractions.

        A source that returns splits is written as they are (``write_dataset`` refuses ``--split``
        fractions for it); see :mod:`vitscale.data.tools.downstream`.
        """
        return None

    def origin(self, i: int) -> str:
        """Where sample ``i`` comes from, for messages: its file, or the source and index."""
        return f"{self.name}[{i}]"

    def _check_index(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.name}: index {i} out of range for {n} samples")
        return i % n


@dataclass(frozen=True)
class SourceKind:
    """One registered source kind: how ``--source NAME[:ARG]`` opens it and what it accepts."""

    name: str
    """The one name of the kind (``--source``, ``data.create_if_missing.kind``)."""
    open: Callable[..., Source]
    """Opens the source: ``open(arg, **options)`` when the kind takes an argument, else ``open(**options)``."""
    summary: str
    """One line for help texts."""
    arg: str = ""
    """What follows ``NAME:`` (``"PATH"``, ``"FILE"``, ``"DIR"``); empty: the kind takes none."""
    options: tuple[str, ...] = ()
    """Keyword options ``open`` accepts (``open_source`` refuses others)."""
    predefined_splits: bool = False
    """The dataset brings its own splits (``--split`` fractions are refused)."""
    reads_tree: bool = False
    """``ARG`` is a folder read whole, every sub-folder a class: a dataset written at or inside it would join
    the source (``check_outside_source``). Kinds that read named files of a distribution leave it off."""

    @property
    def spec(self) -> str:
        """How a user writes it: ``digits`` or ``cifar10:DIR``."""
        return f"{self.name}:{self.arg}" if self.arg else self.name


def image_of(sample_image: Image.Image | bytes) -> Image.Image:
    """A PIL image from either form a source yields (bytes are opened lazily, not yet decoded)."""
    if isinstance(sample_image, Image.Image):
        return sample_image
    return Image.open(io.BytesIO(sample_image))

