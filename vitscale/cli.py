"""The `vitscale` command. Thin on purpose: parse arguments, load config, call one function per verb.

Heavy imports (torch, ray, deepspeed) happen inside the verb that needs them, so `vitscale config`
and `--help` answer instantly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from vitscale.config.errors import UserError
from vitscale.config.suggest import did_you_mean


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it already says it or has none worth saying."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default == [] or default is argparse.SUPPRESS
                or "default" in text or not (action.option_strings or action.nargs in ("?", "*"))):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for a mistyped verb or choice, and defaults in every --help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # argparse's own signature; it exits
        found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if found:
            message += did_you_mean(found.group(1), re.findall(r"'([^']*)'", found.group(2)))
        super().error(message)


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)parser of the verb `args` selected: its flags are the ones a mistyped flag is matched to."""
    for action in parser._actions:  # argparse keeps no public list of its sub-parsers
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return _chosen_parser(action.choices[name], args)
    return parser


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


# --------------------------------------------------------------------------- model verbs


def cmd_models(args: argparse.Namespace) -> int:
    from vitscale.scaling.catalog import model_rows, models_markdown

    rows = model_rows()
    if args.json:
        _print_json(rows)
    else:
        print(models_markdown(rows))
    return 0


def cmd_flops(args: argparse.Namespace) -> int:
    from vitscale.config.loader import apply_override
    from vitscale.scaling.catalog import flops_summary, summary_markdown

    options: dict = {}
    for item in args.option:  # YAML values, as a pipeline's `model:` section reads them
        options = apply_override(options, item)
    summary = flops_summary(args.model, resolution=args.resolution, examples=args.examples, epochs=args.epochs,
                            num_classes=args.classes, **options)
    if args.json:
        _print_json(summary)
    else:
        print(summary_markdown(summary))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from vitscale.config import to_yaml
    from vitscale.stages import load_pipeline
    from vitscale.stages.run import resolve_pipeline_path

    config = load_pipeline(resolve_pipeline_path(args.pipeline), args.set)
    print(to_yaml(config), end="")
    return 0


# --------------------------------------------------------------------------- pipeline verbs


def cmd_run(args: argparse.Namespace) -> int:
    from vitscale.stages import load_pipeline
    from vitscale.stages.run import resolve_pipeline_path, run_pipeline

    config = load_pipeline(resolve_pipeline_path(args.pipeline), args.set)
    summary = run_pipeline(config, address=args.address, verbose=args.verbose, force=args.force)
    print(json.dumps(summary, default=str))
    return 0 if summary.get("ok", True) else 1


def cmd_finetune(args: argparse.Namespace) -> int:
    from vitscale.config import apply_override
    from vitscale.config.pipeline import ray_address
    from vitscale.stages import build_pipeline
    from vitscale.stages.finetune import finetune_pipeline
    from vitscale.stages.run import run_pipeline

    raw = finetune_pipeline(args.checkpoint, args.data, preset=args.preset, base_lr=args.lr, model=args.model,
                            img_size=args.img_size, resolution=args.resolution, steps=args.steps,
                            local=ray_address(args.address) is None)
    for item in args.set:
        raw = apply_override(raw, item)
    summary = run_pipeline(build_pipeline(raw, "vitscale finetune"), address=args.address, verbose=args.verbose)
    print(json.dumps(summary, default=str))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from vitscale.train.export import export_run

    info = export_run(args.run_dir, args.out, fmt=args.format, progress=True)
    _print_json(info)
    return 0


def cmd_fewshot(args: argparse.Namespace) -> int:
    from vitscale.eval.checkpoint_probe import fewshot_checkpoint, fewshot_table

    fewshot = {"datasets": tuple(args.data), "shots": tuple(args.shots) if args.shots else None,
               "seeds": args.seeds, "seed": args.seed, "l2": args.l2, "resolution": args.resolution,
               "train_split": args.train_split, "test_split": args.test_split, "batch_size": args.batch_size,
               "error_budget": args.error_budget}
    from vitscale.config.loader import apply_override

    options: dict[str, Any] = {}
    for item in args.option:  # YAML values, as a pipeline's `model:` section reads them
        options = apply_override(options, item)
    report = fewshot_checkpoint(args.checkpoint, fewshot, model_name=args.model, img_size=args.img_size,
                                endpoint_url=args.endpoint_url, progress=True, model_options=options)
    if args.json:
        _print_json(report)
    else:
        print(fewshot_table(report))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from vitscale.config.loader import apply_override
    from vitscale.inspect.run import inspect_checkpoint

    options: dict[str, Any] = {}
    for item in args.option:  # YAML values, as a pipeline's `model:` section reads them
        options = apply_override(options, item)
    report = inspect_checkpoint(args.checkpoint, args.images, args.out, count=args.count, split=args.split,
                                model_name=args.model, img_size=args.img_size, endpoint_url=args.endpoint_url,
                                progress=True, model_options=options)
    if args.json:
        _print_json(report)
    else:
        print(f"{report['checkpoint']} ({report['format']}, {report['model']} at {report['img_size']}): "
              f"{len(report['image_keys'])} images of {args.images} ({args.split})")
        print("\n".join([*(f"  note: {note}" for note in report["notes"]),
                         *(f"  wrote {args.out}/{name}" for name in report["files"])]))
    return 0


# --------------------------------------------------------------------------- data verbs


def cmd_shards_write(args: argparse.Namespace) -> int:
    from vitscale.data.tools.write import parse_splits, write_dataset

    options = {k: v for k, v in (("count", args.count), ("classes", args.classes),
                                 ("image_size", args.image_size)) if v is not None}
    if args.multi_label:
        options["multi_label"] = True
    try:
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


def cmd_shards_index(args: argparse.Namespace) -> int:
    from vitscale.data.tools.adopt import index_shards

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


def cmd_shards_stats(args: argparse.Namespace) -> int:
    from vitscale.data.tools.verify import dataset_stats, format_stats

    stats = dataset_stats(args.dest, endpoint_url=args.endpoint_url)
    if args.json:
        _print_json(stats)
    else:
        print(format_stats(stats))
    return 0


def cmd_shards_verify(args: argparse.Namespace) -> int:
    from vitscale.data.tools.verify import verify_dataset

    problems = verify_dataset(args.dest, endpoint_url=args.endpoint_url)
    for problem in problems:
        print(f"BAD {problem}", file=sys.stderr)
    if not problems:
        print(f"ok: {args.dest}")
    return 1 if problems else 0


def cmd_shards_reindex(args: argparse.Namespace) -> int:
    from vitscale.data.format.index import reindex

    try:
        result = reindex(args.dest, endpoint_url=args.endpoint_url)
    except OSError as exc:  # storage trouble: one line
        raise UserError(f"shards reindex {args.dest}: {type(exc).__name__}: {exc}") from exc
    print(json.dumps(result))
    return 0


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
    world_size = args.world_size or world_size
    if dest is None or world_size is None:
        raise UserError("shards order needs DEST and --world-size, or --pipeline FILE")
    keys = rank_keys(dest, args.split or data.split, rank=args.rank, world_size=world_size, epoch=args.epoch,
                     seed=data.seed if args.seed is None else args.seed, start=args.start,
                     endpoint_url=args.endpoint_url or data.endpoint_url,
                     shuffle_buffer=args.shuffle_buffer or data.shuffle_buffer,
                     global_batch=args.global_batch or global_batch)
    if args.json:
        print(json.dumps(keys))
    else:
        print("\n".join(keys))
    return 0


def cmd_shards_bench(args: argparse.Namespace) -> int:
    from vitscale.config.checks import positive_int
    from vitscale.data.loader.stream import StreamSpec
    from vitscale.data.tools.bench import run_bench

    positive_int(args.workers, "--workers")
    # --workers 1 decodes in this process (the single-core rate); N > 1: N loader processes.
    spec = StreamSpec(url=args.dest, split=args.split, resolution=args.resolution, batch_size=args.batch_size,
                      train=True, num_workers=0 if args.workers == 1 else args.workers,
                      endpoint_url=args.endpoint_url,
                      error_budget=0.5)  # a benchmark reports bad data, it does not stop on it
    result = run_bench(spec, seconds=args.seconds)
    if args.json:
        _print_json(result)
    else:
        print(f"{result['images_per_s']:.1f} images/s with {result['workers']} worker(s)")
    return 0


def cmd_shards_dedup(args: argparse.Namespace) -> int:
    from vitscale.data.tools.dedup import dedup_dataset

    kwargs = {"endpoint_url": args.endpoint_url}
    if args.threshold is not None:
        kwargs["threshold"] = args.threshold
    summary = dedup_dataset(args.train, args.against, args.out, **kwargs)
    _print_json(summary)
    return 0


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vitscale",
        description="Pre-train Vision Transformers at scale on Ray Train + DeepSpeed ZeRO.")
    from vitscale._version import __version__

    parser.add_argument("--version", action="version", version=f"vitscale {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, func: Callable[[argparse.Namespace], int], help: str,
             into: Any = verbs) -> argparse.ArgumentParser:
        p = into.add_parser(name, help=help, description=help)
        p.set_defaults(func=func)
        return p

    p = verb("run", cmd_run, "Run a pipeline's stages (starts a local Ray unless --address/RAY_ADDRESS).")
    p.add_argument("pipeline", help="pipeline YAML file, or the name of one under pipelines/")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.base_lr=4e-4 (repeatable)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS or local)")
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's and DeepSpeed's own output here too (default: RUN_DIR/logs/ray.log)")
    p.add_argument("--force", action="store_true",
                   help="take over the run's lease from a writer known to be dead (object storage; a local "
                        "run's lock goes by itself when its holder dies)")

    p = verb("finetune", cmd_finetune,
             "Fine-tune a checkpoint on a sharded dataset with the paper's recipe (SGD, cosine, Table 4 presets) "
             "and test it once.")
    p.add_argument("checkpoint", help="run directory, vitscale export (.pt/.safetensors), official .npz or timm file")
    p.add_argument("--data", required=True, help="downstream dataset (vitscale shards) with train and test splits")
    p.add_argument("--preset", default=None, help="imagenet | cifar10 | cifar100 | pets | flowers | vtab (Table 4)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the preset's, if it has one)")
    p.add_argument("--model", default=None, help='architecture of a .npz/timm file, e.g. "ViT-B/16"')
    p.add_argument("--img-size", type=int, default=None, help="resolution the .npz/timm file was trained at")
    p.add_argument("--resolution", type=int, default=None, help="fine-tuning resolution (default 384)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any pipeline value, e.g. --set finetune.train.global_batch=64 --set cluster.num_workers=2 "
                        "(without --address the cluster is this machine: a worker per GPU, or one CPU worker)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS or local)")
    p.add_argument("--verbose", action="store_true", help="show Ray's and DeepSpeed's own output here too")

    p = verb("config", cmd_config, "Print the resolved pipeline config (defaults < file < --set).")
    p.add_argument("pipeline")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")

    p = verb("models", cmd_models, "List every model with parameters and forward GFLOPs at 224 and 384.")
    p.add_argument("--json", action="store_true")

    p = verb("flops", cmd_flops, "Forward and training compute of a model (the paper's convention).")
    p.add_argument("model", help='model name, e.g. "ViT-B/16"')
    p.add_argument("--resolution", type=int, default=224, help="input side in pixels")
    p.add_argument("--examples", type=int, default=None, help="dataset size (default: JFT-300M)")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the dataset")
    p.add_argument("--classes", type=int, default=1000, help="classifier width (JFT-300M: 18291)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a model option, as in a pipeline's model: section (e.g. representation_size=768)")
    p.add_argument("--json", action="store_true")

    p = verb("export", cmd_export, "Write a run's latest checkpoint as one fp32 model file.")
    p.add_argument("run_dir", help="run directory (or a checkpoint directory inside it)")
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=("pt", "npz"), default="pt",
                   help="pt: a vitscale state dict with its header; npz: big_vision's layout")

    p = verb("fewshot", cmd_fewshot, "Few-shot linear probe of a checkpoint (closed-form least squares, Sec. 4.1), "
             "in this process: mean and std over seeds per dataset and shot count.")
    p.add_argument("checkpoint", help="run directory, vitscale export (.pt/.safetensors), official .npz or timm file")
    p.add_argument("--data", action="append", required=True, metavar="SHARDS",
                   help="dataset (vitscale shards) with train and test splits (repeatable)")
    p.add_argument("--shots", type=int, nargs="+", default=None, help="examples per class (default: 1 5 10 25)")
    p.add_argument("--seeds", type=int, default=None, help="few-shot draws per shot count (default: 3)")
    p.add_argument("--seed", type=int, default=None, help="first seed of the draws (default: 0)")
    p.add_argument("--l2", type=float, default=None, help="ridge strength (default: 1024, as big_vision)")
    p.add_argument("--resolution", type=int, default=None, help="probe resolution (default: the model's)")
    p.add_argument("--train-split", default=None, help="split the shots are drawn from (default: train)")
    p.add_argument("--test-split", default=None, help="split accuracy is measured on (default: test)")
    p.add_argument("--model", default=None, help='architecture of a .npz/timm file, e.g. "ViT-B/16"')
    p.add_argument("--img-size", type=int, default=None, help="resolution the .npz/timm file was trained at (224)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a model option of the .npz/timm file's architecture, as in a pipeline's model: section "
                        "(e.g. depth=6, classifier=gap; repeatable)")
    p.add_argument("--batch-size", type=int, default=None, help="images per forward pass (default: 128)")
    p.add_argument("--error-budget", type=float, default=None,
                   help="fraction of unreadable samples tolerated per split (default: 0.001)")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint URL")
    p.add_argument("--json", action="store_true")

    p = verb("inspect", cmd_inspect, "The paper's model analyses of a ViT or hybrid (Sec. 4.5, Figures 6-7): "
             "embedding-filter components, position-embedding similarity, attention distance, attention "
             "rollout; PNGs and parquet tables.")
    p.add_argument("checkpoint", help="run directory, vitscale export (.pt/.safetensors), official .npz or timm file")
    p.add_argument("--images", required=True, metavar="SHARDS", help="dataset (vitscale shards) of sample images")
    p.add_argument("--out", required=True, help="folder for the PNGs, parquet tables and inspect.json")
    p.add_argument("--count", type=int, default=8, help="sample images, the first readable ones (default: 8)")
    p.add_argument("--split", default="train", help="split the images are read from (default: train)")
    p.add_argument("--model", default=None, help='architecture of a .npz/timm file, e.g. "ViT-B/16"')
    p.add_argument("--img-size", type=int, default=None, help="resolution the .npz/timm file was trained at (224)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a model option of the .npz/timm file's architecture, as in a pipeline's model: section "
                        "(e.g. depth=6, classifier=gap; repeatable)")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint URL")
    p.add_argument("--json", action="store_true", help="print inspect.json's content instead of a summary")

    from vitscale.stages.study_commands import add_study_verbs

    add_study_verbs(verbs, verb)

    shards = verbs.add_parser("shards", help="Write, inspect, verify, order, benchmark and de-duplicate shards.")
    shard_verbs = shards.add_subparsers(dest="shards_verb", required=True, metavar="VERB")

    def endpoint(p: argparse.ArgumentParser) -> None:
        p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint URL")

    p = verb("write", cmd_shards_write, "Write WebDataset shards from a source.", shard_verbs)
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
    p.add_argument("--split", default=None, help="named fractions, e.g. train=0.9,minival=0.05,test=0.05")
    p.add_argument("--name", default=None, help="dataset name (default: from the source)")
    p.add_argument("--count", type=int, default=None, help="synthetic/fractal: number of images")
    p.add_argument("--classes", type=int, default=None, help="synthetic/fractal: number of classes")
    p.add_argument("--image-size", type=int, default=None, help="synthetic/fractal/digits: image side in pixels")
    p.add_argument("--multi-label", action="store_true", help="synthetic: JFT-style multi-label samples")
    p.add_argument("--max-bad", type=int, default=100,
                   help="unreadable source files skipped and listed before the write stops (default 100)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="larger source images are skipped as decompression bombs (default 89478485, PIL's)")
    endpoint(p)

    p = verb("index", cmd_shards_index, "Adopt existing WebDataset tars in place: build _index.parquet and "
             "dataset.json for them without rewriting them.", shard_verbs)
    p.add_argument("url", help="folder or s3:// prefix of .tar shards, one tar, or braces: train-{000000..000999}.tar")
    p.add_argument("--out", default=None, help="where the index and dataset.json go (default: beside the tars)")
    p.add_argument("--split", default=None,
                   help="put every tar into this split (default: the split each tar's name says, "
                        "{split}-NNNNNN.tar, else train)")
    p.add_argument("--label-member", default="cls", help="cls (class id), txt (class name) or json:KEY (default: cls)")
    p.add_argument("--classes", default=None, help="file of class names, one per line, in index order")
    p.add_argument("--no-checksums", action="store_true",
                   help="read headers only: no crc32 per sample (saves one read of every shard; reads go unchecked)")
    p.add_argument("--num-classes", type=int, default=None,
                   help="class count: ids outside [0, N) make their sample bad (default: --classes' length, "
                        "else the largest id found + 1, at most 2^20)")
    p.add_argument("--max-bad", type=int, default=100,
                   help="samples without an image or a usable label listed and left out before the index "
                        "stops (default 100)")
    endpoint(p)

    p = verb("stats", cmd_shards_stats, "Shards, samples and classes of a dataset.", shard_verbs)
    p.add_argument("dest")
    p.add_argument("--json", action="store_true")
    endpoint(p)

    p = verb("verify", cmd_shards_verify, "Re-hash every shard and check counts; non-zero exit if bad.",
             shard_verbs)
    p.add_argument("dest")
    endpoint(p)

    p = verb("reindex", cmd_shards_reindex, "Rewrite an older dataset's _index.parquet with one row group per "
             "shard, so a rank's start-up reads only its shards' rows.", shard_verbs)
    p.add_argument("dest")
    endpoint(p)

    p = verb("order", cmd_shards_order, "Keys one rank reads in one epoch, in training's order.", shard_verbs)
    p.add_argument("dest", nargs="?", default=None, help="dataset (default: the pipeline's data.url)")
    p.add_argument("--pipeline", default=None,
                   help="take data.url/split/seed/shuffle_buffer and cluster.num_workers from this pipeline")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: the pipeline's num_workers)")
    p.add_argument("--epoch", type=int, required=True)
    p.add_argument("--seed", type=int, default=None, help="data.seed (default: the pipeline's, else 0)")
    p.add_argument("--shuffle-buffer", type=int, default=None,
                   help="data.shuffle_buffer (default: the pipeline's, else training's default)")
    p.add_argument("--start", type=int, default=0, help="resume position within the rank's order")
    p.add_argument("--global-batch", type=int, default=None,
                   help="training's layout: each rank's share of every global batch (default: the pipeline's "
                        "train.global_batch when it pre-trains, else one contiguous span per rank)")
    p.add_argument("--split", default=None, help="default: the pipeline's data.split, else train")
    p.add_argument("--json", action="store_true")
    endpoint(p)

    p = verb("bench", cmd_shards_bench, "Run the training loader alone and report images/s.", shard_verbs)
    p.add_argument("dest")
    p.add_argument("--resolution", type=int, default=224, help="training resolution of the decoded images")
    p.add_argument("--seconds", type=float, default=15.0, help="how long to read")
    p.add_argument("--workers", type=int, default=1, help="loader processes")
    p.add_argument("--batch-size", type=int, default=64, help="images per batch")
    p.add_argument("--split", default="train", help="split to read")
    p.add_argument("--json", action="store_true")
    endpoint(p)

    p = verb("dedup", cmd_shards_dedup, "Drop near-duplicates of test-set images from a training set.",
             shard_verbs)
    p.add_argument("--train", required=True)
    p.add_argument("--against", action="append", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threshold", type=int, default=None, help="max Hamming distance of 64-bit pHashes")
    endpoint(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `vitscale` console script.

    Errors that are the user's to fix (a setting, the data, storage, a file: `launch/errors.py`) are one
    line and exit 2; a failed stage is one line after the workers' own output and exits 1; Ctrl-C is one
    line and exits 130. Anything else is a bug and keeps its traceback.
    """
    from vitscale.config.checks import ConfigError
    from vitscale.launch.errors import PipelineFailed, known_errors

    # Before Ray is imported (it reads the variable then; Ray's logging guide documents it): the console
    # routes every forwarded line itself, and Ray's de-duplication would hold repeated lines back and
    # print them late, after the summary and the final JSON line.
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        chosen = _chosen_parser(parser, args)
        flags = [flag for action in chosen._actions for flag in action.option_strings]
        hints = "".join(did_you_mean(item.partition("=")[0], flags) for item in extra if item.startswith("-"))
        chosen.error(f"unrecognized arguments: {' '.join(extra)}{hints}")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("vitscale: interrupted", file=sys.stderr)
        return 130
    except known_errors() as exc:
        text = from_set(exc, getattr(args, "set", ())) if isinstance(exc, ConfigError) else str(exc)
        print(f"vitscale: error: {text}", file=sys.stderr)
        return 2
    except PipelineFailed as exc:
        # The workers' tracebacks are already in the log above; end with who failed and why.
        print(f"vitscale: error: {exc}", file=sys.stderr)
        return 1


def from_set(exc: Exception, overrides: Sequence[str]) -> str:
    """The error's line, naming the `--set KEY=VALUE` the bad value came from (not the pipeline file)."""
    key = getattr(exc, "key", "")
    for item in reversed(list(overrides)):  # the last --set of a key is the one that counts
        given = item.partition("=")[0].strip()
        if key == given or key.startswith((f"{given}.", f"{given}[")) or given.startswith(f"{key}."):
            return f"{key}: {getattr(exc, 'message', exc)} (from --set {item})"
    return str(exc)


if __name__ == "__main__":
    raise SystemExit(main())
