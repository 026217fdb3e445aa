"""A rank's start-up cost against the dataset's size: open the dataset, order, index rows of a batch.

Builds metadata-only datasets in vitscale's format: ``dataset.json`` (vitscale's ``DatasetMeta``),
``_index.parquet`` with plausible per-sample rows (a 16-character key, one label of 21,843 classes,
offset, size, width, height, crc32) and the shards as sparse files of the right size (what
``open_dataset`` checks; no image bytes, no disk), then measures, each in a fresh subprocess
(time after imports, and the child's peak RSS from ``wait4``):

- ``start``: a rank's start, as a run's rank does it: ``ShardStream(...)`` (opens and checks the
  dataset) and its first batch from ``epoch_batches()`` (its order, the index rows of the batch's
  shards, the batch's ranged reads: zeros from the sparse shards, each sample then skipped as a
  checksum mismatch, a few milliseconds);
- ``resume``: the same after ``load_state_dict`` half-way through the epoch (a mid-epoch resume).

Index layouts (``--layouts``), measured side by side in the same run:

- ``per-shard``: one row group per shard, written by :class:`vitscale.data.format.IndexWriter`
  (what ``vitscale shards write/index``, ``DatasetWriter`` and ``shards reindex`` write);
- ``legacy``: the layout written before it (row groups of 2^20 rows across shards, what
  ``pq.write_table`` of the whole index gives), still read, eagerly.

The default sizes, ``1420000:1420,14200000:1420,14200000:14200`` (samples:shards, world size 8),
grow the samples 10x at a fixed shard count, then the shards 10x at a fixed sample count: a
cost that is O(samples) shows a ratio ~10 in the first step, an O(shards) one ~1 in the first and
~10 in the second. The ratios are of the work after imports (seconds) and of the RSS above the
imports' own (printed first: Python, torch, pyarrow, pandas).

    python benchmarks/startup.py                                    # ~2 min on 2 cores
    python benchmarks/startup.py --sizes 303000000:30000 --world-size 2048 --layouts per-shard \
        --workdir /var/tmp/vitscale-startup --keep                  # JFT-300M: 5.6 GB index, ~3 min to build

Built datasets are cached under ``--workdir`` (``--keep`` leaves them for the next run). The
303M-sample case needs 5.6 GB of disk for its index in the per-shard layout (8.5 GB in the legacy
one); where that does not fit, measure the largest that does: the per-shard layout's start-up
grows with the shards, not the samples, so the 30k-shard rows of a smaller sample count (e.g.
``30300000:30000``) stand for it (measured: 1.0 s and 697 MB there, 1.0 s and 699 MB at 303M).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vitscale.data.format import INDEX_NAME, INDEX_SCHEMA, META_NAME, DatasetMeta, ShardMeta, SplitMeta, shard_name

SPLIT = "train"
CLASSES = 21843
LEGACY_ROW_GROUP = 1 << 20  # pyarrow's default row group length: what `pq.write_table(whole index)` gave
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


# ----------------------------------------------------------------------------- building the metadata


def shard_counts(samples: int, shards: int) -> np.ndarray:
    """Samples per shard: as even as the division allows."""
    counts = np.full(shards, samples // shards, dtype=np.int64)
    counts[: samples % shards] += 1
    return counts


def _hex(values: np.ndarray, digits: int) -> np.ndarray:
    """(n, digits) uint8 ASCII hex of ``values`` (uint64)."""
    shifts = np.arange(digits - 1, -1, -1, dtype=np.uint64) * np.uint64(4)
    return _HEX[((values[:, None] >> shifts) & np.uint64(0xF)).astype(np.intp)]


def shard_rows(base: int, n: int, rng: np.random.Generator) -> tuple[dict[str, Any], int]:
    """One shard's index columns (vitscale's schema minus split/shard) and its byte length.

    Keys: the global index and 8 random characters, 16 hex characters (unique by construction);
    record sizes: JPEG-sized (lognormal around 110 kB) plus two 512-byte tar headers, padded.
    """
    serial = _hex(np.arange(base, base + n, dtype=np.uint64), 8)
    noise = _hex(rng.integers(0, 1 << 32, n, dtype=np.uint64), 8)
    chars = np.concatenate([serial, noise], axis=1)
    keys = pa.StringArray.from_buffers(n, pa.py_buffer(np.arange(n + 1, dtype=np.int32) * 16),
                                       pa.py_buffer(chars.tobytes()))
    jpeg = np.exp(rng.normal(np.log(110_000), 0.5, n)).astype(np.int64)
    sizes = 1024 + (jpeg + 511) // 512 * 512 + 512
    ends = np.cumsum(sizes)
    labels = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)),
                                      pa.array(rng.integers(0, CLASSES, n, dtype=np.int32)))
    cols = {
        "key": keys, "labels": labels, "offset": ends - sizes, "size": sizes,
        "width": rng.integers(200, 500, n, dtype=np.int32), "height": rng.integers(200, 500, n, dtype=np.int32),
        "crc32": rng.integers(0, 1 << 32, n, dtype=np.int64),
    }
    return cols, int(ends[-1]) + 1024  # + the tar's end-of-archive blocks


def _table(split: str, shard: str, cols: dict[str, Any]) -> pa.Table:
    n = len(cols["key"])
    fixed = {"split": pa.array([split] * n, pa.string()), "shard": pa.array([shard] * n, pa.string())}
    return pa.table({**fixed, **cols}, schema=INDEX_SCHEMA)


def build(root: Path, samples: int, shards: int, layout: str, seed: int = 0) -> dict[str, Any]:
    """Write a metadata-only dataset at ``root`` (cached: a finished one is reused)."""
    stamp = root / "build.json"
    params = {"samples": samples, "shards": shards, "layout": layout, "seed": seed, "version": 2}
    if stamp.exists() and json.loads(stamp.read_text()).get("params") == params:
        return dict(json.loads(stamp.read_text()))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    counts = shard_counts(samples, shards)
    metas: list[ShardMeta] = []
    index = root / INDEX_NAME
    if layout == "per-shard":
        from vitscale.data.format import IndexWriter

        writer: Any = IndexWriter(str(index))
    else:
        writer = pq.ParquetWriter(str(index), INDEX_SCHEMA)
    pending: list[pa.Table] = []
    pending_rows = 0
    base = 0
    for s, n in enumerate(counts.tolist()):
        name = shard_name(SPLIT, s)
        cols, nbytes = shard_rows(base, n, rng)
        base += n
        if layout == "per-shard":
            writer.write_shard(SPLIT, name, cols)
        else:  # one row group per 2^20 rows, whatever the shards
            pending.append(_table(SPLIT, name, cols))
            pending_rows += n
            while pending_rows >= LEGACY_ROW_GROUP:
                whole = pa.concat_tables(pending)
                writer.write_table(whole.slice(0, LEGACY_ROW_GROUP), row_group_size=LEGACY_ROW_GROUP)
                rest = whole.slice(LEGACY_ROW_GROUP)
                pending, pending_rows = [rest], rest.num_rows
        metas.append(ShardMeta(name, n, rng.bytes(32).hex(), nbytes))
        with open(root / name, "wb") as f:  # sparse: the size open_dataset checks, no blocks
            f.truncate(nbytes)
    if layout != "per-shard" and pending_rows:
        writer.write_table(pa.concat_tables(pending), row_group_size=LEGACY_ROW_GROUP)
    writer.close()
    meta = DatasetMeta(name=f"startup-{samples}", num_classes=CLASSES, multi_label=False,
                       splits={SPLIT: SplitMeta(samples, tuple(metas))},
                       classes=tuple(f"class{c:05d}" for c in range(CLASSES)), max_side=384, quality=90,
                       extra={"source": "benchmarks/startup.py", "format": 1})
    (root / META_NAME).write_text(json.dumps(meta.to_json(), indent=2) + "\n")
    info = {"params": params, "build_s": time.perf_counter() - t0, "index_bytes": index.stat().st_size,
            "meta_bytes": (root / META_NAME).stat().st_size}
    stamp.write_text(json.dumps(info))
    return info


# ----------------------------------------------------------------------------- one rank, in a child process


def child(args: argparse.Namespace) -> None:
    """Run one case in this (fresh) process and print its figures as one JSON line."""
    import resource

    import pandas  # noqa: F401 -- pyarrow imports it on a table's first use; a training process has it already

    from vitscale.data.loader.stream import ShardStream

    floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    layout = {"global_batch": args.global_batch} if args.global_batch else {}  # training's layout
    stream = ShardStream(args.data, SPLIT, rank=args.rank, world_size=args.world_size, seed=0,
                         batch_size=args.batch_size, resolution=32, **layout) if args.case != "imports" else None
    count = 0
    if stream is not None:
        if args.case == "resume":
            half = stream.samples_per_epoch // 2 // args.batch_size * args.batch_size
            stream.load_state_dict({"epoch": 3, "position": half, "seed": 0})
        # The first batch, built as training builds it (order, index rows, ranged reads); its samples
        # are zeros here (sparse shards), so each is a checksum mismatch, skipped and refilled.
        batch = next(iter(stream.epoch_batches()))
        count = int(batch["_count"])
    work = time.perf_counter() - t0
    print(json.dumps({"work_s": work, "imports_rss": floor, "samples": count}))


def _popen_wait4(cmd: list[str]) -> tuple[int, str, str, int, float]:
    """Run ``cmd``; (returncode, stdout, stderr, peak RSS bytes of that child alone, wall seconds)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (RUSAGE_CHILDREN is a max over all)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out_f.seek(0)
        err_f.seek(0)
        return proc.returncode, out_f.read().decode(), err_f.read().decode(), int(usage.ru_maxrss) * 1024, wall


def measure(script: Path, data: Path, case: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, str(script), "--child", case, "--data", str(data), "--world-size", str(args.world_size),
           "--rank", str(args.world_size // 2), "--batch-size", str(args.batch_size)]
    if args.global_batch:
        cmd += ["--global-batch", str(args.global_batch)]
    rc, out, err, rss, wall = _popen_wait4(cmd)
    if rc != 0:
        raise SystemExit(f"{case} on {data} failed (exit {rc}):\n{err[-3000:]}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result.update(wall_s=wall, rss=rss)
    return result


# ----------------------------------------------------------------------------- the table


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1420000:1420,14200000:1420,14200000:14200",
                        help="samples:shards, comma-separated, measured in this order")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=256, help="per-rank batch")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="training's global-batch layout (world size x batch, or a multiple); default: rank spans")
    parser.add_argument("--layouts", default="per-shard,legacy")
    parser.add_argument("--workdir", default=None, help="where the datasets are built (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="leave the built datasets in --workdir")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(argparse.Namespace(case=args.child, data=args.data, rank=args.rank, world_size=args.world_size,
                                 batch_size=args.batch_size, global_batch=args.global_batch))
        return
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes.split(",")]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vitscale-startup-"))
    script = Path(__file__).resolve()
    try:
        floor = measure(script, work, "imports", args)
        print(f"world size {args.world_size}, rank {args.world_size // 2}, batch {args.batch_size}, "
              f"{f'global batch {args.global_batch}' if args.global_batch else 'rank spans'}; "
              f"imports alone: {_mb(floor['rss'])} MB RSS, {floor['wall_s']:.1f} s wall\n")
        print("| layout | samples | shards | index MB | B/sample | build s | case | work s | wall s | RSS MB "
              "| RSS over imports MB |")
        print("|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
        results: dict[tuple[str, int, int, str], dict[str, Any]] = {}
        for layout in layouts:
            for samples, shards in sizes:
                root = work / f"{layout}-{samples}-{shards}"
                info = build(root, samples, shards, layout)
                for case in ("start", "resume"):
                    r = measure(script, root, case, args)
                    r["over"] = max(r["rss"] - floor["rss"], 0)
                    results[(layout, samples, shards, case)] = r
                    print(f"| {layout} | {samples:,} | {shards:,} | {_mb(info['index_bytes'])} | "
                          f"{info['index_bytes'] / samples:.1f} | {info['build_s']:.0f} | {case} | {r['work_s']:.2f} | "
                          f"{r['wall_s']:.2f} | {_mb(r['rss'])} | {_mb(r['over'])} |", flush=True)
        if len(sizes) > 1:
            print("\nGrowth between consecutive sizes (O(samples) follows the sample ratio, O(shards) the shard "
                  "ratio):\n")
            print("| layout | case | from | to | sample ratio | shard ratio | work ratio | RSS-over-imports ratio |")
            print("|---|---|---|---|---:|---:|---:|---:|")
            for layout in layouts:
                for case in ("start", "resume"):
                    for (s0, h0), (s1, h1) in itertools.pairwise(sizes):
                        a, b = results[(layout, s0, h0, case)], results[(layout, s1, h1, case)]
                        print(f"| {layout} | {case} | {s0:,}/{h0:,} | {s1:,}/{h1:,} | {s1 / s0:.1f} | {h1 / h0:.1f} | "
                              f"{b['work_s'] / a['work_s']:.2f} | {b['over'] / max(a['over'], 1):.2f} |")
        if len(layouts) > 1:
            print(f"\nEach layout against {layouts[-1]} (same size, same case):\n")
            print("| layout | samples | shards | case | work ratio | RSS-over-imports ratio |")
            print("|---|---:|---:|---|---:|---:|")
            for layout in layouts[:-1]:
                for samples, shards in sizes:
                    for case in ("start", "resume"):
                        a, b = results[(layout, samples, shards, case)], results[(layouts[-1], samples, shards, case)]
                        print(f"| {layout} | {samples:,} | {shards:,} | {case} | {a['work_s'] / b['work_s']:.3f} | "
                              f"{a['over'] / max(b['over'], 1):.3f} |")
        big = max(sizes)
        if big[0] < 303_000_000 and "per-shard" in layouts:
            r = results[("per-shard", *big, "start")]
            print(f"\nJFT-300M (303M samples, 30k shards, world 2048) was not built here; its start-up grows with "
                  f"the shards: measure it with --sizes 303000000:30000 --world-size 2048 --layouts per-shard "
                  f"(largest here: {big[0]:,} samples / {big[1]:,} shards, start {r['work_s']:.2f} s, "
                  f"{_mb(r['rss'])} MB RSS).")
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        elif not args.keep:
            for layout in layouts:
                for samples, shards in sizes:
                    shutil.rmtree(work / f"{layout}-{samples}-{shards}", ignore_errors=True)


if __name__ == "__main__":
    main()
