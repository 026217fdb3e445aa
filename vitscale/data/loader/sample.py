"""One sample's bytes -> its labels and pixels: the whole chain every sample goes through.

The chain is size, checksum, tar members, label, image. Each step raises
:class:`~vitscale.data.loader.tar.BadSample` on bad input and nothing else, so the stream can skip
and count a damaged sample without knowing which step found the damage; the fuzz tests
(``tests/test_sample_fuzz.py``) hold this function to that.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import numpy as np

from vitscale.data.loader.decode import decode_image_into
from vitscale.data.loader.reader import check_crc, check_labels, parse_label
from vitscale.data.loader.tar import BadSample, split_tar_record
from vitscale.data.loader.transforms import TransformSpec

__all__ = ["IMAGE_MEMBERS", "decode_sample", "image_member", "no_image"]

IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp")
"""Member extensions that hold a sample's image, first found wins (vitscale writes ``jpg``;
adopted WebDataset shards may hold any of these)."""


def image_member(extensions: Iterable[str]) -> str | None:
    """The extension among a sample's members (lower-cased) that holds its image; None: it has none.
    The one rule for the loader, `shards index`, `shards verify` and `shards dedup`."""
    have = set(extensions)
    return next((ext for ext in IMAGE_MEMBERS if ext in have), None)


def no_image(extensions: Iterable[str]) -> str:
    """Why a sample with these members has no image, in the words every tool uses."""
    return f"no image member ({', '.join(IMAGE_MEMBERS)}) among {sorted(extensions)[:10]}"


def decode_sample(
    raw: bytes,
    key: str,
    *,
    size: int,
    crc: int,
    num_classes: int,
    multi_label: bool,
    spec: TransformSpec,
    rng: random.Random | None,
    out: np.ndarray,
    labels: list[int] | None = None,
) -> list[int]:
    """Check and decode one sample record into ``out`` (3, R, R) uint8; returns its class ids.

    ``size`` and ``crc`` are the index's (``crc < 0``: the index has no checksum for it); ``rng``
    drives the training crop; ``labels`` are the index's, for datasets whose labels live there
    (otherwise they are parsed from the ``.cls``/``.json`` member); ``num_classes`` 0 (an unlabelled
    dataset) reads no label and returns ``[]``. Raises :class:`BadSample` for
    anything wrong with ``raw`` or the labels.
    """
    if len(raw) != size:
        raise BadSample(f"truncated read: got {len(raw)} of {size} bytes")
    check_crc(raw, crc)
    members = split_tar_record(raw, key)
    if num_classes == 0:  # an unlabelled dataset: images alone, any label member ignored
        labels = []
    elif labels is None:
        labels = parse_label(members, num_classes, multi_label)
    else:
        check_labels(labels, num_classes, multi_label)
    ext = image_member(members)
    if ext is None:
        raise BadSample(no_image(members))
    decode_image_into(members[ext], out, spec, rng)
    return labels
