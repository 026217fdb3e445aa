"""The finetune stage: one fine-tuning run on the whole training split, tested once (App. B.1.1).

Starts from the pretrain stage's model or from `finetune.checkpoint` (a run directory, a vitscale
export, an official .npz or a timm state dict), drops the pre-training head and pre-logits,
attaches a zero-initialised D x K head and resamples the position embeddings to
`finetune.resolution`. Runs on Ray Train through the same loop as pre-training, on the job
`finetune.train` and `finetune.data` describe over the paper's recipe (train/finetune.py). The
learning rate is `finetune.train.base_lr`; choosing it on a dev split is the sweep stage's job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitscale.config.checks import AMBIGUOUS_CHARS, ConfigError, check, is_control
from vitscale.config.loader import build_section, to_yaml
from vitscale.config.location import FINETUNE_PART, SIBLING_FINETUNE_SUFFIX, is_url, part_location
from vitscale.config.pipeline import PipelineConfig, local_cluster
from vitscale.data.config import DataConfig
from vitscale.models.config import ModelConfig
from vitscale.stages.base import Pretrained, Stage, StageContext
from vitscale.stages.datasets import ensure_dataset, require_labels, require_split
from vitscale.train.finetune import FinetuneConfig, finetune_model, refuse_unset_lr
from vitscale.train.job import final_job


@dataclass(frozen=True)
class Finetuned:
    """A fine-tuned model and its one test accuracy."""

    checkpoint: Any
    """The final `ray.train.Checkpoint`."""
    base_lr: float
    metrics: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        return {**self.metrics, "base_lr": self.base_lr, "checkpoint": getattr(self.checkpoint, "path", None)}

    def rows(self) -> list[tuple[str, str]]:
        rows = [("test accuracy", f"{self.metrics.get('test_accuracy', float('nan')):.4f}"),
                ("learning rate", f"{self.base_lr:g}"), ("steps", str(self.metrics.get("step")))]
        if "test_accuracy_polyak" in self.metrics:
            rows.insert(1, ("test accuracy (Polyak)", f"{self.metrics['test_accuracy_polyak']:.4f}"))
        return rows


def pretrained_earlier(config: PipelineConfig, stage: str) -> bool:
    """Whether a stage before `stage` in the pipeline makes a `Pretrained` model."""
    from vitscale.stages import get_stage

    before = config.stages[: config.stages.index(stage)]
    return any(get_stage(name).produces is Pretrained for name in before)


def finetune_section(config: PipelineConfig) -> FinetuneConfig:
    """The pipeline's `finetune:` section, typed."""
    return config.section("finetune", FinetuneConfig)


def check_transfer(config: PipelineConfig, stage: str) -> None:
    """What a fine-tuning stage (finetune, or a fine-tuning sweep) needs: a downstream dataset and
    weights to start from."""
    fc = finetune_section(config)
    check(bool(fc.data_config().url), "finetune.data.url", f"the {stage} stage needs a downstream dataset")
    check(fc.checkpoint is not None or pretrained_earlier(config, stage), "finetune.checkpoint",
          f"nothing to fine-tune: set it, or put the pretrain stage before {stage}")


def check_finetune(config: PipelineConfig) -> None:
    fc = finetune_section(config)
    check_transfer(config, "finetune")
    refuse_unset_lr(fc, "the finetune stage")
    if fc.checkpoint is None:
        # The pre-trained architecture at the fine-tuning resolution: a size its patches cannot tile
        # would fail only after pre-training. (A checkpoint names its own architecture: `check_checkpoint`
        # checks that one.)
        check_resolution(config.model, fc.resolution)
    from vitscale.train.engine import check_settings

    recipe = fc.train_config()
    recipe.check_batch_split(config.cluster.world_sizes, "finetune.train")
    check_settings(recipe, "finetune.train")


def check_resolution(model: ModelConfig, resolution: int) -> None:
    """The pre-trained architecture `model` takes `finetune.resolution`: else every worker fails building it."""
    try:
        finetune_model(model, resolution).validate()
    except ConfigError as exc:
        raise ConfigError("finetune.resolution", f"({resolution}) does not fit {model.name}: {exc.message}") from None


def check_downstream(config: PipelineConfig) -> Any:
    """The downstream dataset: single-label, both splits, the dev carve and its rest non-empty, each
    holding a global batch (an epoch is whole global batches at any world size, data/order.py)."""
    from vitscale.data.carve import Carve
    from vitscale.data.format import open_dataset

    fc = finetune_section(config)
    data, batch = fc.data_config(config.data.endpoint_url), fc.train_config().global_batch
    meta = ensure_dataset(data.url, data.create_if_missing, data.endpoint_url, "finetune.data.url")
    check(not meta.multi_label, "finetune.data.url",
          f"{data.url} is multi-label; fine-tuning needs one label per image")
    train = require_split(meta, data.split, "finetune.data.split", data.url)
    require_labels(meta, "finetune.data.url", data.url, "fine-tuning")
    require_split(meta, fc.test_split, "finetune.test_split", data.url)
    check(train >= batch, "finetune.train.global_batch",
          f"({batch}) cannot be filled: split {data.split!r} of {data.url} has {train} samples")
    carve = Carve(fc.dev_share(), fc.dev_seed, "dev")
    dev = sum(open_dataset(data.url, data.split, endpoint_url=data.endpoint_url, carve=carve).counts)
    check(dev >= 1, "finetune.dev_fraction",
          f"a dev share of {fc.dev_share()} of {train} samples is empty; the dataset is too small for the dev split")
    check(train - dev >= batch, "finetune.train.global_batch",
          f"({batch}) cannot be filled from the {train - dev} samples left after the dev split")
    return meta


def check_checkpoint(config: PipelineConfig, num_classes: int) -> None:
    """A given checkpoint exists and fits the architecture it will be loaded into."""
    fc = finetune_section(config)
    if fc.checkpoint is None:
        return
    from vitscale.train.export import local_weights

    try:  # an s3:// file or run is read from a local copy, as the workers will
        path = local_weights(fc.checkpoint)
    except (ValueError, OSError) as exc:
        raise ConfigError("finetune.checkpoint", str(exc)) from None
    if path.is_dir():
        from vitscale.train.export import find_checkpoint

        try:
            model = _model_of_run(find_checkpoint(path))
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError("finetune.checkpoint", str(exc)) from None
        check_resolution(model, fc.resolution)  # the run's own architecture, at the fine-tuning resolution
        return
    from vitscale.models.weights_files import load_pretrained

    try:
        architecture = _model_of_file(path, config.model)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError("finetune.checkpoint", str(exc)) from None
    check_resolution(architecture, fc.resolution)
    try:
        model = finetune_model(architecture, fc.resolution).build(num_classes)
        load_pretrained(model, path)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError("finetune.checkpoint", str(exc)) from None


def prepare_finetune(config: PipelineConfig) -> None:
    from vitscale.train.resume import FINETUNE_SCOPE, dataset_identity, refuse_changed_run_in

    meta = check_downstream(config)
    check_checkpoint(config, meta.num_classes)
    refuse_sibling_finetune(config)
    # A re-run resumes the fine-tuning run of the same name: refuse a changed recipe before Ray starts.
    refuse_changed_run_in(finetune_storage(config), to_yaml(config), FINETUNE_SCOPE, config.cluster.fixed_world_size,
                          {"dataset": dataset_identity(meta, finetune_section(config).data_config().split)})


def finetune_storage(config: PipelineConfig) -> str:
    """Where the pipeline's fine-tuning Train run is stored: inside the run, `storage_path/run/finetune`."""
    return part_location(config.cluster.run_storage(config.run_name), FINETUNE_PART)


def refuse_sibling_finetune(config: PipelineConfig) -> None:
    """A fine-tuning run in the older layout (`<run>-finetune` beside the run) is not resumed from scratch in
    the new place without a word: refused in one line naming where it must move."""
    old = config.cluster.run_storage(config.run_name) + SIBLING_FINETUNE_SUFFIX
    new = finetune_storage(config)
    if _has_checkpoints(old, config.data.endpoint_url) and not _has_checkpoints(new, config.data.endpoint_url):
        raise ConfigError("cluster.run_name", f"{config.run_name}'s fine-tuning is at {old}, beside the run (an older "
                          f"layout); a run now keeps it inside: move it to {new} to resume it, or choose another name")


def _has_checkpoints(location: str, endpoint_url: str | None) -> bool:
    from vitscale.data.storage import open_storage

    if not is_url(location):  # a glob, not a walk through every checkpoint's files
        return any(Path(location).glob("checkpoint_*"))
    return bool(open_storage(location, endpoint_url=endpoint_url).list("checkpoint_"))


def _model_of_run(checkpoint_dir: Path) -> ModelConfig:
    import yaml

    from vitscale.train.job import trained_sections

    raw = yaml.safe_load((Path(checkpoint_dir) / "config.yaml").read_text()) or {}
    return build_section(ModelConfig, trained_sections(raw)[0], "model")


def _model_of_file(path: Path, fallback: ModelConfig) -> ModelConfig:
    """A vitscale export names its architecture; .npz and timm files use the pipeline's `model:` section."""
    from vitscale.models.weights_files import read_weights

    _, _, meta = read_weights(path)
    if not meta:
        return fallback
    return build_section(ModelConfig, {"name": meta["name"], "img_size": meta["img_size"],
                                       **(meta.get("overrides") or {})}, "model")


def initial_weights(config: PipelineConfig, context: StageContext) -> tuple[ModelConfig, str]:
    """(the pre-trained architecture, where every worker reads the weights) for fine-tuning.

    A training checkpoint (the pretrain stage's, or a run directory) is consolidated once, here,
    into one fp32 export that is handed over through the run's storage: the workers may be on nodes
    that share no disk with the driver, so they get its URL in storage (a local or NFS path when the
    storage is one). A file is used where it is (a path, or a URL the workers copy from).
    """
    from vitscale.train.export import export_run, local_weights

    fc = finetune_section(config)
    out = context.run_dir / INIT_FILE
    if fc.checkpoint is None:
        with context.need(Pretrained).checkpoint.as_directory() as directory:
            export_run(directory, out)
        return config.model, _handed_over(config, context)
    path = local_weights(fc.checkpoint)
    if path.is_dir():
        export_run(path, out)
        return _model_of_run(path), _handed_over(config, context)
    return _model_of_file(path, config.model), fc.checkpoint


INIT_FILE = "finetune-init.pt"
"""The consolidated pre-trained weights, in the run's storage, that fine-tuning and sweep workers load."""


def _handed_over(config: PipelineConfig, context: StageContext) -> str:
    """Push the run's files (the export among them) to its storage; the export's location there."""
    context.sync()
    return f"{config.cluster.run_storage(config.run_name)}/{INIT_FILE}"


def run_finetune(config: PipelineConfig, context: StageContext) -> Finetuned:
    from vitscale.launch.ray_train import launch_training
    from vitscale.launch.run_place import run_place

    fc = finetune_section(config)
    model, init = initial_weights(config, context)
    lr = refuse_unset_lr(fc, "the finetune stage")  # check_finetune refused an unset one already
    job = final_job(fc, finetune_model(model, fc.resolution), init, lr, use_gpu=config.cluster.use_gpu,
                    endpoint_url=config.data.endpoint_url, config_yaml=to_yaml(config))
    place = run_place(config.cluster, config.run_name, FINETUNE_PART)  # inside the run: storage_path/run/finetune
    checkpoint, metrics = launch_training(job, config.cluster, place, what="fine-tuning")
    return Finetuned(checkpoint=checkpoint, base_lr=lr, metrics=metrics)


FINETUNE_FLAGS = {"finetune.checkpoint": "checkpoint", "finetune.data.url": "--data", "finetune.preset": "--preset",
                  "finetune.train.base_lr": "--lr", "model.name": "--model", "model.img_size": "--img-size",
                  "finetune.resolution": "--resolution", "finetune.train.max_steps": "--steps",
                  "finetune.test_split": "--test-split"}
"""The pipeline key each of `vitscale finetune`'s own arguments sets in `finetune_pipeline` (errors name the flag)."""


def finetune_name(checkpoint: str, dataset: str) -> str:
    """`vitscale finetune`'s run name: `finetune-<weights>-<dataset>`, from the last part of each location.

    The same command names the same run (so it resumes); other weights on the same dataset name another
    (`runs/exp1` and `runs/exp2` fine-tuned on `cifar10` are two runs, not one refused as changed)."""
    from vitscale.models.weights_files import WEIGHTS_SUFFIXES  # (dropped from the file's name)

    weights = _last_part(checkpoint)
    weights = next((weights[: -len(s)] for s in WEIGHTS_SUFFIXES if weights.endswith(s) and weights != s), weights)
    return f"finetune-{weights or 'weights'}-{_last_part(dataset) or 'dataset'}"


def _last_part(location: str) -> str:
    """A location's last part: a URL's last segment, a local path's folder or file name ("." names the folder),
    with what a run name may not hold (`checks.plain_name`: `#` in a local file's name, say) as `-`."""
    part = location.rstrip("/").rsplit("/", 1)[-1] if is_url(location) else Path(os.path.abspath(location)).name
    return "".join("-" if c in AMBIGUOUS_CHARS or is_control(c) else c for c in part)


def finetune_pipeline(checkpoint: str, dataset: str, *, preset: str | None = None, base_lr: float | None = None,
                      model: str | None = None, img_size: int | None = None, resolution: int | None = None,
                      steps: int | None = None, test_split: str | None = None, local: bool = False) -> dict[str, Any]:
    """The pipeline `vitscale finetune CHECKPOINT --data SHARDS` runs, as plain data (`--set` refines it).

    `local`: on a Ray started on this machine, the cluster is this machine (a worker per GPU, or one
    CPU worker with every core) and, without a GPU, fp32 (bf16 matmuls crawl on most CPUs).
    """
    train: dict[str, Any] = {}
    finetune: dict[str, Any] = {"checkpoint": checkpoint, "data": {"url": dataset}, "train": train}
    if preset is not None:
        finetune["preset"] = preset
    if resolution is not None:
        finetune["resolution"] = resolution
    if base_lr is not None:
        train["base_lr"] = base_lr
    if steps is not None:
        train["max_steps"] = steps
    if test_split is not None:
        finetune["test_split"] = test_split
    raw: dict[str, Any] = {"name": finetune_name(checkpoint, dataset), "stages": ["finetune"], "finetune": finetune}
    if local:
        raw["cluster"] = local_cluster()
        if not raw["cluster"]["use_gpu"]:
            train["precision"] = "fp32"
    if model is not None:
        raw["model"] = {"name": model, **({"img_size": img_size} if img_size is not None else {})}
    return raw


STAGE = Stage(
    name="finetune",
    sections={"finetune": FinetuneConfig, "model": ModelConfig, "data": DataConfig},
    check=check_finetune,
    prepare=prepare_finetune,
    run=run_finetune,
    produces=Finetuned,
)
