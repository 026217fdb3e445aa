"""The pretrain stage: a model (`model:`) trained on a dataset (`data:`) with a recipe (`train:`).

Runs on Ray Train (`launch/ray_train.py`), every worker in `train/loop.py`; makes `Pretrained`.
"""

from __future__ import annotations

from typing import Any

from vitscale.config.checks import check
from vitscale.config.loader import to_yaml
from vitscale.config.pipeline import PipelineConfig
from vitscale.data.carve import Carve
from vitscale.data.config import DataConfig
from vitscale.models.config import ModelConfig
from vitscale.stages.base import Pretrained, Stage, StageContext
from vitscale.stages.datasets import ensure_dataset, require_labels, require_split
from vitscale.train.config import TrainConfig
from vitscale.train.job import TrainJob


def check_pretrain(config: PipelineConfig) -> None:
    """The recipe against the cluster: the batch splits evenly over workers, the fault hits one; DeepSpeed takes
    its `train.deepspeed` settings."""
    from vitscale.train.engine import check_settings

    train, cluster = config.train, config.cluster
    fault = train.fault
    check(fault.kill_rank is None or fault.kill_rank < cluster.min_workers, "train.fault.kill_rank",
          f"({fault.kill_rank}) must be below cluster.num_workers ({cluster.min_workers})")
    # Worker r of a node serves on metrics_port + r; the last one must still be a TCP port.
    last_port = (train.metrics_port or 0) + cluster.max_workers - 1
    check(not train.metrics_port or last_port <= 65535, "train.metrics_port",
          f"({train.metrics_port}) + up to {cluster.max_workers - 1} local ranks = {last_port}, past 65535")
    train.check_batch_split(cluster.world_sizes)
    check_settings(train, "train")
    check_objective(config)


def check_objective(config: PipelineConfig) -> None:
    """Masked patch prediction needs a ViT's patch embeddings to corrupt and a grid its plan fits."""
    if config.train.objective == "masked_patch":
        from vitscale.train.objective import checked_masked_patch_plan

        checked_masked_patch_plan(config.model, config.train.masked_patch)


def prepare_pretrain(config: PipelineConfig) -> None:
    """The dataset exists (or is written from `data.create_if_missing`), has the split, fills a step."""
    meta = check_pretrain_data(config)
    # Re-submitting a run with the same name resumes it: refuse a changed one (settings or dataset) now, not on
    # the workers.
    from vitscale.train.resume import PRETRAIN_SCOPE, dataset_identity, refuse_changed_run_in

    refuse_changed_run_in(config.cluster.run_storage(config.run_name), to_yaml(config), PRETRAIN_SCOPE,
                          config.cluster.fixed_world_size, {"dataset": dataset_identity(meta, config.data.split)})


def check_pretrain_data(config: PipelineConfig, rest: Carve | None = None) -> Any:
    """What pre-training reads: the dataset (written from `data.create_if_missing` when absent), its split, labels
    for the supervised objective, and a global batch from the samples trained on (`data.subset` of them, or a
    sweep trial's `rest` of its dev carve). Returns the dataset's metadata."""
    from vitscale.data.format import open_dataset

    data, train = config.data, config.train
    meta = ensure_dataset(data.url, data.create_if_missing, data.endpoint_url, "data.url")
    samples = require_split(meta, data.split, "data.split", data.url)
    if train.objective == "supervised":
        require_labels(meta, "data.url", data.url, "train.objective 'supervised'")
    # The index agrees with dataset.json; a trial trains on the rest of its dev carve.
    trained = open_dataset(data.url, data.split, endpoint_url=data.endpoint_url, carve=rest)
    if data.subset is not None:
        check(data.subset <= samples, "data.subset",
              f"({data.subset}) is larger than split {data.split!r} of {data.url} ({samples} samples)")
        samples = data.subset
    where = f"split {data.split!r} of {data.url} has {samples} samples"
    if rest is not None:
        samples = sum(trained.counts)
        where = f"{samples} samples of split {data.split!r} of {data.url} are left after the dev carve " \
                "(sweep.dev_fraction)"
    # An epoch is the split's whole global batches (order.py), at any world size: it must hold one.
    check(samples >= train.global_batch, "train.global_batch", f"({train.global_batch}) cannot be filled: {where}")
    return meta


def pretraining_job(config: PipelineConfig) -> TrainJob:
    """The pipeline's pre-training as a `TrainJob`: its model, data (or `data.subset` of it) and
    recipe, from random weights."""
    data, carve = config.data, None
    if data.subset is not None:
        from vitscale.data.carve import subset
        from vitscale.data.format import read_meta

        carve = subset(data.subset, read_meta(data.url, endpoint_url=data.endpoint_url).samples(data.split), data.seed)
    return TrainJob(model=config.model, data=data, train=config.train, use_gpu=config.cluster.use_gpu,
                    carve=carve, config_yaml=to_yaml(config))


def run_pretrain(config: PipelineConfig, context: StageContext) -> Pretrained:
    from vitscale.launch.ray_train import launch_training
    from vitscale.launch.run_place import run_place

    checkpoint, metrics = launch_training(pretraining_job(config), config.cluster,
                                          run_place(config.cluster, config.run_name), what="pre-training")
    return Pretrained(checkpoint=checkpoint, metrics=metrics)


STAGE = Stage(
    name="pretrain",
    sections={"model": ModelConfig, "data": DataConfig, "train": TrainConfig},
    check=check_pretrain,
    prepare=prepare_pretrain,
    run=run_pretrain,
    produces=Pretrained,
)
