"""Tiny datasets in the shard contract, written with plain ``webdataset.TarWriter`` (not our writer).

Used by the reader tests so they do not depend on our writer (``vitscale.data.tools.write``); that
the reader also accepts tars from a third-party writer is a useful check in itself.
``_index.parquet`` offsets are found by scanning the finished tar with ``tarfile`` (header offset
of a sample's first member to the padded end of its last).
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import webdataset as wds
from PIL import Image

# A sample hook may replace the sample dict (e.g. to corrupt its JPEG) before it is written.
SampleHook = Callable[[str, dict[str, bytes]], dict[str, bytes]]


def jpeg_bytes(rng: np.random.Generator, width: int, height: int, quality: int = 90) -> bytes:
    """A smooth random-colour JPEG (gradients compress like photos, unlike white noise)."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    c = rng.uniform(0, 1, size=(3, 3))
    img = np.stack(
        [(c[i, 0] * xx / width + c[i, 1] * yy / height + c[i, 2]) * 127 for i in range(3)], axis=-1
    )
    img += rng.normal(0, 8, size=img.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _scan_index(path: Path) -> dict[str, tuple[int, int]]:
    """key -> (offset, size) of each sample in a finished tar."""
    spans: dict[str, list[int]] = {}
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            key = m.name.split(".", 1)[0]
            end = m.offset_data + -(-m.size // 512) * 512
            lo, hi = spans.get(key, [m.offset, end])
            spans[key] = [min(lo, m.offset), max(hi, end)]
    return {k: (lo, hi - lo) for k, (lo, hi) in spans.items()}


def write_test_dataset(
    root: Path,
    splits: dict[str, Sequence[int]],
    *,
    num_classes: int = 10,
    multi_label: bool = False,
    size: tuple[int, int] = (64, 48),
    seed: int = 0,
    hook: SampleHook | None = None,
) -> Path:
    """Write ``{split: [samples per shard]}`` to ``root``; sample keys are ``{split}{global:06d}``.

    Labels: single-label ``global % num_classes``; multi-label ``[g % K, (g * 7 + 1) % K]``.
    """
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    meta_splits: dict = {}
    for split, counts in splits.items():
        shards = []
        g = 0
        for n, count in enumerate(counts):
            name = f"{split}-{n:06d}.tar"
            labels_of: dict[str, list[int]] = {}
            with wds.TarWriter(str(root / name)) as tw:
                for _ in range(count):
                    key = f"{split}{g:06d}"
                    labels = [g % num_classes, (g * 7 + 1) % num_classes] if multi_label else [g % num_classes]
                    labels = sorted(set(labels))
                    sample = {"jpg": jpeg_bytes(rng, *size)}
                    if multi_label:
                        sample["json"] = json.dumps({"labels": labels}).encode()
                    else:
                        sample["cls"] = str(labels[0]).encode()
                    if hook is not None:
                        sample = hook(key, sample)
                    tw.write({"__key__": key, **sample})
                    labels_of[key] = labels
                    g += 1
            spans = _scan_index(root / name)
            for key, labels in labels_of.items():
                off, sz = spans[key]
                rows.append(dict(split=split, shard=name, key=key, labels=labels, offset=off, size=sz))
            shards.append({"name": name, "samples": count, "sha256": "", "bytes": (root / name).stat().st_size})
        meta_splits[split] = {"samples": sum(counts), "shards": shards}
    schema = pa.schema(
        [("split", pa.string()), ("shard", pa.string()), ("key", pa.string()),
         ("labels", pa.list_(pa.int32())), ("offset", pa.int64()), ("size", pa.int64())]
    )  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), root / "_index.parquet")
    meta = {
        "name": "test",
        "classes": [f"c{i}" for i in range(num_classes)],
        "num_classes": num_classes,
        "multi_label": multi_label,
        "splits": meta_splits,
        "max_side": max(size),
        "quality": 90,
        "seed": seed,
        "source": "tests",
    }
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def tar_records(fmt: int, members: Sequence[tuple[str, bytes]]) -> bytes:
    """`members` as a tar archive written by `tarfile` in format `fmt` (end-of-archive blocks included)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()
