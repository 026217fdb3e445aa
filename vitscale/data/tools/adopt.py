"""``vitscale shards index``: adopt existing WebDataset tars as a vitscale dataset, without rewriting them.

Shards written by ``webdataset.TarWriter``, img2dataset and the like hold samples as consecutive
members sharing a key (``{key}.jpg`` / ``.png`` / ``.webp`` plus ``.cls``, ``.txt`` or ``.json``;
the key is the member name up to the first dot of its base name, WebDataset's rule). Indexing
walks each tar's headers and writes ``_index.parquet`` (one row per sample: its byte range and the
``crc32`` of those bytes, checked on every read as for written datasets) and ``dataset.json``:

- beside the tars, or in ``--out`` (``shard_root`` in ``dataset.json`` then names where they lie);
- the label comes from ``--label-member``: ``cls`` (an integer class id, the default), ``txt``
  (a class name) or ``json:KEY`` (an integer, a name or a list of either under ``KEY``); names
  map to indices by ``--classes FILE`` (one name per line) or, without it, in sorted order. Labels
  other than ``cls`` are read from the index when training (``label_source: index``).

Checksums cost one sequential read of every shard. ``--no-checksums`` skips it (headers only: the
walk seeks over member data, so an ``s3://`` shard is not downloaded); such samples are then read
unchecked, as datasets written before the ``crc32`` column are.

A sample without an image member or a readable label is left out of the index, counted and
listed (``bad_samples``). URLs: a folder or ``s3://`` prefix (every ``.tar`` below it), one tar,
or WebDataset's brace notation ``.../train-{000000..000999}.tar`` (all in one folder).
"""

from __future__ import annotations

import json
import posixpath
import re
import tarfile
import zlib
from collections.abc import Iterator
from typing import Any

from vitscale.data.format import (
    LABEL_SOURCE, META_NAME, SHARD_ROOT, DatasetMeta, ShardMeta, SplitMeta, write_index_and_meta)
from vitscale.data.loader.sample import IMAGE_MEMBERS
from vitscale.data.storage import Storage, open_storage

__all__ = ["expand_braces", "index_shards", "split_url"]

_BRACE = re.compile(r"\{([^{}]*)\}")


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace notation: ``a-{000..002}.tar`` -> ``a-000.tar, a-001.tar, a-002.tar``.

    ``{lo..hi}`` is a zero-padded integer range (the width of ``lo``), ``{x,y}`` a list; several
    groups expand as a product, in order.
    """
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    if ".." in body:
        lo, _, hi = body.partition("..")
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ValueError(f"brace range {{{body}}} in {pattern!r} must be {{LOW..HIGH}} with integers, LOW <= HIGH")
        choices = [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    else:
        choices = body.split(",")
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [head + c + rest for c in choices for rest in expand_braces(tail)]


def split_url(url: str) -> tuple[str, list[str] | None]:
    """(the folder the shards lie in, their names in order, or None: every ``.tar`` below it)."""
    if "{" not in url and not url.endswith(".tar"):
        return url.rstrip("/"), None
    paths = expand_braces(url)
    roots = {p.rpartition("/")[0] for p in paths}
    if len(roots) != 1 or "{" in next(iter(roots)):
        raise ValueError(f"{url}: the shards must lie in one folder (braces only in the file name)")
    return roots.pop() or ".", [p.rpartition("/")[2] for p in paths]


def _member_key(name: str) -> tuple[str, str]:
    """(key, extension) by WebDataset's rule: the base name splits at its first dot."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def _samples(storage: Storage, shard: str) -> Iterator[tuple[str, int, int, dict[str, bytes | None]]]:
    """(key, offset, size, {ext: small member bytes, or None for images}) per sample, in tar order."""
    with storage.open_read(shard) as f, tarfile.open(fileobj=f, mode="r:") as tar:
        key, start, end, members = None, 0, 0, {}
        for m in tar:
            if not m.isfile():
                continue
            k, ext = _member_key(m.name)
            if k != key:
                if key is not None:
                    yield key, start, end - start, members
                key, start, members = k, m.offset, {}
            end = m.offset_data + -(-m.size // 512) * 512
            # Labels are small; images are not read (their bytes stay in the shard).
            small = ext in ("cls", "txt", "json") and m.size <= 1 << 20
            members[ext] = tar.extractfile(m).read() if small else None  # type: ignore[union-attr]
        if key is not None:
            yield key, start, end - start, members


def _checksums(storage: Storage, shard: str, ranges: list[tuple[int, int]]) -> list[int]:
    """``zlib.crc32`` of each (offset, size) byte range of ``shard`` (ascending, disjoint), in one
    sequential read; a range the shard ends before raises ``OSError``."""
    crcs, pos = [], 0
    with storage.open_read(shard) as f:
        for offset, size in ranges:
            crc, need = 0, size
            skip = offset - pos
            while skip > 0 or need > 0:
                chunk = f.read(min(skip, 1 << 20) if skip > 0 else min(need, 1 << 20))
                if not chunk:
                    raise OSError(f"{storage.url_of(shard)} ends at byte {pos}, before the sample at {offset}")
                pos += len(chunk)
                if skip > 0:
                    skip -= len(chunk)
                else:
                    crc, need = zlib.crc32(chunk, crc), need - len(chunk)
            crcs.append(crc)
    return crcs


class _Labels:
    """Class ids from a sample's label member, by ``--label-member``; names mapped as they come."""

    def __init__(self, member: str, classes: list[str] | None) -> None:
        kind, _, self.json_key = member.partition(":")
        if kind not in ("cls", "txt", "json") or (kind == "json") != bool(self.json_key):
            raise ValueError(f"--label-member must be cls, txt or json:KEY, got {member!r}")
        self.kind, self.fixed = kind, classes is not None
        self.names: dict[str, int] = {c: i for i, c in enumerate(classes or [])}

    @property
    def ext(self) -> str:
        return self.kind

    def _id(self, value: Any) -> int | str:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"label {value!r} is neither a class id nor a name")
        if isinstance(value, str) and not self.fixed:
            return value  # mapped to an index once all names are known (sorted)
        if isinstance(value, str):
            if value not in self.names:
                raise ValueError(f"class {value!r} is not in --classes")
            return self.names[value]
        return value

    def parse(self, data: bytes) -> list[int | str]:
        text = data.decode("utf-8").strip()
        if self.kind == "cls":
            return [int(text)]
        if self.kind == "txt":
            return [self._id(text)]
        value = json.loads(text)[self.json_key]
        return [self._id(v) for v in (value if isinstance(value, list) else [value])]


def index_shards(url: str, *, out: str | None = None, split: str = "train", label_member: str = "cls",
                 classes_file: str | None = None, endpoint_url: str | None = None,
                 checksums: bool = True) -> dict[str, Any]:
    """Index the WebDataset tars at ``url`` (see the module docstring); returns ``dataset.json``'s content."""
    root, names = split_url(url)
    shards = open_storage(root, endpoint_url=endpoint_url)
    dest = open_storage(out, endpoint_url=endpoint_url) if out else shards
    if dest.exists(META_NAME):
        raise ValueError(f"{dest.url_of(META_NAME)} exists: {dest.url} is already a dataset")
    sizes = shards.list_sizes()
    if names is None:
        names = [n for n in sizes if n.endswith(".tar")]
    missing = [n for n in names if n not in sizes]
    if missing or not names:
        raise ValueError(f"no tar shard {missing[0] if missing else '(*.tar)'} under {shards.url}")
    classes = None
    if classes_file:
        with open(classes_file, encoding="utf-8") as f:
            classes = [line.strip() for line in f if line.strip()]
    labels = _Labels(label_member, classes)
    rows: list[dict[str, Any]] = []
    bad: list[dict[str, str]] = []
    entries = []
    for shard in names:
        try:
            found = list(_samples(shards, shard))
            crcs = _checksums(shards, shard, [(o, n) for _, o, n, _ in found]) if checksums else [-1] * len(found)
        except (tarfile.TarError, OSError) as exc:
            raise ValueError(f"{shards.url_of(shard)} is not a readable tar: {exc}") from exc
        kept = 0
        for (key, offset, size, members), crc in zip(found, crcs, strict=True):
            why = None
            if not any(ext in members for ext in IMAGE_MEMBERS):
                why = f"no image member ({', '.join(IMAGE_MEMBERS)}) among {sorted(members)}"
            elif members.get(labels.ext) is None:
                why = f"no readable .{labels.ext} label member"
            else:
                try:
                    ids = labels.parse(members[labels.ext])  # type: ignore[arg-type]
                except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
                    why = f"label: {type(exc).__name__}: {exc}"
            if why is not None:
                bad.append({"shard": shard, "key": key, "error": why})
                continue
            rows.append(dict(split=split, shard=shard, key=key, labels=ids, offset=offset, size=size, crc32=crc))
            kept += 1
        entries.append(ShardMeta(shard, kept, None, sizes[shard]))
    if not rows:
        raise ValueError(f"no sample with an image and a .{labels.ext} label in {len(names)} shard(s) under {shards.url}")
    class_names = _finish_labels(rows, classes)
    meta = DatasetMeta(
        name=posixpath.basename(shards.url.rstrip("/")) or "dataset", classes=tuple(class_names),
        num_classes=len(class_names), multi_label=any(len(r["labels"]) != 1 for r in rows),
        splits={split: SplitMeta(len(rows), tuple(entries))},
        extra={"source": f"shards index {url}", "label_member": label_member, "format": 1, "bad_samples": bad,
               **({LABEL_SOURCE: "index"} if labels.kind != "cls" else {}),
               **({SHARD_ROOT: shards.url} if dest is not shards else {})},
    )
    write_index_and_meta(dest, rows, meta)
    return meta.to_json()


def _finish_labels(rows: list[dict[str, Any]], classes: list[str] | None) -> list[str]:
    """Class names, and every row's labels as indices (names found map in sorted order)."""
    found = {v for r in rows for v in r["labels"] if isinstance(v, str)}
    ids = [v for r in rows for v in r["labels"] if not isinstance(v, str)]
    if classes is None and found and ids:
        raise ValueError("labels mix class ids and names; pass --classes FILE to name the ids")
    if classes is None:
        classes = sorted(found) if found else [str(i) for i in range(max(ids) + 1)]
    lookup = {c: i for i, c in enumerate(classes)}
    for r in rows:
        r["labels"] = sorted({lookup[v] if isinstance(v, str) else v for v in r["labels"]})
        if any(not 0 <= v < len(classes) for v in r["labels"]):
            raise ValueError(f"sample {r['key']} in {r['shard']}: label {r['labels']} outside the "
                             f"{len(classes)} classes")
    return list(classes)
