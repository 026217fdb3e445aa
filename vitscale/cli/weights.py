"""`vitscale export | fewshot | inspect`: what trained weights are and hold, in this process."""

from __future__ import annotations

import argparse
from typing import Any

from vitscale.cli.interrupt import writes
from vitscale.cli.parser import VerbFn, add_endpoint_url, model_options, naming_flags, print_json, writing


def add_verbs(verbs: Any, verb: VerbFn) -> None:
    """This module's verbs under the CLI's: each one's arguments are set by the function above its command."""
    _export_args(verb(
        "export", cmd_export,
        "Write a run's latest checkpoint as one fp32 model file."))
    _fewshot_args(verb(
        "fewshot", cmd_fewshot,
        "Few-shot linear probe of a checkpoint (closed-form least squares, Sec. 4.1), in this "
        "process: mean and std over seeds per dataset and shot count."))
    _inspect_args(verb(
        "inspect", cmd_inspect,
        "The paper's model analyses of a ViT or hybrid (Sec. 4.5, Figures 6-7): "
        "embedding-filter components, position-embedding similarity, attention distance, "
        "attention rollout; PNGs and parquet tables."))


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory (or a checkpoint directory inside it)")
    p.add_argument("--out", required=True, help="the model file to write, a path or s3:// URL: .pt (a vitscale state "
                                                "dict with its header) or .npz (big_vision's layout)")
    p.add_argument("--format", choices=("pt", "npz"), default=None,
                   help="pt: a vitscale state dict with its header; npz: big_vision's layout (default: the one "
                        "--out's suffix names, pt for any other)")


def _well_formed(*locations: tuple[str | None, str]) -> None:
    """Refuse a location spelled wrong (`s3:/bucket/run`, `s3:bucket`, a bucket S3 would refuse) in one line
    naming its argument, rather than a "no such file" later; each is then used as the user wrote it."""
    from vitscale.config.location import canonical_location

    for location, name in locations:
        if location:
            canonical_location(location, name)


@writes
def cmd_export(args: argparse.Namespace) -> int:
    from vitscale.train.export import export_run

    _well_formed((args.run_dir, "run_dir"))  # --out is checked where it is written (`storage.outputs`)

    with writing(f"export to {args.out}"):
        info = export_run(args.run_dir, args.out, fmt=args.format, progress=True)
    print_json(info)
    return 0


def _fewshot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint",
                   help="run directory, vitscale export (.pt/.safetensors), official .npz, timm or transformers file")
    p.add_argument("--data", action="append", required=True, metavar="SHARDS",
                   help="dataset (vitscale shards) with train and test splits (repeatable)")
    p.add_argument("--shots", type=int, nargs="+", default=None, help="examples per class (default: 1 5 10 25)")
    p.add_argument("--seeds", type=int, default=None, help="few-shot draws per shot count (default: 3)")
    p.add_argument("--seed", type=int, default=None, help="first seed of the draws (default: 0)")
    p.add_argument("--l2", type=float, default=None, help="ridge strength (default: 1024, as big_vision)")
    p.add_argument("--resolution", type=int, default=None, help="probe resolution (default: the model's)")
    p.add_argument("--train-split", default=None, help="split the shots are drawn from (default: train)")
    p.add_argument("--test-split", default=None, help="split accuracy is measured on (default: test)")
    p.add_argument("--model", default=None, help='architecture of a .npz, timm or transformers file, e.g. "ViT-B/16"')
    p.add_argument("--img-size", type=int, default=None, help="resolution such a file was trained at (224)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a model option of such a file's architecture, as in a pipeline's model: section "
                        "(e.g. depth=6, classifier=gap; repeatable)")
    p.add_argument("--batch-size", type=int, default=None, help="images per forward pass (default: 128)")
    p.add_argument("--error-budget", type=float, default=None,
                   help="fraction of unreadable samples tolerated per split (default: 0.001)")
    add_endpoint_url(p)
    p.add_argument("--json", action="store_true", help="print the accuracies as JSON instead of a table")


FEWSHOT_FLAGS = {"fewshot.datasets": "--data", "fewshot.shots": "--shots", "fewshot.seeds": "--seeds",
                 "fewshot.seed": "--seed", "fewshot.l2": "--l2", "fewshot.resolution": "--resolution",
                 "fewshot.train_split": "--train-split", "fewshot.test_split": "--test-split",
                 "fewshot.batch_size": "--batch-size", "fewshot.error_budget": "--error-budget"}
"""The `fewshot:` keys `vitscale fewshot`'s flags set: a bad value is named by the flag the user typed."""


def cmd_fewshot(args: argparse.Namespace) -> int:
    from vitscale.eval.weights_probe import fewshot_table, fewshot_weights

    _well_formed((args.checkpoint, "checkpoint"), *((data, "--data") for data in args.data))

    fewshot = {"datasets": tuple(args.data), "shots": tuple(args.shots) if args.shots else None,
               "seeds": args.seeds, "seed": args.seed, "l2": args.l2, "resolution": args.resolution,
               "train_split": args.train_split, "test_split": args.test_split, "batch_size": args.batch_size,
               "error_budget": args.error_budget}

    options = model_options(args.option)
    with naming_flags(FEWSHOT_FLAGS):
        report = fewshot_weights(args.checkpoint, fewshot, model_name=args.model, img_size=args.img_size,
                                 endpoint_url=args.endpoint_url, progress=True, model_options=options)
    if args.json:
        print_json(report)
    else:
        print(fewshot_table(report))
    return 0


def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint",
                   help="run directory, vitscale export (.pt/.safetensors), official .npz, timm or transformers file")
    p.add_argument("--images", required=True, metavar="SHARDS", help="dataset (vitscale shards) of sample images")
    p.add_argument("--out", required=True,
                   help="folder (or s3:// prefix) for the PNGs, parquet tables and inspect.json (an earlier "
                        "inspect's files there are replaced; other files are left alone)")
    p.add_argument("--count", type=int, default=8, help="sample images, the first readable ones (default: 8)")
    p.add_argument("--split", default="train", help="split the images are read from (default: train)")
    p.add_argument("--model", default=None, help='architecture of a .npz, timm or transformers file, e.g. "ViT-B/16"')
    p.add_argument("--img-size", type=int, default=None, help="resolution such a file was trained at (224)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a model option of such a file's architecture, as in a pipeline's model: section "
                        "(e.g. depth=6, classifier=gap; repeatable)")
    add_endpoint_url(p)
    p.add_argument("--json", action="store_true", help="print inspect.json's content instead of a summary")


@writes
def cmd_inspect(args: argparse.Namespace) -> int:
    from vitscale.inspect.run import inspect_checkpoint

    _well_formed((args.checkpoint, "checkpoint"), (args.images, "--images"))  # --out: `storage.outputs`

    options = model_options(args.option)
    with writing(f"inspect into {args.out}"):
        report = inspect_checkpoint(args.checkpoint, args.images, args.out, count=args.count, split=args.split,
                                    model_name=args.model, img_size=args.img_size, endpoint_url=args.endpoint_url,
                                    progress=True, model_options=options)
    if args.json:
        print_json(report)
    else:
        print(f"{report['checkpoint']} ({report['format']}, {report['model']} at {report['img_size']}): "
              f"{len(report['image_keys'])} images of {args.images} ({args.split})")
        print("\n".join([*(f"  note: {note}" for note in report["notes"]),
                         *(f"  wrote {args.out.rstrip('/')}/{name}" for name in report["files"])]))
    return 0
