"""``vitscale shards index``: adopt existing WebDataset tars as a vitscale dataset, without rewriting them.

Shards written by ``webdataset.TarWriter``, img2dataset and the like hold samples as consecutive
members sharing a key (``{key}.jpg`` / ``.png`` / ``.webp`` plus ``.cls``, ``.txt`` or ``.json``;
the key is the member name up to the first dot of its base name, WebDataset's rule). Each tar
belongs to the split its path says (:func:`~vitscale.data.format.split_of_shard`:
``imagenet1k-validation-00.tar``, ``test_000000.tar``, ``val/00000.tar``), or every tar to ``train``
when no name says one; names that say a split for some tars and none for others are refused, never
merged. Indexing
walks each tar's headers and writes ``_index.parquet`` (one row per sample: its byte range and the
``crc32`` of those bytes, checked on every read as for written datasets) and ``dataset.json``:

- beside the tars, or in ``--out`` (``shard_root`` in ``dataset.json`` then names where they lie);
- the label comes from ``--label-member``: ``cls`` (an integer class id, the default), ``txt``
  (a class name) or ``json:KEY`` (an integer, a name or a list of either under ``KEY``); names
  map to indices by ``--classes FILE`` (one name per line) or, without it, in sorted order. Labels
  other than ``cls`` are read from the index when training (``label_source: index``); ``none``: images
  alone (``num_classes`` 0, for masked patch pre-training). Left unset, it is ``cls``, unless not one
  sample of the first tar has a ``.cls`` member: then ``json:labels`` when every ``.json`` member holds
  ``{"labels": ...}`` (vitscale's own multi-label member), else the tars are images without labels,
  and the index says so in one line. Other ``.txt`` and ``.json`` members are never taken for a label
  unasked: in crawled tars (img2dataset) they are the caption and the URL metadata.

Checksums cost one sequential read of every shard. ``--no-checksums`` skips it (headers only: the
walk seeks over member data, so an ``s3://`` shard is not downloaded); such samples are then read
unchecked, as datasets written before the ``crc32`` column are.

A sample without an image member or a readable label is left out of the index, counted and
listed (``bad_samples``). URLs: a folder or ``s3://`` prefix (every ``.tar`` below it), one tar,
or WebDataset's brace notation ``.../train-{000000..000999}.tar`` (all in one folder); a gzip-compressed
tar among them is refused (:mod:`~vitscale.data.tools.adopt_checks`).
"""

from __future__ import annotations

import io
import json
import posixpath
import re
import tarfile
import zlib
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from vitscale.config.errors import UserError
from vitscale.data.format import (
    FORMAT,
    INDEX_NAME,
    INDEX_SCHEMA,
    LABEL_SOURCE,
    META_NAME,
    SHARD_ROOT,
    SPLIT_NAME,
    DatasetError,
    DatasetMeta,
    ShardMeta,
    SplitMeta,
    shard_splits,
    write_index_and_meta,
)
from vitscale.data.loader.labels import MAX_CLASSES, MAX_LABEL_BYTES, LabelError, check_class_ids
from vitscale.data.loader.sample import image_member, no_image
from vitscale.data.storage import LocalStorage, Storage, StorageError, open_storage
from vitscale.data.storage.cleanup import missing_folders, remove_new_folders
from vitscale.data.storage.space import free_bytes, free_text, is_no_space, out_of_files, size_text
from vitscale.data.tools import adopt_checks
from vitscale.data.tools.label_member import LABEL_EXTS, NO_LABELS_HINT, LabelMember, default_member
from vitscale.data.tools.progress import Progress
from vitscale.data.tools.publish import WRITING, held
from vitscale.data.tools.scan import member_key

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
            raise DatasetError(f"brace range {{{body}}} in {pattern!r} must be {{LOW..HIGH}} with integers, "
                               "LOW <= HIGH")
        choices = [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    else:
        choices = body.split(",")
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [head + c + rest for c in choices for rest in expand_braces(tail)]


def split_url(url: str) -> tuple[str, list[str] | None]:
    """(the folder the shards lie in, their names in order, or None: every ``.tar`` below it)."""
    if "{" not in url and not url.endswith((".tar", *adopt_checks.COMPRESSED_SUFFIXES)):
        return url.rstrip("/"), None
    paths = expand_braces(url)
    roots = {p.rpartition("/")[0] for p in paths}
    if len(roots) != 1 or "{" in next(iter(roots)):
        raise DatasetError(f"{url}: the shards must lie in one folder (braces only in the file name)")
    return roots.pop() or ".", [p.rpartition("/")[2] for p in paths]


def _samples(storage: Storage, shard: str, shard_size: int
             ) -> tuple[list[tuple[str, int, int, dict[str, bytes | None]]], list[dict[str, Any]]]:
    """(samples, bad) of one shard: (key, offset, size, {ext: label bytes, or None for other members})
    per sample in tar order, and the samples that cannot be indexed (shard, key, offset, error).

    Memory is bounded by the shard, not by its headers: a label member is read only up to
    ``MAX_LABEL_BYTES + 1`` bytes (more makes it bad, not a big allocation); a member whose header
    claims more bytes than the shard holds makes its sample bad; damage past the first member ends
    the walk with one bad entry for the rest of the shard (the samples before it stay indexed).
    A shard whose first header is unreadable is not a tar: ``tarfile.TarError``.
    """
    found: list[tuple[str, int, int, dict[str, bytes | None]]] = []
    bad: list[dict[str, Any]] = []
    with storage.open_read(shard) as f, tarfile.open(fileobj=f, mode="r:") as tar:
        key: str | None = None
        start = end = 0
        members: dict[str, bytes | None] = {}
        damaged = ""

        def close() -> None:
            if key is None:
                return
            if end > shard_size or damaged:
                bad.append({"shard": shard, "key": key, "offset": start, "error": damaged or
                            f"a member runs past the end of the shard ({end} > {shard_size} bytes)"})
            else:
                found.append((key, start, end - start, members))

        members_iter = iter(tar)
        while True:
            try:
                m = next(members_iter)
            except StopIteration:
                break
            except (tarfile.TarError, OSError, UnicodeError) as exc:
                if key is None and not found and not bad:
                    raise tarfile.ReadError(str(exc)) from exc
                close()
                if end <= shard_size:  # else the sample before already ran past the end: nothing is left
                    bad.append({"shard": shard, "key": "(rest of the shard)", "offset": end,
                                "error": f"unreadable tar header after byte {end}: {type(exc).__name__}: {exc}"})
                key = None
                break
            if not m.isfile():
                continue
            k, ext = member_key(m.name)
            if k != key:
                close()
                key, start, members, damaged = k, m.offset, {}, ""
            end = m.offset_data + -(-m.size // 512) * 512
            members[ext] = None
            if ext in LABEL_EXTS and end <= shard_size:
                try:  # labels are small; images are not read (their bytes stay in the shard)
                    members[ext] = tar.extractfile(m).read(MAX_LABEL_BYTES + 1)  # type: ignore[union-attr]
                except (tarfile.TarError, OSError) as exc:
                    damaged = f"unreadable .{ext} member: {exc}"
        close()
    return found, bad


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


def index_shards(url: str, *, out: str | None = None, split: str | None = None, label_member: str | None = None,
                 classes_file: str | None = None, endpoint_url: str | None = None,
                 checksums: bool = True, num_classes: int | None = None, max_bad: int | None = 100,
                 progress: bool = True) -> dict[str, Any]:
    """Index the WebDataset tars at ``url`` (see the module docstring); returns ``dataset.json``'s content.

    Each tar belongs to the split its name says (``imagenet1k-validation-00.tar``: ``validation``), or
    all to ``train`` when no name says one; ``split`` puts them all into that one (refused when their
    names say several, or some a split and others none: :func:`shard_splits`).
    ``label_member`` None: decided by the first tar (:func:`~vitscale.data.tools.label_member.default_member`:
    ``cls``, ``json:labels`` or ``none``).
    ``num_classes`` bounds the class ids (else the ``--classes`` file's length, else
    ``labels.MAX_CLASSES``); more than ``max_bad`` bad samples (None: no limit) stop the index
    with one line naming the last one.
    """
    if num_classes is not None and not 1 <= num_classes <= MAX_CLASSES:  # a name each is made: bounded memory
        raise UserError(f"--num-classes must be a count in [1, {MAX_CLASSES:,}], got {num_classes}")
    if max_bad is not None and max_bad < 0:
        raise UserError(f"--max-bad must be >= 0, got {max_bad}")
    if split is not None and not SPLIT_NAME.fullmatch(split):
        raise UserError(f"--split {split!r}: a split name is letters, digits and '_' (it names shard files)")
    shards, dest, sizes, names = _places(url, out, endpoint_url)
    split_of = shard_splits(names, split, shards.url)
    classes = _read_classes(classes_file, num_classes) if classes_file else None
    bound = num_classes if num_classes is not None else (len(classes) if classes is not None else None)
    rows: list[dict[str, Any]] = []
    # A bad sample is named by its shard and its place there (a key may be written twice in one tar, one copy
    # bad): `verify` leaves out that copy alone.
    bad: list[dict[str, Any]] = []
    entries: list[tuple[str, int]] = []

    def reject(shard: str, key: str, offset: int, why: str) -> None:
        bad.append({"shard": shard, "key": key, "offset": offset, "error": why})
        _check_bad(bad, max_bad, shards)

    labels: LabelMember | None = None if label_member is None else LabelMember(label_member, classes)
    bar = Progress(len(names), f"index {shards.url}", unit="shard", enabled=progress)  # a line per shard read
    for shard in names:
        try:
            found, damaged = _samples(shards, shard, sizes[shard])
            crcs = _checksums(shards, shard, [(o, n) for _, o, n, _ in found]) if checksums else [-1] * len(found)
        except (tarfile.TarError, OSError) as exc:
            adopt_checks.refuse_gzip_bytes(shards, shard)
            raise DatasetError(f"{shards.url_of(shard)} is not a readable tar: {exc}") from exc
        adopt_checks.refuse_scattered(shards, shard, found)
        if labels is None:  # the default: decided by the first tar
            labels = LabelMember(default_member(found, shards.url_of(shard), progress), classes)
        for entry in damaged:
            reject(entry["shard"], entry["key"], entry["offset"], entry["error"])
        kept = _shard_rows(shard, split_of[shard], found, crcs, labels, bound, reject)
        rows += kept
        entries.append((shard, len(kept)))
        bar.update()
    bar.close()
    if labels is None or not rows:
        if labels is None or labels.kind == "none":
            raise DatasetError(f"no sample with an image in {len(names)} shard(s) under {shards.url}")
        raise DatasetError(f"no sample with an image and a .{labels.ext} label in {len(names)} shard(s) under "
                           f"{shards.url}; {NO_LABELS_HINT}")
    class_names = [] if labels.kind == "none" else _finish_labels(rows, classes, num_classes)
    splits = {name: _split_meta(name, entries, split_of, sizes) for name in dict.fromkeys(split_of.values())}
    meta = DatasetMeta(
        name=posixpath.basename(shards.url.rstrip("/")) or "dataset", classes=tuple(class_names),
        num_classes=len(class_names), multi_label=bool(class_names) and any(len(r["labels"]) != 1 for r in rows),
        splits=splits,
        extra={"source": f"shards index {url}", "label_member": labels.member, "format": FORMAT, "bad_samples": bad,
               **({LABEL_SOURCE: "index"} if labels.kind in ("txt", "json") else {}),
               **({SHARD_ROOT: shards.url} if dest is not shards else {})},
    )
    _write(dest, rows, meta)
    return meta.to_json()


def _places(url: str, out: str | None, endpoint_url: str | None
            ) -> tuple[Storage, Storage, dict[str, int], list[str]]:
    """(the tars' storage, where the index goes, the tars' folder listing, the tars to index) of ``index_shards``,
    refused before any tar is read: an index already there, a write's first shards, a tar that is not there."""
    root, names = split_url(url)
    shards = open_storage(root, endpoint_url=endpoint_url)
    dest = open_storage(out, endpoint_url=endpoint_url) if out else shards
    if dest.exists(META_NAME):
        raise DatasetError(f"{dest.url_of(META_NAME)} exists: {dest.url} is already a dataset; index into another "
                           f"--out, or delete its {META_NAME} and {INDEX_NAME} to index it again")
    sizes = shards.list_sizes()
    for place in {shards.url: shards, dest.url: dest}.values():  # the tars' folder, and --out's
        if place.exists(WRITING):  # its tars are a write's first shards: indexed, they would pass for all of it
            raise DatasetError(f"{place.url_of(WRITING)}: a vitscale write into {place.url} is running or was "
                               "interrupted; run that write again to finish it, or delete its files first")
    if names is None:
        adopt_checks.refuse_compressed(shards, list(sizes))  # left out of the listing, their samples missing unsaid
        names = [n for n in sizes if n.endswith(".tar")]
    missing = [n for n in names if n not in sizes]
    if missing or not names:
        raise DatasetError(f"no tar shard {missing[0] if missing else '(*.tar)'} under {shards.url}")
    adopt_checks.refuse_compressed(shards, names)
    return shards, dest, sizes, names


def _read_classes(classes_file: str, num_classes: int | None) -> list[str]:
    """The class names of a ``--classes`` file, one a line; refused when ``--num-classes`` says another count."""
    with open(classes_file, encoding="utf-8") as f:
        classes = [line.strip() for line in f if line.strip()]
    if num_classes is not None and num_classes != len(classes):
        raise UserError(f"--num-classes {num_classes} but --classes {classes_file} names {len(classes)}")
    return classes


def _shard_rows(shard: str, split: str, found: list[tuple[str, int, int, dict[str, bytes | None]]], crcs: list[int],
                labels: LabelMember, bound: int | None,
                reject: Callable[[str, str, int, str], None]) -> list[dict[str, Any]]:
    """One shard's samples as index rows; one without an image or a readable label is rejected instead."""
    rows = []
    for (key, offset, size, members), crc in zip(found, crcs, strict=True):
        label = members.get(labels.ext)
        if image_member(members) is None:
            reject(shard, key, offset, no_image(members))
            continue
        if labels.kind == "none":  # images alone: any label member is ignored
            rows.append({"split": split, "shard": shard, "key": key, "labels": [], "offset": offset,
                         "size": size, "crc32": crc})
            continue
        if label is None:
            reject(shard, key, offset, f"{_NO_LABEL} .{labels.ext} label member")
            continue
        try:
            ids = labels.parse(label)
            check_class_ids([v for v in ids if isinstance(v, int)], bound)
        except LabelError as exc:
            reject(shard, key, offset, f"label: {exc}")
            continue
        rows.append({"split": split, "shard": shard, "key": key, "labels": ids, "offset": offset,
                     "size": size, "crc32": crc})
    return rows


def _write(dest: Storage, rows: list[dict[str, Any]], meta: DatasetMeta) -> None:
    """``_index.parquet`` and ``dataset.json`` into ``dest``; a full disk says how much room they need.

    A failed write leaves nothing it created: each file is written whole (to a temporary name first,
    `storage/atomic.py`), and the folders it made for ``dest`` are removed again while empty, as a
    failed `shards write` does (`publish.py`, `storage/cleanup.py`).
    """
    created = missing_folders(dest.url) if isinstance(dest, LocalStorage) else []
    try:
        with held(dest):  # one writer: of two indexes of one place at once, the second is refused
            write_index_and_meta(dest, rows, meta)
    except BaseException as exc:
        remove_new_folders(created)
        if not isinstance(exc, OSError) or not is_no_space(exc):
            raise
        raise StorageError(f"no space left on the device of {dest.url} for {INDEX_NAME} and {META_NAME}: they need "
                           f"about {size_text(_index_bytes(rows, meta))}, {free_text(dest.url, free_bytes(dest.url))}; "
                           f"{'remove files' if out_of_files(dest.url) else 'free space'} or choose another --out, "
                           "and index again") from exc


def _split_meta(split: str, entries: list[tuple[str, int]], split_of: dict[str, str],
                sizes: dict[str, int]) -> SplitMeta:
    """``split``'s entry in ``dataset.json``: its shards (in index order) and their kept samples."""
    shards = tuple(ShardMeta(shard, kept, None, sizes[shard]) for shard, kept in entries if split_of[shard] == split)
    return SplitMeta(sum(s.samples for s in shards), shards)


def _index_bytes(rows: list[dict[str, Any]], meta: DatasetMeta) -> int:
    """Bytes of ``_index.parquet`` plus ``dataset.json`` for ``rows`` and ``meta`` (written to memory)."""
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=INDEX_SCHEMA), buf)
    return buf.tell() + len(json.dumps(meta.to_json(), indent=2)) + 1


_NO_LABEL = "no readable"
"""How a sample without its label member is listed (``no readable .cls label member``)."""


def _check_bad(bad: list[dict[str, Any]], max_bad: int | None, shards: Storage) -> None:
    if max_bad is not None and len(bad) > max_bad:
        last = bad[-1]
        hint = f"; {NO_LABELS_HINT}" if last["error"].startswith(_NO_LABEL) else ""
        raise DatasetError(f"more than {max_bad} bad samples (--max-bad) under {shards.url}; the last: "
                           f"{shards.url_of(last['shard'])} sample {last['key'][:100]!r}: {last['error'][:300]}"
                           f"{hint}")


def _finish_labels(rows: list[dict[str, Any]], classes: list[str] | None, num_classes: int | None) -> list[str]:
    """Class names, and every row's labels as indices (names found map in sorted order).

    Ids were already checked against the class count (or ``MAX_CLASSES``) sample by sample.
    """
    found = {v for r in rows for v in r["labels"] if isinstance(v, str)}
    ids = [v for r in rows for v in r["labels"] if not isinstance(v, str)]
    if classes is None and found and ids:
        raise DatasetError("labels mix class ids and names; pass --classes FILE to name the ids")
    if classes is None:
        count = num_classes if num_classes is not None else (len(found) if found else max(ids) + 1)
        classes = sorted(found) if found else [str(i) for i in range(count)]
        if len(classes) > count:
            raise DatasetError(f"{len(classes)} class names found but --num-classes is {count}")
    lookup = {c: i for i, c in enumerate(classes)}
    for r in rows:
        r["labels"] = sorted({lookup[v] if isinstance(v, str) else v for v in r["labels"]})
    return list(classes)
