"""Runs a pipeline's stages in order: prepare data, pre-train, probe, ... and prints a summary.

Everything that can be wrong with a pipeline (config, model name, missing or inconsistent data) is
checked here, on the driver, before a single Ray worker starts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from vitscale.config.loader import to_yaml
from vitscale.config.schema import PipelineConfig, SourceConfig

PIPELINES_DIR = Path(__file__).resolve().parents[2] / "pipelines"
# Stages the schema knows but whose runners come with later work (fine-tuning, sweeps, study)
# are refused on the driver before anything starts.
RUNNABLE_STAGES = ("pretrain", "fewshot")


def resolve_pipeline_path(name_or_path: str) -> Path:
    """A pipeline file from a path, or a name under pipelines/ (e.g. "pretrain", "recipes/jft-vit-l16")."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    for root in (Path.cwd() / "pipelines", PIPELINES_DIR):
        for candidate in (root / name_or_path, root / f"{name_or_path}.yaml", root / "recipes" / f"{name_or_path}.yaml"):
            if candidate.is_file():
                return candidate
    available = sorted(str(p.relative_to(PIPELINES_DIR).with_suffix("")) for p in PIPELINES_DIR.rglob("*.yaml"))
    raise FileNotFoundError(f"no pipeline file {name_or_path!r}; pipelines shipped: {', '.join(available)}")


def ensure_dataset(url: str, source: SourceConfig | None, endpoint_url: str | None, what: str) -> dict[str, Any]:
    """The dataset's metadata; writes it first from `source` when absent and a source is given."""
    from vitscale.data.shards import write_dataset
    from vitscale.data.storage import open_storage

    storage = open_storage(url, endpoint_url=endpoint_url)
    if storage.exists("dataset.json"):
        return json.loads(storage.read_bytes("dataset.json"))
    if source is None:
        raise FileNotFoundError(f"{what}: no dataset at {url} (no dataset.json); write one with "
                                f"`vitscale shards write --source ... --out {url}`")
    print(f"[vitscale] writing {source.kind} dataset to {url}", flush=True)
    options: dict[str, Any] = {}
    if source.kind == "synthetic":
        options = {"count": source.count, "classes": source.classes, "image_size": source.image_size,
                   "multi_label": source.multi_label}
    return write_dataset(source.kind, url, shard_size=source.shard_size, max_side=source.max_side,
                         quality=source.quality, seed=0, splits=dict(source.splits), source_options=options,
                         endpoint_url=endpoint_url)


def preflight(config: PipelineConfig) -> dict[str, Any]:
    """Check everything a worker would trip over, on the driver; returns dataset facts."""
    import torch

    from vitscale.data.stream import open_dataset
    from vitscale.models import create_model
    from vitscale.train.optim import derive_batch

    facts: dict[str, Any] = {}
    missing = [s for s in config.stages if s not in RUNNABLE_STAGES]
    if missing:
        raise ValueError(f"stages: {missing} cannot run in this version of vitscale "
                         f"(runnable: {list(RUNNABLE_STAGES)})")
    stages = list(config.stages)
    if "fewshot" in stages and ("pretrain" not in stages or stages.index("pretrain") > stages.index("fewshot")):
        raise ValueError("stages: fewshot probes the model the pretrain stage makes; put pretrain before it")
    if "pretrain" in config.stages:
        meta = ensure_dataset(config.data.url, config.data.create_if_missing, config.data.endpoint_url, "data.url")
        if config.data.split not in meta["splits"]:
            raise ValueError(f"data.split: {config.data.split!r} is not in {config.data.url} "
                             f"(splits: {sorted(meta['splits'])})")
        open_dataset(config.data.url, config.data.split, endpoint_url=config.data.endpoint_url)  # raises on a bad manifest
        derive_batch(config.train.global_batch, config.train.micro_batch, config.cluster.num_workers)
        with torch.device("meta"):  # builds nothing real: checks the name and overrides instantly
            create_model(config.model.name, num_classes=meta["num_classes"], img_size=config.model.img_size,
                         **config.model.overrides())
        facts["pretrain_classes"] = meta["num_classes"]
    if "fewshot" in config.stages:
        for i, url in enumerate(config.eval.datasets):
            meta = ensure_dataset(url, config.eval.create_if_missing if i == 0 else None,
                                  config.data.endpoint_url, f"eval.datasets[{i}]")
            if meta.get("multi_label"):
                raise ValueError(f"eval.datasets[{i}]: {url} is multi-label; the few-shot probe needs one "
                                 "label per image")
            for split in (config.eval.train_split, config.eval.test_split):
                if split not in meta["splits"]:
                    raise ValueError(f"eval.datasets[{i}]: {url} has no split {split!r} (has {sorted(meta['splits'])})")
    return facts


def with_absolute_paths(config: PipelineConfig) -> PipelineConfig:
    """Local paths made absolute on the driver: Ray workers run in a directory of their own."""
    from dataclasses import replace

    def absolute(url: str) -> str:
        return url if "://" in url or not url else str(Path(url).expanduser().resolve())

    return replace(
        config,
        data=replace(config.data, url=absolute(config.data.url)),
        eval=replace(config.eval, datasets=tuple(absolute(u) for u in config.eval.datasets)),
        finetune=replace(config.finetune, dataset=absolute(config.finetune.dataset)),
        cluster=replace(config.cluster, storage_path=absolute(config.cluster.storage_path)),
    )


def run_pipeline(config: PipelineConfig, *, address: str | None = None) -> dict[str, Any]:
    """Run every stage of `config`; returns the summary printed as the final JSON line."""
    from vitscale.launch.ray_train import ensure_ray, launch_pretrain, run_directory

    t0 = time.time()
    config = with_absolute_paths(config)
    preflight(config)
    _, run_name, run_dir = run_directory(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    print(f"[vitscale] run directory: {run_dir}", flush=True)
    print(f"[vitscale] {ensure_ray(address or config.cluster.address, config.cluster.local_num_cpus)}", flush=True)

    summary: dict[str, Any] = {"pipeline": config.name, "run": run_name, "run_dir": str(run_dir), "ok": True}
    checkpoint = None
    for stage in config.stages:
        print(f"[vitscale] stage {stage}", flush=True)
        if stage == "pretrain":
            result = launch_pretrain(config)
            checkpoint = result["checkpoint"]
            summary["pretrain"] = {**result["summary"], "checkpoint": checkpoint.path if checkpoint else None}
        elif stage == "fewshot":
            summary["fewshot"] = _run_fewshot_stage(config, checkpoint)
    summary["seconds"] = round(time.time() - t0, 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _run_fewshot_stage(config: PipelineConfig, checkpoint: Any) -> dict[str, Any]:
    """Few-shot linear probes of the pre-trained model, in a Ray task sized like one worker."""
    import ray

    from vitscale.config.loader import to_dict

    if checkpoint is None:
        raise ValueError("stages: fewshot needs a pretrain stage before it (no checkpoint to probe)")
    cpus = min(config.cluster.cpus_per_worker, float(ray.cluster_resources().get("CPU", 1)))
    task = ray.remote(num_cpus=cpus, num_gpus=1 if config.cluster.use_gpu else 0)(_probe)
    return ray.get(task.remote(to_dict(config), checkpoint))


def _probe(config_dict: dict[str, Any], checkpoint: Any) -> dict[str, Any]:
    """Runs in the Ray task: fetch the checkpoint (a no-op on a shared filesystem) and probe it."""
    from vitscale.launch.export import probe_checkpoint

    with checkpoint.as_directory() as directory:
        return probe_checkpoint(config_dict, directory)
