"""Sharded training stream: this rank's samples, in the planned order, as uint8 batches.

``ShardStream`` reads a dataset written by ``vitscale shards write`` (``dataset.json``,
``_index.parquet``, ``{split}-NNNNNN.tar``) from a folder or ``s3://``:

- the order is :func:`vitscale.data.plan.plan`'s: disjoint, equal-length per rank, reshuffled per
  epoch, resumable at any sample;
- each sample is fetched with a ranged read of its bytes (offsets from the index), so a rank reads
  only its own samples; with ``num_workers`` loader processes, batch ``b`` is built whole by worker
  ``b % num_workers``, which is the order ``DataLoader`` hands batches out, so the emitted order is
  the plan's whatever the worker count;
- augmentation draws from ``sample_rng(seed, epoch, global index)``: a resumed stream yields
  bit-identical batches.

Epochs. Iterating the stream yields the rest of the current epoch (``len(stream)`` batches) and
then stops; the epoch counter advances as the epoch's last batch is handed out, so the next ``for``
loop runs the next epoch and a checkpoint taken after the last batch resumes at the next epoch's
start. ``set_epoch(e)`` jumps to the start of epoch ``e``. ``state_dict()`` counts every batch
already handed out (``position`` = samples of this epoch consumed by this rank).

Bad samples (truncated tar, corrupt JPEG, missing/malformed label) are skipped, counted per shard
(:meth:`ShardStream.skipped`) and logged once with shard and key. Every rank still emits the same
number of batches of the same shape: a batch that lost samples refills those rows with copies of
its surviving samples and marks them ``valid=False`` (a batch that lost all its samples is zeros,
label 0, all ``valid=False``). Past ``error_budget`` skipped samples in an epoch (a fraction of the
rank's epoch if < 1, else a count) the stream raises :class:`ErrorBudgetExceeded` naming the shards.
A missing shard, an unreadable ``dataset.json``/index or an index that disagrees with the manifest
raises :class:`DatasetError` in the constructor, before any training step.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vitscale.data.decode import BadSample, decode_image_into, parse_label, split_tar_record
from vitscale.data.plan import DEFAULT_SHUFFLE_BUFFER, RankPlan, num_batches, plan, worker_batches
from vitscale.data.storage import LocalStorage, Storage, open_storage
from vitscale.data.transforms import TransformSpec, sample_rng

__all__ = [
    "DatasetError",
    "ErrorBudgetExceeded",
    "OpenDataset",
    "ShardIndex",
    "ShardStream",
    "StreamSpec",
    "open_dataset",
]

log = logging.getLogger(__name__)

MANIFEST = "dataset.json"
INDEX = "_index.parquet"
_INDEX_COLUMNS = ("split", "shard", "key", "offset", "size")


class DatasetError(ValueError):
    """The dataset cannot be streamed: missing shard, unreadable manifest/index, or they disagree."""


class ErrorBudgetExceeded(RuntimeError):
    """More samples were skipped in an epoch than ``error_budget`` allows."""


@dataclass(frozen=True)
class ShardIndex:
    """Where each sample of one shard lives, in tar order."""

    offsets: np.ndarray
    """(n,) int64 byte offset of the sample's first tar header."""
    sizes: np.ndarray
    """(n,) int64 bytes of the sample's record, padding included."""
    keys: pa.Array
    """(n,) sample keys (an Arrow array: no Python objects per sample, cheap to fork)."""

    def key(self, i: int) -> str:
        """Key of the shard's ``i``-th sample."""
        return str(self.keys[i].as_py())


@dataclass(frozen=True, eq=False)
class OpenDataset:
    """A validated split of a dataset: manifest facts plus a local path to its index."""

    storage: Storage
    split: str
    name: str
    classes: tuple[str, ...]
    num_classes: int
    multi_label: bool
    shard_names: tuple[str, ...]
    counts: tuple[int, ...]
    index_path: str

    def load_index(self, shards: Iterable[int]) -> dict[int, ShardIndex]:
        """Index rows of the given shard numbers only (parquet filter pushdown, not a full scan)."""
        wanted = sorted(set(int(s) for s in shards))
        if not wanted:
            return {}
        names = [self.shard_names[s] for s in wanted]
        try:
            table = pq.read_table(
                self.index_path,
                columns=["shard", "key", "offset", "size"],
                filters=[("split", "=", self.split), ("shard", "in", names)],
            )
        except (OSError, pa.ArrowInvalid) as exc:
            raise DatasetError(f"cannot read {self.storage.url_of(INDEX)}: {exc}") from exc
        table = table.sort_by([("shard", "ascending"), ("offset", "ascending")])
        vc = pc.value_counts(table.column("shard"))  # in order of appearance = sorted order
        found = dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()))
        offsets = table.column("offset").to_numpy().astype(np.int64)
        sizes = table.column("size").to_numpy().astype(np.int64)
        keys = table.column("key").combine_chunks()
        out: dict[int, ShardIndex] = {}
        row = 0
        by_name = {n: s for s, n in zip(wanted, names)}
        for name in vc.field("values").to_pylist():
            n = found[name]
            s = by_name[name]
            if n != self.counts[s]:
                raise DatasetError(
                    f"{self.storage.url_of(INDEX)} has {n} rows for shard {name}, "
                    f"{MANIFEST} says {self.counts[s]}: rewrite the index or the manifest"
                )
            out[s] = ShardIndex(offsets[row : row + n], sizes[row : row + n], keys.slice(row, n))
            row += n
        for s, name in zip(wanted, names):
            if s not in out and self.counts[s] > 0:
                raise DatasetError(f"{self.storage.url_of(INDEX)} has no rows for shard {name}")
        return out


def _read_manifest(storage: Storage, split: str) -> dict[str, Any]:
    try:
        manifest = json.loads(storage.read_bytes(MANIFEST))
    except FileNotFoundError as exc:
        raise DatasetError(
            f"no {MANIFEST} at {storage.url_of(MANIFEST)}: is this a dataset written by "
            "`vitscale shards write`?"
        ) from exc
    except (OSError, ValueError) as exc:
        raise DatasetError(f"cannot read {storage.url_of(MANIFEST)}: {exc}") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("splits"), dict):
        raise DatasetError(f"{storage.url_of(MANIFEST)} has no 'splits' mapping")
    if split not in manifest["splits"]:
        raise DatasetError(
            f"split {split!r} not in {storage.url_of(MANIFEST)}; it has {sorted(manifest['splits'])}"
        )
    return manifest


def _local_index_path(storage: Storage) -> str:
    """A local file path for the index: the file itself, or a temp copy of a remote one."""
    if isinstance(storage, LocalStorage):
        path = storage.url_of(INDEX)
        if not os.path.isfile(path):
            raise DatasetError(f"no index at {path}: rewrite the dataset with `vitscale shards write`")
        return path
    fd, path = tempfile.mkstemp(prefix="vitscale-index-", suffix=".parquet")
    atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    try:
        with os.fdopen(fd, "wb") as dst, storage.open_read(INDEX) as src:
            while chunk := src.read(8 << 20):  # streamed: a JFT-sized index never sits in memory
                dst.write(chunk)
    except FileNotFoundError as exc:
        raise DatasetError(f"no index at {storage.url_of(INDEX)}") from exc
    return path


def _index_counts(path: str, split: str, url: str) -> Counter[str]:
    """Rows per shard of ``split``, streamed in record batches (memory stays flat)."""
    try:
        pf = pq.ParquetFile(path)
        missing = set(_INDEX_COLUMNS) - set(pf.schema_arrow.names)
        if missing:
            raise DatasetError(f"{url} lacks columns {sorted(missing)}")
        counts: Counter[str] = Counter()
        for batch in pf.iter_batches(columns=["split", "shard"], batch_size=1 << 20):
            shards = batch.column(1).filter(pc.equal(batch.column(0), split))
            vc = pc.value_counts(shards)
            counts.update(dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist())))
        return counts
    except (OSError, pa.ArrowInvalid) as exc:
        raise DatasetError(f"cannot read {url}: {exc}") from exc


def open_dataset(url: str, split: str, *, endpoint_url: str | None = None) -> OpenDataset:
    """Open and validate ``split`` of the dataset at ``url`` (folder or ``s3://bucket/prefix``).

    Checks, failing with :class:`DatasetError` before any training: ``dataset.json`` is readable and
    lists the split; every listed shard exists; ``_index.parquet`` has the contract's columns and,
    per shard, exactly as many rows as the manifest's sample count.
    """
    storage = open_storage(url, endpoint_url=endpoint_url)
    manifest = _read_manifest(storage, split)
    try:
        shards = manifest["splits"][split]["shards"]
        names = tuple(str(s["name"]) for s in shards)
        counts = tuple(int(s["samples"]) for s in shards)
        num_classes = int(manifest["num_classes"])
        classes = tuple(str(c) for c in manifest.get("classes", ()))
        multi_label = bool(manifest.get("multi_label", False))
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError(f"{storage.url_of(MANIFEST)} is malformed: {exc!r}") from exc
    if num_classes < 1:
        raise DatasetError(f"{storage.url_of(MANIFEST)}: num_classes must be >= 1")
    present = set(storage.list())
    missing = [n for n in names if n not in present]
    if missing:
        raise DatasetError(
            f"{len(missing)} shard(s) of split {split!r} missing under {storage.url}: "
            f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}"
        )
    if INDEX not in present:
        raise DatasetError(f"no index at {storage.url_of(INDEX)}")
    index_path = _local_index_path(storage)
    rows = _index_counts(index_path, split, storage.url_of(INDEX))
    bad = [(n, rows.get(n, 0), c) for n, c in zip(names, counts) if rows.get(n, 0) != c]
    extra = sorted(set(rows) - set(names))
    if bad or extra:
        detail = "; ".join(f"{n}: index {r} vs manifest {c}" for n, r, c in bad[:10])
        if extra:
            detail += f"; index rows for shards not in the manifest: {', '.join(extra[:10])}"
        raise DatasetError(
            f"{storage.url_of(INDEX)} disagrees with {storage.url_of(MANIFEST)} for split "
            f"{split!r} ({detail}): the dataset is damaged or half-written; rewrite it"
        )
    return OpenDataset(
        storage=storage,
        split=split,
        name=str(manifest.get("name", "")),
        classes=classes,
        num_classes=num_classes,
        multi_label=multi_label,
        shard_names=names,
        counts=counts,
        index_path=index_path,
    )


class _SampleReader:
    """Ranged reads of sample records: pread on cached file descriptors locally, concurrent
    coalesced GETs on object storage."""

    def __init__(self, storage: Storage, max_gap: int = 256 << 10, threads: int = 16) -> None:
        self.storage = storage
        self.local = isinstance(storage, LocalStorage)
        self.max_gap = max_gap
        self.threads = threads
        self._fds: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            if len(self._fds) >= 64:  # bound open files: a window touches only a few shards
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = os.open(self.storage.url_of(name), os.O_RDONLY)
            self._fds[name] = fd
        return fd

    def close(self) -> None:
        """Close cached file descriptors and the request thread pool."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def read(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        """Bytes of each (shard name, offset, size); shorter than size where the shard ends early."""
        if self.local:
            return [os.pread(self._fd(n), size, off) for n, off, size in requests]
        # Coalesce requests into runs per shard whose gaps are small: one GET per run.
        order = sorted(range(len(requests)), key=lambda i: (requests[i][0], requests[i][1]))
        runs: list[tuple[str, int, int, list[int]]] = []
        for i in order:
            name, off, size = requests[i]
            if runs and runs[-1][0] == name and off - runs[-1][2] <= self.max_gap:
                r = runs[-1]
                runs[-1] = (name, r[1], max(r[2], off + size), r[3] + [i])
            else:
                runs.append((name, off, off + size, [i]))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads)
        blobs = self._pool.map(lambda r: self.storage.read_range(r[0], r[1], r[2] - r[1]), runs)
        out: list[bytes] = [b""] * len(requests)
        for (_, start, _, members), blob in zip(runs, blobs):
            for i in members:
                off = requests[i][1] - start
                out[i] = blob[off : off + requests[i][2]]
        return out


@dataclass(frozen=True)
class StreamSpec:
    """Everything that decides a stream's content (see :class:`ShardStream`)."""

    url: str
    """Dataset folder or ``s3://bucket/prefix``."""
    split: str = "train"
    rank: int = 0
    """This process's rank among ``world_size`` data-parallel ranks."""
    world_size: int = 1
    seed: int = 0
    """Seeds shard order, sample shuffle and augmentation (with the epoch)."""
    batch_size: int = 64
    """Per-rank batch size."""
    train: bool = True
    """Shuffled order + random augmentation; False: manifest order + centre crop."""
    num_workers: int = 0
    """DataLoader worker processes decoding for this rank (0: decode in this process)."""
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER
    """Window of the in-span sample shuffle (samples)."""
    error_budget: float = 0.001
    """Skipped samples allowed per epoch: a fraction of the rank's epoch if < 1, else a count."""
    endpoint_url: str | None = None
    """S3-protocol endpoint (MinIO, moto, Ceph); None: environment, then AWS."""
    drop_last: bool = True
    """Drop the epoch's last partial batch (training) or keep it (evaluation)."""
    transform: TransformSpec = field(default_factory=TransformSpec)
    """Crop/flip/resolution of each image."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead."""
    pin_memory: bool = False
    """Page-lock batches for faster, asynchronous host-to-GPU copies."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={self.rank}, world_size={self.world_size}"
            )
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers}")
        b = self.error_budget
        if b < 0 or (b >= 1 and b != int(b)):
            raise ValueError(
                f"error_budget is a fraction in [0, 1) or a whole count >= 1, got {self.error_budget}"
            )
        if self.seed < 0 or self.shuffle_buffer < 1 or self.prefetch_factor < 1:
            raise ValueError("seed must be >= 0, shuffle_buffer and prefetch_factor >= 1")


class _EpochBatches(IterableDataset):
    """One epoch of one rank from ``plan.start``: worker ``w`` builds batches ``b % W == w``."""

    def __init__(
        self, spec: StreamSpec, ds: OpenDataset, p: RankPlan, index: dict[int, ShardIndex], end: int
    ) -> None:
        self.spec, self.ds, self.plan, self.index, self.end = spec, ds, p, index, end
        self.batches = -(-(end - p.start) // spec.batch_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        bs, start = self.spec.batch_size, self.plan.start
        reader = _SampleReader(self.ds.storage)
        try:
            for b in worker_batches(self.batches, worker, workers):
                lo = start + b * bs
                yield self._build(reader, lo, min(lo + bs, self.end), shared=info is not None)
        finally:
            reader.close()

    def _build(self, reader: _SampleReader, lo: int, hi: int, shared: bool) -> dict[str, Any]:
        spec, ds, tspec = self.spec, self.ds, self.spec.transform
        g = self.plan.global_indices(lo, hi)  # (n,) global sample indices, in emit order
        shard, local = self.plan.locate(g)
        n, r = len(g), tspec.resolution
        entries = [self.index[int(s)] for s in shard]
        requests = [
            (ds.shard_names[int(s)], int(e.offsets[i]), int(e.sizes[i]))
            for s, e, i in zip(shard, entries, local)
        ]
        keys = [e.key(int(i)) for e, i in zip(entries, local)]
        raws = reader.read(requests)
        # (n, 3, R, R) uint8 filled in place; in shared memory when a worker process sends it.
        images = torch.empty((n, 3, r, r), dtype=torch.uint8)
        if shared:
            images.share_memory_()
        pixels = images.numpy()
        labels: list[list[int]] = [[] for _ in range(n)]
        valid = np.zeros(n, dtype=bool)
        skipped: list[tuple[str, str, str]] = []
        for i in range(n):
            try:
                members = split_tar_record(raws[i], keys[i], requests[i][2])
                labels[i] = parse_label(members, ds.num_classes, ds.multi_label)
                data = members.get("jpg", members.get("jpeg"))
                if data is None:
                    raise BadSample(f"no .jpg member among {sorted(members)}")
                rng = sample_rng(self.plan.seed, self.plan.epoch, int(g[i])) if tspec.train else None
                decode_image_into(data, pixels[i], tspec, rng)
                valid[i] = True
            except BadSample as exc:
                skipped.append((requests[i][0], keys[i], str(exc)))
        if not valid.all():
            survivors = np.flatnonzero(valid)
            for j, i in enumerate(np.flatnonzero(~valid)):
                if survivors.size:  # keep the batch shape: refill with a surviving sample
                    src = int(survivors[j % survivors.size])
                    pixels[i], labels[i], keys[i] = pixels[src], labels[src], keys[src]
                else:
                    pixels[i], labels[i] = 0, []
        if ds.multi_label:
            label = torch.zeros((n, ds.num_classes), dtype=torch.float32)  # (n, K) multi-hot
            for i, ls in enumerate(labels):
                label[i, ls] = 1.0
        else:
            label = torch.tensor([ls[0] if ls else 0 for ls in labels], dtype=torch.int64)  # (n,)
        return {
            "image": images,
            "label": label,
            "key": keys,
            "valid": torch.from_numpy(valid),
            "_skipped": skipped,
            "_count": hi - lo,
        }


class ShardStream:
    """This rank's batches of a sharded dataset; see the module docstring for the guarantees.

    Batches are dicts: ``image`` uint8 (B, 3, R, R) contiguous (normalise on the device with
    :func:`vitscale.data.transforms.normalize_on_device`), ``label`` int64 (B,) or, for multi-label
    datasets, float32 multi-hot (B, K), ``key`` list[str], ``valid`` bool (B,) (False only for rows
    refilled after a skipped sample). ``train=False`` gives the centre-crop evaluation transform,
    no shuffling, and keeps the last partial batch (``drop_last`` defaults to ``train``).
    """

    def __init__(
        self,
        url: str,
        split: str = "train",
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        batch_size: int = 64,
        resolution: int = 224,
        train: bool = True,
        num_workers: int = 0,
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
        error_budget: float = 0.001,
        endpoint_url: str | None = None,
        drop_last: bool | None = None,
        transform: TransformSpec | None = None,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
    ) -> None:
        if transform is None:
            transform = TransformSpec(resolution=resolution, train=train)
        elif transform.resolution != resolution or transform.train != train:
            raise ValueError("transform.resolution/train must match resolution/train")
        self.spec = StreamSpec(
            url=url, split=split, rank=rank, world_size=world_size, seed=seed,
            batch_size=batch_size, train=train, num_workers=num_workers,
            shuffle_buffer=shuffle_buffer, error_budget=error_budget, endpoint_url=endpoint_url,
            drop_last=train if drop_last is None else drop_last, transform=transform,
            prefetch_factor=prefetch_factor, pin_memory=pin_memory,
        )  # fmt: skip
        self.dataset = open_dataset(url, split, endpoint_url=endpoint_url)
        self.samples_per_epoch = sum(self.dataset.counts) // world_size
        """Samples per rank per epoch (before dropping a partial last batch)."""
        self.batches_per_epoch = num_batches(self.samples_per_epoch, batch_size, self.spec.drop_last)
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"split {split!r} has {sum(self.dataset.counts)} samples: {self.samples_per_epoch} "
                f"per rank over {world_size} ranks, not one batch of {batch_size}; use a smaller "
                "batch_size or world_size"
            )
        self.epoch = 0
        self.position = 0
        self.seed = seed
        self._skipped: Counter[str] = Counter()
        self._epoch_skipped: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._generation = 0  # bumped by set_epoch/load_state_dict: stale iterators stop

    @property
    def _end(self) -> int:
        """Position after the epoch's last emitted sample (a partial batch dropped or not)."""
        return min(self.batches_per_epoch * self.spec.batch_size, self.samples_per_epoch)

    def __len__(self) -> int:
        """Batches left in the current epoch."""
        return -(-(self._end - self.position) // self.spec.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first sample on the next iteration."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch, self.position = int(epoch), 0
        self._epoch_skipped.clear()
        self._generation += 1

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed"}``: where the next batch starts."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state`` (from :meth:`state_dict`); its seed replaces the constructor's."""
        try:
            epoch, position, seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"stream state needs int 'epoch', 'position', 'seed'; got {state!r}"
            ) from exc
        if epoch < 0 or seed < 0 or not 0 <= position <= self._end:
            raise ValueError(f"stream state out of range for this dataset/world size: {state!r}")
        if position == self._end:
            epoch, position = epoch + 1, 0
        self.epoch, self.position, self.seed = epoch, position, seed
        self._epoch_skipped.clear()
        self._generation += 1

    def skipped(self) -> dict[str, int]:
        """Samples skipped so far (all epochs of this stream object), per shard name."""
        return dict(self._skipped)

    def epoch_plan(self) -> RankPlan:
        """The plan of the current epoch from the current position."""
        s = self.spec
        return plan(self.dataset.counts, self.seed, self.epoch, s.rank, s.world_size,
                    self.position, s.shuffle_buffer, shuffle=s.train)  # fmt: skip

    def _budget(self) -> float:
        b = self.spec.error_budget
        return b * self.samples_per_epoch if b < 1 else b

    def _account(self, skipped: list[tuple[str, str, str]]) -> None:
        for shard, key, why in skipped:
            self._skipped[shard] += 1
            self._epoch_skipped[shard] += 1
            if (shard, key) not in self._logged:
                self._logged.add((shard, key))
                log.warning("skipped sample %s in %s: %s", key, self.dataset.storage.url_of(shard), why)
        total = sum(self._epoch_skipped.values())
        if skipped and total > self._budget():
            worst = ", ".join(f"{s} ({c})" for s, c in self._epoch_skipped.most_common(20))
            raise ErrorBudgetExceeded(
                f"{total} samples skipped in epoch {self.epoch} on rank {self.spec.rank}, over the "
                f"error budget {self.spec.error_budget} ({self._budget():.0f} samples); bad shards: "
                f"{worst}. Repair or rewrite them, or raise error_budget."
            )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        s, gen = self.spec, self._generation
        p = self.epoch_plan()
        index = self.dataset.load_index(r.shard for r in p.ranges)
        source = _EpochBatches(s, self.dataset, p, index, self._end)
        loader = DataLoader(
            source,
            batch_size=None,  # batches are built whole inside the workers
            num_workers=s.num_workers,
            prefetch_factor=s.prefetch_factor if s.num_workers else None,
            pin_memory=s.pin_memory,
        )
        for batch in loader:
            if gen != self._generation:
                return  # set_epoch/load_state_dict was called: this iterator is stale
            self._account(batch.pop("_skipped"))
            self.position += batch.pop("_count")
            if self.position >= self._end:  # last batch: a checkpoint now resumes next epoch
                self.epoch, self.position = self.epoch + 1, 0
                self._epoch_skipped.clear()
                self._generation += 1
            yield batch
