"""The finetune stage: one fine-tuning run on the whole training split, tested once (App. B.1.1).

Starts from the pretrain stage's model or from `finetune.checkpoint` (a run directory, a vitscale
export, an official .npz or a timm state dict), drops the pre-training head and pre-logits,
attaches a zero-initialised D x K head and resamples the position embeddings to
`finetune.resolution`. Runs on Ray Train through the same loop as pre-training. The learning rate
is `finetune.base_lr`; choosing it on a dev split is the sweep stage's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitscale.config.checks import ConfigError, check
from vitscale.config.loader import build_section, to_yaml
from vitscale.config.pipeline import PipelineConfig, local_cluster
from vitscale.data.config import DataConfig
from vitscale.eval.finetune import FinetuneConfig, final_job, finetune_model
from vitscale.models.config import ModelConfig
from vitscale.stages.base import Pretrained, Stage, StageContext
from vitscale.stages.datasets import ensure_dataset, require_split


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


def check_finetune(config: PipelineConfig) -> None:
    fc = config.finetune
    check(bool(fc.dataset), "finetune.dataset", "the finetune stage needs a downstream dataset")
    check(fc.checkpoint is not None or pretrained_earlier(config, "finetune"), "finetune.checkpoint",
          "nothing to fine-tune: set it, or put the pretrain stage before finetune")
    check(fc.single_lr() is not None, "finetune.base_lr",
          f"the finetune stage trains one learning rate; set it, or let the sweep stage select one of "
          f"{list(fc.grid())} on the dev split")
    if fc.checkpoint is None:
        # The pre-trained architecture at the fine-tuning resolution: a size its patches cannot tile
        # would fail only after pre-training. (A checkpoint file names its own architecture:
        # `check_checkpoint` builds that one.)
        try:
            finetune_model(config.model, fc.resolution).validate()
        except ConfigError as exc:
            raise ConfigError("finetune.resolution", f"({fc.resolution}) does not fit {config.model.name}: "
                                                     f"{exc.message}") from None
    per_step = fc.micro_batch * config.cluster.num_workers
    check(fc.batch % per_step == 0, "finetune.batch",
          f"({fc.batch}) must be a multiple of finetune.micro_batch x cluster.num_workers = {per_step}")


def check_downstream(config: PipelineConfig, key: str = "finetune") -> Any:
    """The downstream dataset: single-label, both splits, the dev carve and its rest non-empty, a step fillable."""
    from vitscale.data.carve import Carve
    from vitscale.data.format import open_dataset

    fc = config.finetune
    meta = ensure_dataset(fc.dataset, fc.create_if_missing, config.data.endpoint_url, f"{key}.dataset")
    check(not meta.multi_label, f"{key}.dataset", f"{fc.dataset} is multi-label; fine-tuning needs one label per image")
    train = require_split(meta, fc.train_split, f"{key}.train_split", fc.dataset)
    require_split(meta, fc.test_split, f"{key}.test_split", fc.dataset)
    world = config.cluster.num_workers
    per_rank = fc.batch // world
    check(train // world >= per_rank, f"{key}.batch",
          f"({fc.batch}) cannot be filled: split {fc.train_split!r} of {fc.dataset} has {train} samples")
    carve = Carve(fc.dev_share(), fc.dev_seed, "dev")
    dev = sum(open_dataset(fc.dataset, fc.train_split, endpoint_url=config.data.endpoint_url, carve=carve).counts)
    check(dev >= 1, f"{key}.dev_fraction",
          f"a dev share of {fc.dev_share()} of {train} samples is empty; the dataset is too small for the dev split")
    check((train - dev) // world >= per_rank, f"{key}.batch",
          f"({fc.batch}) cannot be filled from the {train - dev} samples left after the dev split")
    return meta


def check_checkpoint(config: PipelineConfig, num_classes: int) -> None:
    """A given checkpoint exists and fits the architecture it will be loaded into."""
    fc = config.finetune
    if fc.checkpoint is None:
        return
    path = Path(fc.checkpoint)
    if path.is_dir():
        from vitscale.train.export import find_checkpoint

        try:
            _model_of_run(find_checkpoint(path))
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError("finetune.checkpoint", str(exc)) from None
        return
    from vitscale.models.checkpoints import load_pretrained

    try:
        model = finetune_model(_model_of_file(path, config.model), fc.resolution).build(num_classes)
        load_pretrained(model, path)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError("finetune.checkpoint", str(exc)) from None


def prepare_finetune(config: PipelineConfig) -> None:
    from vitscale.train.resume import FINETUNE_SCOPE, refuse_changed_run_in

    meta = check_downstream(config)
    check_checkpoint(config, meta.num_classes)
    # A re-run resumes the fine-tuning run of the same name: refuse a changed recipe before Ray starts.
    refuse_changed_run_in(config.cluster.run_storage(finetune_run_name(config)), to_yaml(config), FINETUNE_SCOPE,
                          config.cluster.num_workers)


def finetune_run_name(config: PipelineConfig) -> str:
    """The fine-tuning run's name: the pipeline's run name + "-finetune"."""
    return f"{config.run_name}-finetune"


def _model_of_run(checkpoint_dir: Path) -> ModelConfig:
    import yaml

    raw = yaml.safe_load((Path(checkpoint_dir) / "config.yaml").read_text()) or {}
    return build_section(ModelConfig, raw.get("model"), "model")


def _model_of_file(path: Path, fallback: ModelConfig) -> ModelConfig:
    """A vitscale export names its architecture; .npz and timm files use the pipeline's `model:` section."""
    from vitscale.models.checkpoints import read_checkpoint

    _, _, meta = read_checkpoint(path)
    if not meta:
        return fallback
    return build_section(ModelConfig, {"name": meta["name"], "img_size": meta["img_size"],
                                       **(meta.get("overrides") or {})}, "model")


def initial_weights(config: PipelineConfig, context: StageContext) -> tuple[ModelConfig, str]:
    """(the pre-trained architecture, a weights file every worker loads) for fine-tuning.

    A training checkpoint (the pretrain stage's, or a run directory) is consolidated once, here,
    into one fp32 export in the run directory; files are used as they are.
    """
    from vitscale.train.export import export_run, find_checkpoint

    fc = config.finetune
    out = context.run_dir / "finetune-init.pt"
    if fc.checkpoint is None:
        with context.need(Pretrained).checkpoint.as_directory() as directory:
            export_run(directory, out)
        return config.model, str(out)
    path = Path(fc.checkpoint)
    if path.is_dir():
        checkpoint = find_checkpoint(path)
        export_run(checkpoint, out)
        return _model_of_run(checkpoint), str(out)
    return _model_of_file(path, config.model), str(path)


def run_finetune(config: PipelineConfig, context: StageContext) -> Finetuned:
    from vitscale.launch.ray_train import launch_training

    fc = config.finetune
    model, init = initial_weights(config, context)
    lr = fc.single_lr()
    if lr is None:  # check_finetune refuses such a pipeline when it is loaded
        raise RuntimeError("finetune.base_lr is not set")
    job = final_job(fc, finetune_model(model, fc.resolution), init, lr, use_gpu=config.cluster.use_gpu,
                    endpoint_url=config.data.endpoint_url, config_yaml=to_yaml(config))
    name = finetune_run_name(config)
    checkpoint, metrics = launch_training(job, config.cluster, name, context.run_dir / "finetune", what="fine-tuning")
    return Finetuned(checkpoint=checkpoint, base_lr=lr, metrics=metrics)


def finetune_pipeline(checkpoint: str, dataset: str, *, preset: str | None = None, base_lr: float | None = None,
                      model: str | None = None, img_size: int | None = None, resolution: int | None = None,
                      steps: int | None = None, local: bool = False) -> dict[str, Any]:
    """The pipeline `vitscale finetune CHECKPOINT --data SHARDS` runs, as plain data (`--set` refines it).

    `local`: on a Ray started on this machine, the cluster is this machine (a worker per GPU, or one
    CPU worker with every core) and, without a GPU, fp32 (bf16 matmuls crawl on most CPUs).
    """
    name = Path(dataset.rstrip("/")).name or "dataset"
    finetune: dict[str, Any] = {"dataset": dataset, "checkpoint": checkpoint}
    for key, value in (("preset", preset), ("base_lr", base_lr), ("resolution", resolution), ("steps", steps)):
        if value is not None:
            finetune[key] = value
    raw: dict[str, Any] = {"name": f"finetune-{name}", "stages": ["finetune"], "finetune": finetune}
    if local:
        raw["cluster"] = local_cluster()
        if not raw["cluster"]["use_gpu"]:
            finetune["precision"] = "fp32"
    if model is not None:
        raw["model"] = {"name": model, **({"img_size": img_size} if img_size else {})}
    return raw


STAGE = Stage(
    name="finetune",
    sections={"finetune": FinetuneConfig, "model": ModelConfig, "data": DataConfig},
    check=check_finetune,
    prepare=prepare_finetune,
    run=run_finetune,
    produces=Finetuned,
)
