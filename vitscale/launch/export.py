"""From a run's checkpoint to one fp32 model: `vitscale export`, and the probe stage's model.

A training checkpoint is DeepSpeed's sharded state plus vitscale's resolved config. Consolidation
gathers the ZeRO shards into one fp32 state dict (offline, no process group), rebuilds the model
the config names, and loads the weights strictly, so an export is exactly what was trained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from vitscale.config.loader import build_pipeline
from vitscale.config.schema import PipelineConfig
from vitscale.train import checkpoint as ckpt


def find_checkpoint(path: str | Path) -> Path:
    """`path` itself if it is a checkpoint, else the newest complete `checkpoint_*` inside it."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such run or checkpoint directory")
    info = ckpt.manifest_info(path)
    if info is not None:
        problems = ckpt.check_complete(path, info[1])
        if problems:
            raise ValueError(f"{path} is an incomplete checkpoint:\n  " + "\n  ".join(problems))
        return path
    candidates = [p for p in path.glob("checkpoint_*") if p.is_dir()]
    if not candidates:
        raise FileNotFoundError(f"{path}: no checkpoint_* directories (is it a vitscale run directory?)")
    found = ckpt.latest_complete(candidates)
    if found is None:
        raise ValueError(f"{path}: none of its {len(candidates)} checkpoints is complete")
    return found


def model_from_checkpoint(checkpoint: str | Path) -> tuple[torch.nn.Module, PipelineConfig, dict[str, Any]]:
    """(model with the trained fp32 weights, the run's config, facts) from a training checkpoint."""
    from vitscale.models import create_model
    from vitscale.train.engine import consolidated_state_dict

    checkpoint = Path(checkpoint)
    config = build_pipeline(yaml.safe_load((checkpoint / "config.yaml").read_text()), str(checkpoint / "config.yaml"))
    state = consolidated_state_dict(checkpoint / ckpt.DEEPSPEED_DIR, ckpt.DEEPSPEED_TAG)
    num_classes = int(state["head.weight"].shape[0])
    model = create_model(config.model.name, num_classes=num_classes, img_size=config.model.img_size,
                         **config.model.overrides())
    model.load_state_dict(state, strict=True)
    facts = {"model": config.model.name, "num_classes": num_classes, "img_size": config.model.img_size,
             "step": ckpt.read_train_state(checkpoint).step, "checkpoint": str(checkpoint)}
    return model, config, facts


def export_run(run_dir: str | Path, out: str | Path, *, fmt: str = "pt") -> dict[str, Any]:
    """Write the run's latest complete checkpoint as one fp32 file that `load_pretrained` reads."""
    from vitscale.models.checkpoints import export_npz, export_state_dict
    from vitscale.models.factory import model_meta

    checkpoint = find_checkpoint(run_dir)
    model, config, facts = model_from_checkpoint(checkpoint)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "npz":
        export_npz(model, out)
    elif fmt == "pt":
        export_state_dict(model, out, meta=model_meta(model))  # `create_from_checkpoint` rebuilds from it
    else:
        raise ValueError(f"--format: must be pt or npz, got {fmt!r}")
    return {**facts, "out": str(out), "format": fmt}


def probe_checkpoint(config_dict: dict[str, Any], checkpoint: str) -> dict[str, Any]:
    """The fewshot stage: consolidate the checkpoint and run the few-shot probes (runs in a Ray task)."""
    from vitscale.eval.probe import fewshot_probe

    from vitscale.models import create_model

    config = build_pipeline(config_dict)
    model, _, facts = model_from_checkpoint(checkpoint)
    results = {"checkpoint_step": facts["step"], **fewshot_probe(model, config.eval,
                                                                 endpoint_url=config.data.endpoint_url)}
    if config.eval.baseline:
        # The same architecture with the initial weights the run started from (same seed): what the
        # probe gets from random features, so the summary shows what pre-training added.
        torch.manual_seed(config.train.seed)
        untrained = create_model(config.model.name, num_classes=facts["num_classes"],
                                 img_size=config.model.img_size, **config.model.overrides())
        results["untrained_baseline"] = fewshot_probe(untrained, config.eval, endpoint_url=config.data.endpoint_url)
    return results
