"""Masked patch pre-training resized, without Ray: the real loop in separate processes over gloo, real
DeepSpeed ZeRO 2, a tiny ViT, a global batch of 16, images without labels.

    world 1: the reference, 4 steps
    world 3: uneven shares (5, 5, 6 of 16), checkpoints after steps 2 and 4
    world 2: resumed from world 3's step-2 checkpoint (resharded: the [mask] embedding and the prediction
             head regrouped with the encoder), on to step 4

The corrupted patches are a pure function of (seed, epoch, sample key), so every run corrupts the same
patches of the same samples at every step, and all three reach the same weights and losses within the
fp32 rounding that summing in another order costs (test_uneven_shares.py measures it: ~2e-6), except the
attention's key bias, whose gradient is zero in exact arithmetic (measured here: 9e-5 apart, Adam's
normalised rounding noise; the test bounds it by the learning rate times the steps).

Launched as a worker: `python tests/test_masked_patch_elastic.py OUT DATA [RESUME]` with RANK / WORLD_SIZE set.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.gloo_ranks import launch_ranks
from helpers.loop_runs import steps

STEPS = 4
TOLERANCE = 2e-5


def _job(data: str) -> Any:
    from vitscale.stages import build_pipeline
    from vitscale.stages.pretrain import pretraining_job

    return pretraining_job(build_pipeline({
        "model": {"name": "ViT-Ti/4", "img_size": 16, "depth": 2, "width": 32, "mlp_dim": 64, "heads": 2},
        "data": {"url": data, "num_workers": 0, "shuffle_buffer": 64},
        "train": {"objective": "masked_patch", "global_batch": 16, "micro_batch": 4, "max_steps": STEPS,
                  "warmup_steps": 1, "base_lr": 1e-3, "zero_stage": 2, "precision": "fp32", "checkpoint_every": 2,
                  "log_every": 1, "record_samples": True},
        "cluster": {"num_workers": [1, 3], "use_gpu": False},
    }))


def worker(out: Path, data: str, resume: str | None) -> None:
    from vitscale.train.loop import WorkerContext, train

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run = out / (f"w{world}" + ("-resumed" if resume else ""))

    def report(metrics: dict[str, Any], checkpoint_dir: Path | None) -> None:
        if checkpoint_dir is not None:  # every rank's files into one folder: the whole ZeRO checkpoint
            shutil.copytree(checkpoint_dir, run / f"checkpoint_{metrics['step']}", dirs_exist_ok=True)

    train(_job(data), WorkerContext(rank=rank, world_size=world, run_dir=run, report=report, elastic=True,
                                    resume_from=Path(resume) if resume else None))
    seen = [{k: row[k] for k in ("step", "loss", "patch_accuracy")} for row in steps(run, rank)]  # every step's
    (run / f"metrics-r{rank}.json").write_text(json.dumps(seen))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("deepspeed")
    import numpy as np
    from PIL import Image

    from vitscale.data.tools.write import write_dataset

    out = tmp_path_factory.mktemp("mpp-elastic")
    photos = out / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    for i in range(64):  # smooth colour fields: patches with neighbours worth predicting from
        base = rng.integers(0, 255, (2, 2, 3), dtype=np.uint8)
        Image.fromarray(base).resize((24, 24), Image.BILINEAR).save(photos / f"p{i:03d}.jpg")
    data = out / "images"
    write_dataset(f"folder:{photos}", str(data), shard_size=23, max_side=24, seed=0, progress=False)
    launch_ranks(__file__, out, 1, str(out), str(data))
    launch_ranks(__file__, out, 3, str(out), str(data))
    launch_ranks(__file__, out, 2, str(out), str(data), str(out / "w3" / "checkpoint_2"))
    return out


def _steps(run: Path, world: int) -> dict[int, list[str]]:
    """Per step, the keys of all ranks together (the last line of a step wins, as after a resume)."""
    steps: dict[int, list[list[str]]] = {}
    for rank in range(world):
        for line in (run / "samples" / f"rank{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], [[] for _ in range(world)])[rank] = record["keys"]
    return {step: [k for keys in ranks for k in keys] for step, ranks in steps.items()}


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from vitscale.train.engine import consolidated_state_dict

    return consolidated_state_dict(checkpoint / "deepspeed", "state")


@pytest.mark.slow
def test_a_resized_masked_patch_run_ends_where_a_fixed_one_does(runs: Path) -> None:
    one, three, resumed = runs / "w1", runs / "w3", runs / "w2-resumed"
    reference = _steps(one, 1)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert _steps(three, 3) == reference  # the same samples in the same order at every step
    assert {s: k for s, k in _steps(resumed, 2).items() if s > 2} == {s: k for s, k in reference.items() if s > 2}
    a = _weights(one / "checkpoint_4")
    for other in (three / "checkpoint_4", resumed / "checkpoint_4"):
        b = _weights(other)
        assert a.keys() == b.keys() and {"mask_token", "head.weight", "encoder.cls_token"} <= a.keys()
        diff = {k: (a[k] - b[k]).detach().abs() for k in a}
        keys = [k for k in a if k.endswith("attn.qkv.bias")]
        for k in keys:
            # The key bias adds q . b_k to every score of a query's row, which the softmax ignores: its gradient
            # is 0 in exact arithmetic, so Adam normalises pure rounding noise into steps of up to the LR.
            assert float(diff[k][32:64].max()) <= 1e-3 * STEPS  # base_lr x steps
            diff[k] = torch.cat([diff[k][:32], diff[k][64:]])
        worst = max(float(d.max()) for d in diff.values())
        assert worst < TOLERANCE, f"{other}: largest weight difference {worst}"
    metrics = {run.name: json.loads((run / "metrics-r0.json").read_text()) for run in (one, three, resumed)}
    by_step = {name: {m["step"]: m for m in rows} for name, rows in metrics.items()}
    for step in (3, 4):
        ref = by_step["w1"][step]
        for name in ("w3", "w2-resumed"):
            assert by_step[name][step]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
            assert by_step[name][step]["patch_accuracy"] == pytest.approx(ref["patch_accuracy"], abs=1 / 128)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
