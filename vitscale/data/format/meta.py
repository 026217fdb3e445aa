"""dataset.json (the metadata) and _index.parquet (the index): names, schema, reading and writing.

See the package docstring (`vitscale.data.format`) for the contract.
"""


from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from vitscale.data.loader.labels import MAX_CLASSES
from vitscale.data.storage import LocalStorage, Storage, open_storage
from vitscale.data.storage.base import is_name

META_NAME = "dataset.json"
INDEX_NAME = "_index.parquet"
FORMAT = 1
"""The layout version `dataset.json` records (`format`): readers refuse a later one rather than misread it."""
INDEX_SCHEMA = pa.schema(
    [
        ("split", pa.string()),
        ("shard", pa.string()),
        ("key", pa.string()),
        ("labels", pa.list_(pa.int32())),
        ("offset", pa.int64()),
        ("size", pa.int64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("crc32", pa.int64()),
    ]
)
CRC_COLUMN = "crc32"
"""``zlib.crc32`` of the sample's whole byte range (headers, members, padding), checked on every
read. CRC-32 from the standard library: no dependency (crc32c and xxhash are not installed by
default), hardware-accelerated by zlib on x86-64 and ARM, several GB/s, so checking costs a few
microseconds next to a millisecond JPEG decode. Null or absent (datasets written before it
existed): not checked."""
INDEX_COLUMNS = ("split", "shard", "key", "offset", "size")
"""The index columns a reader needs (third-party writers and older datasets may leave out the others)."""


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or (
        pa.types.is_dictionary(t) and _is_text(t.value_type))


def _is_int_list(t: pa.DataType) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


_COLUMN_KINDS = {"split": ("text", _is_text), "shard": ("text", _is_text), "key": ("text", _is_text),
                 "offset": ("integers", pa.types.is_integer), "size": ("integers", pa.types.is_integer),
                 "crc32": ("integers", pa.types.is_integer), "labels": ("lists of integers", _is_int_list)}


def check_index_schema(schema: pa.Schema, where: str, *, labels: bool = False) -> None:
    """:class:`DatasetError` naming ``where`` unless ``schema`` has :data:`INDEX_COLUMNS` (and ``labels`` when
    the dataset's labels live in the index: :data:`LABEL_SOURCE`) and every contract column it has is of its
    kind (text, integers, lists of integers; any width). An index another tool rewrote (offsets as strings,
    labels as text) is refused up front, not met as a pyarrow error, or as every sample skipped, mid-run."""
    lacking = sorted((set(INDEX_COLUMNS) | ({"labels"} if labels else set())) - set(schema.names))
    if lacking:
        raise DatasetError(f"{where} lacks columns {lacking}: not a vitscale index, or a damaged one")
    for name, (kind, ok) in _COLUMN_KINDS.items():
        if name in schema.names and not ok(schema.field(name).type):
            raise DatasetError(f"{where}: column {name!r} is {schema.field(name).type}, the contract has {kind}: "
                               "a damaged index, or one another tool rewrote")


SHARD_ROOT = "shard_root"
"""``dataset.json`` key: the folder or ``s3://`` prefix the shard names are relative to, when it is
not the dataset's own (shards indexed in place by ``vitscale shards index --out``)."""
LABEL_SOURCE = "label_source"
"""``dataset.json`` key: ``"index"`` when labels are read from the index's ``labels`` column (adopted
shards whose label member is ``.txt`` or a ``.json`` key), absent when from ``.cls``/``.json``."""


def shard_name(split: str, n: int) -> str:
    """``{split}-{n:06d}.tar``."""
    return f"{split}-{n:06d}.tar"


SPLIT_WORDS = frozenset({"train", "training", "trainval", "val", "valid", "validation", "minival", "test",
                         "testing", "dev", "eval", "evaluation", "holdout", "heldout"})
"""Words that name a split wherever they stand in a shard's path, as a whole component between ``-``,
``_``, ``.`` or ``/`` (any case): ``imagenet1k-validation-00.tar``, ``test_000000.tar``, ``val/00000.tar``."""

_NUMBERED = re.compile(r"(?:(?P<head>.+?)(?P<sep>[-_.]))?\d+(?:[-_.]of[-_.]\d+)?")
"""A tar's stem ending in its shard number (``-00003``, ``_3``, ``.3``, ``-00003-of-01024``)."""
SPLIT_NAME = re.compile(r"[A-Za-z0-9_]+")
"""What a split name is: letters, digits and ``_`` (it names shard files: ``{split}-NNNNNN.tar``)."""
_COMPONENT = re.compile(r"[-_.]")


def split_of_shard(name: str) -> str | None:
    """The split a tar's path says, or None when it says none (``00000.tar``, ``laion-data-00000.tar``).

    In order: a :data:`SPLIT_WORDS` component of the file name (the one nearest the shard number wins,
    spelled as in the name: ``imagenet1k-train-0000.tar``: ``train``, ``TEST-000001.tar``: ``TEST``);
    else of the nearest folder that has one (``val/00000.tar``); else WebDataset's ``{split}-NNNNNN.tar``
    convention, any word before ``-`` and the number (``cc3m-000000.tar``: ``cc3m``; a split name is
    letters, digits and ``_``). Every name returned is a valid split name.
    """
    folders, _, base = name.rpartition("/")
    stem = base[:-len(".tar")] if base.lower().endswith(".tar") else base
    numbered = _NUMBERED.fullmatch(stem)
    head = (numbered.group("head") or "") if numbered else stem
    for text in [head, *reversed(folders.split("/") if folders else [])]:
        said = _split_word(text)
        if said is not None:
            return said
    if numbered and numbered.group("sep") == "-" and SPLIT_NAME.fullmatch(head):
        return head
    return None


def _split_word(text: str) -> str | None:
    """The last component of ``text`` (split at ``-``, ``_``, ``.``) that is a split word, as spelled."""
    words = [part for part in _COMPONENT.split(text) if part.lower() in SPLIT_WORDS]
    return words[-1] if words else None


PARQUET_THREADS = False
"""Whether vitscale's parquet reads use pyarrow's thread pool: never. After a threaded read of an in-memory
source, pyarrow 26's pool can abort the interpreter as it exits ("terminate called without an active
exception", exit 134: a third of `vitscale shards stats` runs did on this project's machine), and an index
is small enough for one thread."""


def read_parquet(source: bytes | str | os.PathLike[str]) -> pa.Table:
    """A whole parquet file (its bytes, or a local path read whole first), decoded on this thread alone.

    No Arrow thread is started, so none can be alive when the interpreter exits. `pq.read_table` goes
    through the dataset scanner, which starts two pool threads even with `use_threads` off (one process in
    ten that had read an index that way aborted at exit under load), and a parquet reader over a file
    starts an I/O thread; over bytes in memory it starts none (`tests/test_cli_shards.py` counts them).
    For files read whole anyway: an index, an image list.
    """
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    return pq.ParquetFile(pa.BufferReader(data)).read(use_threads=PARQUET_THREADS)


class DatasetError(ValueError):
    """The dataset cannot be used: missing shard, unreadable metadata/index, or they disagree."""


DEFAULT_SPLIT = "train"
"""The split of a tar whose name says none (``00000.tar``)."""


def shard_splits(names: list[str], split: str | None, where: str) -> dict[str, str]:
    """``{tar: split}``: the split each name says (:func:`split_of_shard`), or
    :data:`DEFAULT_SPLIT` when no name says one; with ``split`` given, that one for all of them.

    Never a silent merge (a test tar trained on is a leak): a ``DatasetError`` naming the tars when some
    names say a split and others none (which split the unnamed ones are is a guess), or when ``split``
    would put tars whose names say different splits (or a split and none) into one.
    """
    said = {name: split_of_shard(name) for name in names}
    unnamed = [name for name, s in said.items() if s is None]
    named = sorted({s for s in said.values() if s is not None})
    examples = ", ".join(next(n for n, s in said.items() if s == x) for x in named[:3])
    if unnamed and named:
        raise DatasetError(
            f"{where} holds tars whose names say a split ({examples}) and {len(unnamed)} whose names say none "
            f"({unnamed[0]}): which split those are is not known; index each split's tars on their own with "
            "--split NAME and its own --out (one tar, or braces: 'DIR/{00000..00099}.tar'), or rename them "
            "{split}-NNNNNN.tar")
    if split is None:
        return {name: s or DEFAULT_SPLIT for name, s in said.items()}
    if len(named) > 1:
        raise DatasetError(f"{where} holds tars of {len(named)} splits by their names ({examples}); --split {split} "
                           "would put them all into one: leave --split out to index each as its own split, or "
                           "name one split's tars (train-{000000..000099}.tar)")
    return dict.fromkeys(names, split)


@dataclass(frozen=True)
class ShardMeta:
    """One shard's entry in ``dataset.json``."""

    name: str
    samples: int
    sha256: str | None = None
    nbytes: int | None = None
    """File size (``"bytes"`` in ``dataset.json``)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "samples": self.samples}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        if self.nbytes is not None:
            out["bytes"] = self.nbytes
        return out


@dataclass(frozen=True)
class SplitMeta:
    """One split's entry: its sample count as stored, and its shards in order."""

    samples: int
    shards: tuple[ShardMeta, ...]

    @property
    def shard_names(self) -> tuple[str, ...]:
        return tuple(sh.name for sh in self.shards)

    @property
    def counts(self) -> tuple[int, ...]:
        """Samples per shard, in order."""
        return tuple(sh.samples for sh in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {"samples": self.samples, "shards": [sh.to_json() for sh in self.shards]}


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


_TYPED_KEYS = ("name", "classes", "num_classes", "multi_label", "splits", "max_side", "quality")


@dataclass(frozen=True)
class DatasetMeta:
    """A dataset's metadata: ``dataset.json`` parsed and validated."""

    name: str
    num_classes: int
    multi_label: bool
    splits: Mapping[str, SplitMeta]
    classes: tuple[str, ...] = ()
    max_side: int | None = None
    quality: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Every other key (seed, source, source_options, format, dedup, ...), in file order."""

    @property
    def labelled(self) -> bool:
        """Whether the samples carry labels (``num_classes`` 0: images alone, for self-supervised pre-training)."""
        return self.num_classes > 0

    def split(self, split: str) -> SplitMeta:
        """The entry of ``split``; :class:`DatasetError` naming the splits there are."""
        if split not in self.splits:
            raise DatasetError(f"no split {split!r}; splits are {list(self.splits)}")
        return self.splits[split]

    def samples(self, split: str) -> int:
        """Samples of ``split``, as ``dataset.json`` states them."""
        return self.split(split).samples

    def shard_names(self, split: str | None = None) -> list[str]:
        """Shard file names in ``dataset.json`` order, for one split or all."""
        splits = [split] if split is not None else list(self.splits)
        return [n for s in splits for n in self.split(s).shard_names]

    def to_json(self) -> dict[str, Any]:
        """The ``dataset.json`` object (key order as the writer has always written it)."""
        out: dict[str, Any] = {
            "name": self.name,
            "classes": list(self.classes),
            "num_classes": self.num_classes,
            "multi_label": self.multi_label,
            "splits": {s: sp.to_json() for s, sp in self.splits.items()},
        }
        if self.max_side is not None:
            out["max_side"] = self.max_side
        if self.quality is not None:
            out["quality"] = self.quality
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = META_NAME) -> DatasetMeta:
        """Parse and validate a ``dataset.json`` object; errors name ``where``."""
        if not isinstance(obj, dict) or not isinstance(obj.get("splits"), dict):
            raise DatasetError(f"{where} has no 'splits' mapping")
        try:
            splits = {}
            for s, sp in obj["splits"].items():
                shards = tuple(
                    ShardMeta(str(sh["name"]), int(sh["samples"]), sh.get("sha256"), _opt_int(sh.get("bytes")))
                    for sh in sp["shards"]
                )
                samples = int(sp["samples"]) if "samples" in sp else sum(sh.samples for sh in shards)
                splits[str(s)] = SplitMeta(samples, shards)
            meta = cls(
                name=str(obj.get("name", "")),
                num_classes=int(obj["num_classes"]),
                multi_label=bool(obj.get("multi_label", False)),
                splits=splits,
                classes=tuple(str(c) for c in obj.get("classes", ())),
                max_side=_opt_int(obj.get("max_side")),
                quality=_opt_int(obj.get("quality")),
                extra={k: v for k, v in obj.items() if k not in _TYPED_KEYS},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DatasetError(f"{where} is malformed: {exc!r}") from exc
        # Shard names are read as files under the dataset: one that leaves it ('../x', '/etc/x') or one listed
        # twice (its samples trained on twice an epoch) is a damaged or hostile file, refused here in one line.
        seen: set[str] = set()
        for s, sp in splits.items():
            for sh in sp.shards:
                if not is_name(sh.name) or sh.name in seen:
                    why = "listed twice" if sh.name in seen else "not a file name inside the dataset"
                    raise DatasetError(f"{where}: split {s!r} shard {sh.name!r} is {why}")
                if sh.samples < 0:
                    raise DatasetError(f"{where}: split {s!r} shard {sh.name!r} has {sh.samples} samples")
                seen.add(sh.name)
        if not 0 <= meta.num_classes <= MAX_CLASSES:  # a model's head is num_classes wide: bounded memory
            raise DatasetError(f"{where}: num_classes must be in [0, {MAX_CLASSES:,}] (0: images without labels)")
        if meta.num_classes == 0 and meta.classes:
            raise DatasetError(f"{where}: num_classes 0 (images without labels) but classes names {len(meta.classes)}")
        if meta.classes and len(meta.classes) != meta.num_classes:  # a name per class, or none: labels index them
            raise DatasetError(f"{where}: classes names {len(meta.classes)} classes but num_classes is "
                               f"{meta.num_classes}")
        version = meta.extra.get("format", FORMAT)
        # Absent in third-party files (read as this format); a later one may lay out shards or index otherwise.
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT:
            raise DatasetError(f"{where}: format {version!r} is not one this vitscale reads (format {FORMAT}): "
                               "written by a newer vitscale, or damaged")
        return meta


def _storage(url: str | Storage, endpoint_url: str | None) -> Storage:
    return url if isinstance(url, Storage) else open_storage(url, endpoint_url=endpoint_url)


def has_dataset(url: str | Storage, *, endpoint_url: str | None = None) -> bool:
    """Whether a complete dataset (its ``dataset.json``) is at ``url``."""
    return _storage(url, endpoint_url).exists(META_NAME)


def no_dataset(url: str | Storage, *, endpoint_url: str | None = None) -> str:
    """What to do where there is no ``dataset.json``: adopt the WebDataset tars the place holds where they lie
    (another tool's shards), else write a dataset there. The one wording of every reader's refusal."""
    storage = _storage(url, endpoint_url)
    with contextlib.suppress(OSError):  # (an unreadable place: only the advice to write is left)
        if tars := sum(name.endswith(".tar") for name in storage.list()):
            return (f"no dataset at {storage.url} (no {META_NAME}), but {tars} tar file(s): `vitscale shards index "
                    f"{storage.url}` adopts them where they lie (WebDataset shards another tool wrote)")
    return f"no dataset at {storage.url} (no {META_NAME}); write one with `vitscale shards write --source ... --out " \
           f"{storage.url}`, or a write there did not finish"


def read_meta(url: str | Storage, *, endpoint_url: str | None = None) -> DatasetMeta:
    """The metadata of the dataset at ``url`` (a folder, ``s3://bucket/prefix`` or a Storage).

    Raises FileNotFoundError when there is no ``dataset.json``, :class:`DatasetError` naming it
    when it is unreadable or malformed.
    """
    storage = _storage(url, endpoint_url)
    where = storage.url_of(META_NAME)
    try:
        obj = json.loads(storage.read_bytes(META_NAME))
    except FileNotFoundError:
        if _is_object(storage):  # `s3://b/ds/dataset.json` (a file) named for its folder: was "no ds/dataset.json/..."
            raise FileNotFoundError(f"{storage.url} is a file, not a dataset's folder: name the folder that holds "
                                    f"its {META_NAME}") from None
        raise FileNotFoundError(no_dataset(storage)) from None
    except (OSError, ValueError) as exc:
        raise DatasetError(f"cannot read {where}: {exc}") from exc
    return DatasetMeta.from_json(obj, where)


def shard_storage(storage: Storage, meta: DatasetMeta, endpoint_url: str | None = None) -> Storage:
    """Where the dataset's shards lie: beside its index, or where ``shards index --out`` put them (SHARD_ROOT)."""
    root = meta.extra.get(SHARD_ROOT)
    return storage if root is None else open_storage(str(root), endpoint_url=endpoint_url)


def _is_object(storage: Storage) -> bool:
    """Whether an object store's root names one object (a file) rather than a prefix (a folder)."""
    parent, _, name = storage.url.rpartition("/")
    if isinstance(storage, LocalStorage) or not name or parent.endswith(":/"):
        return False  # a local file is refused when read (not a directory); a bucket is no object
    return open_storage(parent, endpoint_url=getattr(storage, "endpoint_url", None)).exists(name)


def read_index(url: str | Storage, *, endpoint_url: str | None = None) -> pa.Table:
    """The whole ``_index.parquet`` of the dataset at ``url`` (tools; the stream reads per shard)."""
    storage = _storage(url, endpoint_url)
    data = storage.read_bytes(INDEX_NAME)
    try:
        table = read_parquet(data)
    except (pa.ArrowInvalid, OSError) as exc:  # not a parquet file, or a damaged one
        raise DatasetError(f"cannot read {storage.url_of(INDEX_NAME)}: {exc}") from exc
    check_index_schema(table.schema, storage.url_of(INDEX_NAME))
    return table
