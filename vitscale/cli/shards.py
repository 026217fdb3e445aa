"""`vitscale shards ...`: write, adopt, inspect, verify, order, benchmark and de-duplicate shards."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from vitscale.cli.interrupt import writes
from vitscale.cli.parser import VerbFn, add_endpoint_url, naming_flags, print_json
from vitscale.config.errors import UserError


def add_verbs(verbs: Any, verb: VerbFn) -> None:
    """This module's verbs under the CLI's: each one's arguments are set by the function above its command."""
    group = verbs.add_parser("shards", help="Write, inspect, verify, order, benchmark and de-duplicate shards.")
    into = group.add_subparsers(dest="shards_verb", required=True, metavar="VERB")
    _shards_write_args(verb(
        "write", cmd_shards_write,
        "Write WebDataset shards from a source.", into))
    _shards_index_args(verb(
        "index", cmd_shards_index,
        "Adopt existing WebDataset tars in place: build _index.parquet and dataset.json for "
        "them without rewriting them.", into))
    _shards_stats_args(verb(
        "stats", cmd_shards_stats,
        "Shards, samples and classes of a dataset.", into))
    _shards_verify_args(verb(
        "verify", cmd_shards_verify,
        "Re-hash every shard and check counts; non-zero exit if bad.", into))
    _shards_reindex_args(verb(
        "reindex", cmd_shards_reindex,
        "Rewrite an older dataset's _index.parquet with one row group per shard, so a rank's "
        "start-up reads only its shards' rows.", into))
    _shards_order_args(verb(
        "order", cmd_shards_order,
        "Keys one rank reads in one epoch, in training's order.", into))
    _shards_bench_args(verb(
        "bench", cmd_shards_bench,
        "Run the training loader alone and report images/s.", into))
    _shards_dedup_args(verb(
        "dedup", cmd_shards_dedup,
        "Drop near-duplicates of test-set images from a training set.", into))


def _shards_write_args(p: argparse.ArgumentParser) -> None:
    from vitscale.data.tools.sources import (
        source_specs,  # the source registry names them all
    )
    p.add_argument("--source", required=True, help=" | ".join(source_specs()) + " (a *:DIR transfer dataset's "
                   "distributed files are written with its own splits)")
    p.add_argument("--out", required=True, help="local folder or s3://bucket/prefix")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per tar shard")
    p.add_argument("--max-side", type=int, default=384,
                   help="images are shrunk (never enlarged) to fit this many pixels on their long side")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality, 1-95 (Pillow's libjpeg, baseline)")
    p.add_argument("--chroma", choices=("4:2:0", "4:2:2", "4:4:4"), default="4:2:0",
                   help="JPEG chroma subsampling: 4:2:0 halves colour resolution (fine for photos); "
                        "4:4:4 keeps it, for small images such as CIFAR's 32x32")
    p.add_argument("--seed", type=int, default=0, help="seeds the shuffle, the split and generated sources")
    p.add_argument("--split", default=None, help="named fractions, e.g. train=0.9,minival=0.05,test=0.05 "
                   "(default: train=1.0, or the source's own splits)")
    p.add_argument("--name", default=None, help="dataset name (default: from the source)")
    p.add_argument("--count", type=int, default=None, help="synthetic/fractal: number of images (default: 1000)")
    p.add_argument("--classes", type=int, default=None, help="synthetic/fractal: number of classes (default: 10)")
    p.add_argument("--image-size", type=int, default=None,
                   help="synthetic/fractal/digits: image side in pixels (default: 64; synthetic: random, 256-512)")
    p.add_argument("--multi-label", action="store_true", help="synthetic: JFT-style multi-label samples")
    p.add_argument("--max-bad", type=int, default=100,
                   help="unreadable source files skipped and listed before the write stops (default 100)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="larger source images are skipped as decompression bombs (default 89478485, PIL's)")
    add_endpoint_url(p)


@writes
def cmd_shards_write(args: argparse.Namespace) -> int:
    from vitscale.data.storage.outputs import check_output
    from vitscale.data.tools.write import parse_splits, write_dataset

    # A malformed destination, a file, a bucket that does not answer: refused naming the flag, before the work.
    args.out = check_output(args.out, "--out", folder=True, endpoint_url=args.endpoint_url)
    options = {k: v for k, v in (("count", args.count), ("classes", args.classes),
                                 ("image_size", args.image_size)) if v is not None}
    if args.multi_label:
        options["multi_label"] = True
    kind = args.source.partition(":")[0]  # a source's options are checked as `synthetic.count` and the like
    flags = {**{k: "--" + k.replace("_", "-") for k in ("shard_size", "max_side", "quality", "seed", "max_bad",
                                                          "max_pixels")},
             **{f"{kind}.{k}": "--" + k.replace("_", "-") for k in ("count", "classes", "image_size")}}
    try:
        with naming_flags(flags):
            meta = write_dataset(args.source, args.out, shard_size=args.shard_size, max_side=args.max_side,
                                 quality=args.quality, seed=args.seed,
                                 splits=parse_splits(args.split) if args.split else None, source_options=options,
                                 name=args.name, endpoint_url=args.endpoint_url, max_bad=args.max_bad,
                                 max_pixels=args.max_pixels, chroma=args.chroma)
    except OSError as exc:  # storage trouble (disk full, permissions, S3 after retries): one line
        raise UserError(f"shards write to {args.out}: {type(exc).__name__}: {exc}") from exc
    counts = {s: v["samples"] for s, v in meta["splits"].items()}
    bad = meta.get("bad_files", [])
    print(json.dumps({"out": args.out, "classes": meta["num_classes"], "samples": counts, "bad": len(bad),
                      "bad_files": [f"{b['file']}: {b['error']}" for b in bad]}))
    return 0


def _shards_index_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="folder or s3:// prefix of .tar shards, one tar, or braces: train-{000000..000999}.tar")
    p.add_argument("--out", default=None, help="where the index and dataset.json go (default: beside the tars)")
    p.add_argument("--split", default=None,
                   help="put every tar into this split (default: the split each tar's name says: a split word "
                        "such as train, val, validation, test in it, e.g. imagenet1k-validation-00.tar, "
                        "test_000000.tar, or {split}-NNNNNN.tar; train when no name says one)")
    p.add_argument("--label-member", default=None,
                   help="cls (class id), txt (class name), json:KEY, or none (images alone, for masked patch "
                        "pre-training); default: cls, else json:labels when every .json holds {\"labels\": ...}, "
                        "else none (other .txt and .json members are read only when asked: captions, metadata)")
    p.add_argument("--classes", default=None, help="file of class names, one per line, in index order")
    p.add_argument("--no-checksums", action="store_true",
                   help="read headers only: no crc32 per sample (saves one read of every shard; reads go unchecked)")
    p.add_argument("--num-classes", type=int, default=None,
                   help="class count: ids outside [0, N) make their sample bad (default: --classes' length, "
                        "else the largest id found + 1, at most 2^20)")
    p.add_argument("--max-bad", type=int, default=100,
                   help="samples without an image or a usable label listed and left out before the index "
                        "stops (default 100)")
    add_endpoint_url(p)


@writes
def cmd_shards_index(args: argparse.Namespace) -> int:
    from vitscale.data.storage.outputs import check_output
    from vitscale.data.tools.adopt import index_shards

    if args.out is not None:  # a malformed destination, a file: refused naming the flag, before the work
        args.out = check_output(args.out, "--out", folder=True, endpoint_url=args.endpoint_url)
    try:
        meta = index_shards(args.url, out=args.out, split=args.split, label_member=args.label_member,
                            classes_file=args.classes, endpoint_url=args.endpoint_url,
                            checksums=not args.no_checksums, num_classes=args.num_classes,
                            max_bad=args.max_bad)
    except OSError as exc:  # storage trouble: one line
        raise UserError(f"shards index {args.url}: {type(exc).__name__}: {exc}") from exc
    print(json.dumps({"out": args.out or args.url, "classes": meta["num_classes"],
                      "samples": {s: v["samples"] for s, v in meta["splits"].items()},
                      "bad": len(meta["bad_samples"])}))
    return 0


def _shards_stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dest", help="dataset folder or s3:// prefix")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON instead of a table")
    add_endpoint_url(p)


def cmd_shards_stats(args: argparse.Namespace) -> int:
    from vitscale.data.tools.verify import dataset_stats, format_stats

    stats = dataset_stats(args.dest, endpoint_url=args.endpoint_url)
    if args.json:
        print_json(stats)
    else:
        print(format_stats(stats))
    return 0


def _shards_verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dest", help="dataset folder or s3:// prefix")
    add_endpoint_url(p)


def cmd_shards_verify(args: argparse.Namespace) -> int:
    from vitscale.data.tools.verify import verify_dataset

    problems = verify_dataset(args.dest, endpoint_url=args.endpoint_url)
    for problem in problems:
        print(f"BAD {problem}", file=sys.stderr)
    if not problems:
        print(f"ok: {args.dest}")
    return 1 if problems else 0


def _shards_reindex_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dest", help="dataset folder or s3:// prefix")
    add_endpoint_url(p)


@writes
def cmd_shards_reindex(args: argparse.Namespace) -> int:
    from vitscale.data.format.index import reindex

    try:
        result = reindex(args.dest, endpoint_url=args.endpoint_url)
    except OSError as exc:  # storage trouble: one line
        raise UserError(f"shards reindex {args.dest}: {type(exc).__name__}: {exc}") from exc
    print(json.dumps(result))
    return 0


def _shards_order_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dest", nargs="?", default=None, help="dataset (default: the pipeline's data.url)")
    p.add_argument("--pipeline", default=None,
                   help="take data.url/split/seed/shuffle_buffer and cluster.num_workers from this pipeline")
    p.add_argument("--rank", type=int, required=True, help="the rank whose keys are listed, 0-based")
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: the pipeline's num_workers)")
    p.add_argument("--epoch", type=int, required=True, help="the epoch, 0-based (each epoch has its own order)")
    p.add_argument("--seed", type=int, default=None, help="data.seed (default: the pipeline's, else 0)")
    p.add_argument("--shuffle-buffer", type=int, default=None,
                   help="data.shuffle_buffer (default: the pipeline's, else training's default)")
    p.add_argument("--start", type=int, default=0, help="resume position within the rank's order")
    p.add_argument("--global-batch", type=int, default=None,
                   help="training's layout: each rank's share of every global batch (default: the pipeline's "
                        "train.global_batch when it pre-trains, else one contiguous span per rank)")
    p.add_argument("--split", default=None, help="default: the pipeline's data.split, else train")
    p.add_argument("--json", action="store_true", help="print the keys as one JSON list instead of a line each")
    add_endpoint_url(p)


def cmd_shards_order(args: argparse.Namespace) -> int:
    from vitscale.data.config import DataConfig
    from vitscale.data.order import rank_keys

    # Training's order: the pipeline's data section and world size, then the flags given here.
    data, world_size, global_batch = DataConfig(), None, None
    if args.pipeline:
        from vitscale.stages import load_pipeline
        from vitscale.stages.run import resolve_pipeline_path

        pipeline = load_pipeline(resolve_pipeline_path(args.pipeline))
        data, world_size = pipeline.section("data"), pipeline.cluster.max_workers
        global_batch = pipeline.section("train").global_batch if "pretrain" in pipeline.stages else None
    dest = args.dest or (data.url if args.pipeline else None)
    world_size = _given(args.world_size, world_size)
    if dest is None or world_size is None:
        raise UserError("shards order needs DEST and --world-size, or --pipeline FILE")
    layout = _order_layout(args, world_size, _given(args.global_batch, global_batch))
    # What only the split's size can refuse, named where it was set: a flag, or the pipeline's key.
    batch_key = "--global-batch" if args.global_batch is not None else "train.global_batch"
    with naming_flags({"start": "--start", "global_batch": batch_key}):
        keys = rank_keys(dest, args.split or data.split, endpoint_url=args.endpoint_url or data.endpoint_url,
                         seed=_given(args.seed, data.seed),
                         shuffle_buffer=_given(args.shuffle_buffer, data.shuffle_buffer), **layout)
    if args.json:
        print(json.dumps(keys))
    else:
        print("\n".join(keys))
    return 0


def _given(flag: Any, default: Any) -> Any:
    """A flag's value where one was given (0 included), else the default."""
    return default if flag is None else flag


def _order_layout(args: argparse.Namespace, world_size: int, global_batch: int | None) -> dict[str, Any]:
    """`shards order`'s rank, world size, epoch, start and global batch, each checked naming its flag (the
    order's own functions check them too, for their callers, in their own words)."""
    from vitscale.config.checks import check, non_negative_int, positive_int, seed

    positive_int(world_size, "--world-size")
    check(isinstance(args.rank, int) and 0 <= args.rank < world_size, "--rank",
          f"must be in [0, {world_size}) for --world-size {world_size}, got {args.rank}")
    non_negative_int(args.epoch, "--epoch")
    non_negative_int(args.start, "--start")
    if args.seed is not None:
        seed(args.seed, "--seed")
    if args.shuffle_buffer is not None:
        positive_int(args.shuffle_buffer, "--shuffle-buffer")
    if global_batch is not None:
        check(global_batch >= world_size, "--global-batch",
              f"must be >= --world-size {world_size} (every rank takes a share of each batch), got {global_batch}")
    return {"rank": args.rank, "world_size": world_size, "epoch": args.epoch, "start": args.start,
            "global_batch": global_batch}


def _shards_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dest", help="dataset folder or s3:// prefix")
    p.add_argument("--resolution", type=int, default=224, help="training resolution of the decoded images")
    p.add_argument("--seconds", type=float, default=15.0, help="how long to read")
    p.add_argument("--workers", type=int, default=1, help="loader processes")
    p.add_argument("--batch-size", type=int, default=64, help="images per batch")
    p.add_argument("--split", default="train", help="split to read")
    p.add_argument("--json", action="store_true", help="print the measurement as JSON instead of one line")
    add_endpoint_url(p)


def cmd_shards_bench(args: argparse.Namespace) -> int:
    from vitscale.config.checks import check, positive_int
    from vitscale.data.config import MAX_LOADER_WORKERS
    from vitscale.data.loader.stream import StreamSpec
    from vitscale.data.tools.bench import run_bench

    positive_int(args.workers, "--workers")
    check(args.workers <= MAX_LOADER_WORKERS, "--workers", f"at most {MAX_LOADER_WORKERS}, got {args.workers}")
    # --workers 1 decodes in this process (the single-core rate); N > 1: N loader processes.
    with naming_flags({"resolution": "--resolution", "batch_size": "--batch-size", "seconds": "--seconds"}):
        spec = StreamSpec(url=args.dest, split=args.split, resolution=args.resolution, batch_size=args.batch_size,
                          train=True, num_workers=0 if args.workers == 1 else args.workers,
                          endpoint_url=args.endpoint_url,
                          error_budget=0.5)  # a benchmark reports bad data, it does not stop on it
        result = run_bench(spec, seconds=args.seconds)
    if args.json:
        print_json(result)
    else:
        print(f"{result['images_per_s']:.1f} images/s with {result['workers']} worker(s)")
    return 0


def _shards_dedup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train", required=True, help="the training dataset to clean (folder or s3:// prefix)")
    p.add_argument("--against", action="append", required=True,
                   help="a test dataset whose images must not reappear in training (repeatable)")
    p.add_argument("--out", required=True, help="where the cleaned training dataset is written")
    p.add_argument("--threshold", type=int, default=None, help="max Hamming distance of 64-bit pHashes (default: 10)")
    add_endpoint_url(p)


@writes
def cmd_shards_dedup(args: argparse.Namespace) -> int:
    from vitscale.data.storage.outputs import check_output
    from vitscale.data.tools.dedup import dedup_dataset

    args.out = check_output(args.out, "--out", folder=True, endpoint_url=args.endpoint_url)  # before the hashing
    kwargs = {"endpoint_url": args.endpoint_url}
    if args.threshold is not None:
        kwargs["threshold"] = args.threshold
    with naming_flags({"threshold": "--threshold"}):  # (checked before anything is written)
        summary = dedup_dataset(args.train, args.against, args.out, **kwargs)
    print_json(summary)
    return 0
