"""`vitscale run | config | finetune`: pipelines, run on Ray (a local one by default)."""

from __future__ import annotations

import argparse
import json
import signal
from typing import Any

from vitscale.cli.interrupt import received, writes
from vitscale.cli.parser import VerbFn
from vitscale.config.checks import ConfigError, check


def add_verbs(verbs: Any, verb: VerbFn) -> None:
    """This module's verbs under the CLI's: each one's arguments are set by the function above its command."""
    _run_args(verb(
        "run", cmd_run,
        "Run a pipeline's stages (starts a local Ray unless --address/RAY_ADDRESS)."))
    _config_args(verb(
        "config", cmd_config,
        "Print the resolved pipeline config (defaults < file < --set)."))
    _finetune_args(verb(
        "finetune", cmd_finetune,
        "Fine-tune a checkpoint on a sharded dataset with the paper's recipe (SGD, cosine, "
        "Table 4 presets) and test it once."))


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("pipeline", help="pipeline YAML file, or the name of one under pipelines/")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.base_lr=4e-4 (repeatable)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS or local)")
    p.add_argument("--verbose", action="store_true",
                   help="show Ray's and DeepSpeed's own output here too (default: RUN_DIR/logs/ray.log)")
    p.add_argument("--force", action="store_true",
                   help="take over the run's lease from a writer known to be dead (object storage; a local "
                        "run's lock goes by itself when its holder dies)")


@writes  # SIGTERM and SIGHUP stop the run as Ctrl-C does: the workers, then the driver, in one line
def cmd_run(args: argparse.Namespace) -> int:
    from vitscale.stages import load_pipeline
    from vitscale.stages.run import resolve_pipeline_path, run_pipeline

    config = load_pipeline(resolve_pipeline_path(args.pipeline), args.set)
    try:
        summary = run_pipeline(config, address=args.address, verbose=args.verbose, force=args.force)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM/SIGHUP (cli/interrupt.Signalled)
        raise interrupted(stop, args.command_line, config.cluster.run_storage(config.run_name)) from None
    print(json.dumps(summary, default=str))
    return 0 if summary.get("ok", True) else 1


class Interrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C, SIGTERM or SIGHUP: the CLI's one line says where the run is kept and how
    to go on with it; the exit code is the shell's for the signal (130, 143, 129)."""

    def __init__(self, line: str) -> None:
        self.signum = received()  # what arrives here may have lost its Signalled type inside Ray's `get`
        by = "" if self.signum == signal.SIGINT else f" by {signal.Signals(self.signum).name}"
        super().__init__(f"interrupted{by}; {line}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def interrupted(stop: KeyboardInterrupt, command: list[str], storage: str) -> Interrupted:
    """The CLI's end of a stopped run: where it is kept and the command that resumes it, or, stopped before the
    run began (`StoppedBeforeStart`), that nothing of it was written and the command that starts it."""
    from vitscale.stages.run import StoppedBeforeStart

    return Interrupted(start_line(command, storage) if isinstance(stop, StoppedBeforeStart)
                       else resume_line(command, storage))


def resume_line(command: list[str], storage: str) -> str:
    """Where the run is kept and the command, as typed, that resumes it (docs/resume.md)."""
    import shlex

    return f"the run is kept at {storage}: resume it from its last complete checkpoint with `{shlex.join(command)}`"


def start_line(command: list[str], storage: str) -> str:
    """Stopped before the run began (its checks and datasets): nothing was written to it; the same command starts it."""
    import shlex

    return (f"before the run began (it was checking its settings and datasets), nothing written to {storage}: "
            f"`{shlex.join(command)}` starts it")


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("pipeline", help="pipeline YAML file, or the name of one under pipelines/")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.base_lr=4e-4 (repeatable)")


def cmd_config(args: argparse.Namespace) -> int:
    from vitscale.config import to_yaml
    from vitscale.stages import load_pipeline
    from vitscale.stages.run import resolve_pipeline_path

    config = load_pipeline(resolve_pipeline_path(args.pipeline), args.set)
    print(to_yaml(config), end="")
    return 0


def _named_by_flag(exc: ConfigError, overrides: list[str]) -> ConfigError:
    """`exc` naming the argument the user typed where one of `vitscale finetune`'s own flags sets its key (a
    `--set` of that key is named by the CLI's `from_set` instead)."""
    from vitscale.stages.finetune import FINETUNE_FLAGS

    flag = FINETUNE_FLAGS.get(exc.key)
    if flag is None or any(item.partition("=")[0].strip() == exc.key for item in overrides):
        return exc
    return ConfigError(flag, exc.message, exc.source)


def _finetune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint",
                   help="run directory, vitscale export (.pt/.safetensors), official .npz, timm or transformers file")
    p.add_argument("--data", required=True, help="downstream dataset (vitscale shards) with train and test splits")
    p.add_argument("--preset", default=None,
                   help="imagenet | cifar10 | cifar100 | pets | flowers | vtab (Table 4) (default: none)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the preset's, if it has one)")
    p.add_argument("--model", default=None, help='architecture of a .npz, timm or transformers file, e.g. "ViT-B/16"')
    p.add_argument("--img-size", type=int, default=None, help="resolution such a file was trained at (224)")
    p.add_argument("--resolution", type=int, default=None, help="fine-tuning resolution (default 384)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's, else 10000)")
    p.add_argument("--test-split", default=None,
                   help="split the fine-tuned model is tested on, once (default: test; timm's Hugging Face "
                        "layout calls it validation)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any pipeline value, e.g. --set finetune.train.global_batch=64 --set cluster.num_workers=2 "
                        "(without --address the cluster is this machine: a worker per GPU, or one CPU worker)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: $RAY_ADDRESS or local)")
    p.add_argument("--verbose", action="store_true", help="show Ray's and DeepSpeed's own output here too")


@writes
def cmd_finetune(args: argparse.Namespace) -> int:
    from vitscale.config import apply_override
    from vitscale.config.pipeline import ray_address
    from vitscale.stages import build_pipeline
    from vitscale.stages.finetune import finetune_pipeline
    from vitscale.stages.run import run_pipeline

    # A run or a vitscale export names its own size: alone, --img-size went unread.
    check(args.img_size is None or args.model is not None, "--img-size",
          "goes with --model: the size a .npz, timm or transformers file was trained at (a run or a vitscale "
          "export names its own; --resolution is the size it is fine-tuned at)")
    raw = finetune_pipeline(args.checkpoint, args.data, preset=args.preset, base_lr=args.lr, model=args.model,
                            img_size=args.img_size, resolution=args.resolution, steps=args.steps,
                            test_split=args.test_split, local=ray_address(args.address) is None)
    for item in args.set:
        raw = apply_override(raw, item)
    try:
        config = build_pipeline(raw, "vitscale finetune")
    except ConfigError as exc:
        raise _named_by_flag(exc, args.set) from None
    try:
        summary = run_pipeline(config, address=args.address, verbose=args.verbose)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM/SIGHUP (cli/interrupt.Signalled)
        raise interrupted(stop, args.command_line, config.cluster.run_storage(config.run_name)) from None
    except ConfigError as exc:  # the data's checks, before any compute
        raise _named_by_flag(exc, args.set) from None
    print(json.dumps(summary, default=str))
    return 0
