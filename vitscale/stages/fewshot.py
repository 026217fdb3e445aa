"""The fewshot stage: closed-form few-shot linear probes (Sec. 4.1) of the pre-trained model.

Needs `Pretrained` from an earlier stage; probes every dataset of the `fewshot:` section in a Ray
task sized like one training worker (it reads the checkpoint wherever it lives, S3 included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vitscale.config.checks import check
from vitscale.config.pipeline import PipelineConfig
from vitscale.data.config import DataConfig
from vitscale.eval.config import FewshotConfig
from vitscale.models.config import ModelConfig
from vitscale.stages.base import Pretrained, Stage, StageContext
from vitscale.stages.datasets import ensure_dataset


@dataclass(frozen=True)
class FewshotResult:
    """Accuracies per dataset and shot count (and of the untrained baseline when asked for)."""

    probes: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        return dict(self.probes)

    def rows(self) -> list[tuple[str, str]]:
        baseline = self.probes.get("untrained_baseline") or {}
        rows = []
        for url, per_shot in self.probes.items():
            if not isinstance(per_shot, dict) or url == "untrained_baseline":
                continue
            shots = [k for k in per_shot if k.endswith("shot")]  # "5shot": the mean over seeds
            text = "  ".join(f"{k} {per_shot[k]:.3f}"
                             + (f"±{per_shot[k + '_std']:.3f}" if k + "_std" in per_shot else "") for k in shots)
            if isinstance(baseline.get(url), dict):
                text += "   untrained: " + "  ".join(f"{k} {baseline[url][k]:.3f}" for k in shots)
            seeds = self.probes.get("seeds")
            spread = f"   ({len(seeds)} seeds)" if isinstance(seeds, list) else ""
            rows.append((url.rstrip("/").rsplit("/", 1)[-1], f"{text}   chance {per_shot['chance']:.3f}{spread}"))
        return rows


def check_fewshot(config: PipelineConfig) -> None:
    """Something to probe, at a resolution the pre-trained model takes."""
    fewshot, model = config.fewshot, config.model
    check(len(fewshot.datasets) > 0, "fewshot.datasets", "the fewshot stage needs at least one dataset")
    from vitscale.models.variants import parse_model_name

    # ViT position embeddings are built for model.img_size; the probe does not resample them.
    if parse_model_name(model.name).family != "resnet":
        check(fewshot.resolution == model.img_size, "fewshot.resolution",
              f"({fewshot.resolution}) must equal model.img_size ({model.img_size}) for {model.name}")


def prepare_fewshot(config: PipelineConfig) -> None:
    """Every probe dataset exists, is single-label, has both splits, and can supply the shots
    (`check_probe_dataset`: the same checks as `vitscale fewshot`)."""
    from vitscale.eval.probe import check_probe_dataset, check_shots_per_class

    fewshot = config.fewshot
    for i, url in enumerate(fewshot.datasets):
        key = f"fewshot.datasets[{i}]"
        meta = ensure_dataset(url, fewshot.create_if_missing if i == 0 else None, config.data.endpoint_url, key)
        check_probe_dataset(meta, url, fewshot, key)
        check_shots_per_class(url, meta.num_classes, fewshot, config.data.endpoint_url)


def run_fewshot(config: PipelineConfig, context: StageContext) -> FewshotResult:
    import ray

    checkpoint = context.need(Pretrained).checkpoint
    cpus = min(config.cluster.cpus_per_worker, float(ray.cluster_resources().get("CPU", 1)))
    task = ray.remote(num_cpus=cpus, num_gpus=1 if config.cluster.use_gpu else 0)(_probe_task)
    return FewshotResult(ray.get(task.remote(config, checkpoint)))


def _probe_task(config: PipelineConfig, checkpoint: Any) -> dict[str, Any]:
    """In the Ray task: fetch the checkpoint (a no-op on a shared filesystem), probe it."""
    with checkpoint.as_directory() as directory:
        return probe_checkpoint(config, directory)


def probe_checkpoint(config: PipelineConfig, checkpoint: str) -> dict[str, Any]:
    """Consolidate a training checkpoint and probe it (and, if asked, the same net untrained)."""
    import torch

    from vitscale.eval.probe import fewshot_probe
    from vitscale.train.export import model_from_checkpoint

    model, run_model, facts = model_from_checkpoint(checkpoint)
    endpoint = config.data.endpoint_url
    results = {"checkpoint_step": facts["step"], **fewshot_probe(model, config.fewshot, endpoint_url=endpoint)}
    if config.fewshot.baseline:
        # The same architecture with the initial weights the run started from (same seed): what the
        # probe gets from random features, so the summary shows what pre-training added.
        torch.manual_seed(facts["seed"])
        untrained = run_model.build(facts["num_classes"])
        results["untrained_baseline"] = fewshot_probe(untrained, config.fewshot, endpoint_url=endpoint)
    return results


STAGE = Stage(
    name="fewshot",
    sections={"fewshot": FewshotConfig, "model": ModelConfig, "data": DataConfig},
    check=check_fewshot,
    prepare=prepare_fewshot,
    run=run_fewshot,
    needs=(Pretrained,),
    produces=FewshotResult,
)
