"""`vitscale models | flops`: the paper's models and their compute."""

from __future__ import annotations

import argparse
from typing import Any

from vitscale.cli.parser import VerbFn, model_options, print_json


def add_verbs(verbs: Any, verb: VerbFn) -> None:
    """This module's verbs under the CLI's: each one's arguments are set by the function above its command."""
    _models_args(verb(
        "models", cmd_models,
        "List every model with parameters and forward GFLOPs at 224 and 384."))
    _flops_args(verb(
        "flops", cmd_flops,
        "Forward and training compute of a model (the paper's convention)."))


def _models_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")


def cmd_models(args: argparse.Namespace) -> int:
    from vitscale.scaling.catalog import model_rows, models_markdown

    rows = model_rows()
    if args.json:
        print_json(rows)
    else:
        print(models_markdown(rows))
    return 0


def _flops_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help='model name, e.g. "ViT-B/16"')
    p.add_argument("--resolution", type=int, default=224, help="input side in pixels")
    p.add_argument("--examples", type=int, default=None, help="dataset size (default: JFT-300M)")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the dataset")
    p.add_argument("--classes", type=int, default=1000, help="classifier width (JFT-300M: 18291)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a model option, as in a pipeline's model: section (e.g. representation_size=768)")
    p.add_argument("--objective", choices=["supervised", "masked_patch"], default="supervised",
                   help="what pre-training predicts: the classes, or masked patch prediction's per-patch head "
                        "(the paper's: 50%% of the patches, 3-bit mean colour; --target for the others)")
    p.add_argument("--target", choices=["mean_colour", "downsized_4x4", "pixels"], default=None,
                   help="masked patch prediction's target, with --objective masked_patch (default: mean_colour)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a summary")


FLAGS = {"model.name": "MODEL", "model.img_size": "--resolution", "train.objective": "--objective",
         "train.masked_patch.target": "--target", "epochs": "--epochs",
         "model": "MODEL"}  # the model as a whole (no size its tensors can take): its message names the sizes
"""The pipeline keys whose checks `flops` reuses, by the argument that sets them here."""


def cmd_flops(args: argparse.Namespace) -> int:
    from vitscale.config.checks import ConfigError, check, positive, positive_int
    from vitscale.data.loader.labels import MAX_CLASSES
    from vitscale.models.config import ModelConfig
    from vitscale.scaling.catalog import flops_summary, summary_markdown

    options = model_options(args.option)
    positive(args.epochs, "--epochs")
    check(0 <= args.classes <= MAX_CLASSES, "--classes",  # (10**20: torch's traceback from the meta device)
          f"must be in [0, {MAX_CLASSES:,}] (0: no classifier; a dataset's most), got {args.classes}")
    if args.examples is not None:
        positive_int(args.examples, "--examples")
    # Without the objective the target changes nothing: the supervised figures under a flag asking for others.
    check(args.target is None or args.objective == "masked_patch", "--target",
          "is masked patch prediction's target: add --objective masked_patch")
    model = ModelConfig.from_mapping({"name": args.model, "img_size": args.resolution, **options})
    masked_patch = None
    try:  # the checks a pipeline's model: and train: sections get, each error naming its argument here
        model.validate()
        if args.objective == "masked_patch":
            from vitscale.train.config import MaskedPatchConfig
            from vitscale.train.objective import checked_masked_patch_plan

            settings = MaskedPatchConfig(target=args.target or "mean_colour")
            corruption, target = checked_masked_patch_plan(model, settings)
            masked_patch = (corruption.counts[0], target.outputs)
        summary = flops_summary(args.model, resolution=args.resolution, examples=args.examples, epochs=args.epochs,
                                num_classes=args.classes, masked_patch=masked_patch, **options)
    except ConfigError as exc:
        flag = FLAGS.get(exc.key, f"--option {exc.key.removeprefix('model.')}")
        raise ConfigError(flag, exc.message) from None
    if args.json:
        print_json(summary)
    else:
        print(summary_markdown(summary))
    return 0
