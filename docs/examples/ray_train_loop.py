"""Your own Ray Train loop on vitscale shards: plain PyTorch, DDP, exact resume of the data stream.

vitscale's pipelines run their own loop (DeepSpeed, the paper's schedule); this is for a loop of
yours. It uses three pieces of vitscale's API (docs/api.md): `create_model` (a timm name works),
`ShardDataset` (each rank's share of each epoch as a torch IterableDataset) and the batch's
`state`, saved with each checkpoint so a restarted run reads exactly the samples that were left.

    vitscale shards write --source synthetic --out data/synthetic          # or a DatasetWriter
    python docs/examples/ray_train_loop.py --data data/synthetic --workers 2 --steps 20

Without a Ray address this starts a local Ray; `RAY_ADDRESS=... python ...` joins a cluster (the
shards and --storage must then be where every node can read them: s3:// or a shared mount).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch
import torch.nn.functional as F
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model
from torch.utils.data import DataLoader

import vitscale
from vitscale.data import ShardDataset


def to_input(hwc: np.ndarray) -> torch.Tensor:
    """The transform hook: a uint8 (R, R, 3) crop -> float (3, R, R) in [-1, 1], as the ViT paper's."""
    return torch.from_numpy(hwc).permute(2, 0, 1).float().div(127.5).sub(1.0)


def train_loop(config: dict[str, Any]) -> None:
    """What each Ray Train worker runs."""
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    data = ShardDataset(config["data"], "train", batch_size=config["batch"], resolution=config["resolution"],
                        rank=rank, world_size=world, seed=config["seed"], transform=to_input)
    torch.manual_seed(config["seed"])  # every rank builds the same initial weights
    model = vitscale.create_model(config["model"], num_classes=data.num_classes, img_size=config["resolution"],
                                  **config["model_options"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=0.05)
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # a restart: weights, optimizer, step and the stream position
        with checkpoint.as_directory() as folder:
            # Tensors and plain data only: a checkpoint from elsewhere can never run pickled code here.
            state = torch.load(Path(folder) / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        data.load_state_dict(state["data"][rank])
    weights = model  # the plain module: what the checkpoint holds, without DDP's "module." prefix
    model = prepare_model(model)  # DDP (gloo on CPU, NCCL on GPUs)
    loader = DataLoader(data, batch_size=None, num_workers=config["loader_workers"])  # whole batches
    epoch = data.state_dict()["epoch"]
    while step < config["steps"]:
        for batch in loader:
            loss = F.cross_entropy(model(batch["image"]), batch["label"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            metrics = {"step": step, "loss": float(loss), "epoch": epoch}
            if step % config["checkpoint_every"] and step < config["steps"]:
                ray.train.report(metrics)
            else:
                # Every rank's stream position goes into the one checkpoint rank 0 writes.
                positions: list[dict[str, int]] = [{}] * world
                torch.distributed.all_gather_object(positions, batch["state"])
                with tempfile.TemporaryDirectory() as folder:
                    saved = None
                    if rank == 0:
                        torch.save({"model": weights.state_dict(), "optimizer": optimizer.state_dict(),
                                    "step": step, "data": positions}, Path(folder) / "state.pt")
                        saved = Checkpoint.from_directory(folder)
                    ray.train.report(metrics, checkpoint=saved)
            if step >= config["steps"]:
                break
        else:  # the epoch ran out: the next one, reshuffled (as DistributedSampler.set_epoch)
            epoch += 1
            data.set_epoch(epoch)


def main(argv: list[str] | None = None) -> ray.train.Result:
    p = argparse.ArgumentParser(description="Your own Ray Train loop on vitscale shards.")
    p.add_argument("--data", required=True, help="vitscale shards: a folder or s3://bucket/prefix")
    p.add_argument("--model", default="vit_tiny_patch16_224", help="a vitscale or timm model name")
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="per worker")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--loader-workers", type=int, default=0, help="DataLoader processes per Ray worker")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--storage", default=str(Path("runs").resolve()), help="where Ray keeps checkpoints")
    p.add_argument("--name", default="my-loop")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--depth", type=int, default=None, help="a smaller model than the name's (CPU trials)")
    p.add_argument("--width", type=int, default=None)
    args = p.parse_args(argv)
    options = {k: v for k, v in {"depth": args.depth, "width": args.width}.items() if v is not None}
    if args.width is not None:
        options.update(mlp_dim=4 * args.width, heads=max(1, args.width // 64))
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"data": args.data if args.data.startswith("s3://") else os.path.abspath(args.data),
                           "model": args.model, "model_options": options, "resolution": args.resolution,
                           "batch": args.batch, "steps": args.steps, "lr": args.lr, "seed": args.seed,
                           "loader_workers": args.loader_workers, "checkpoint_every": args.checkpoint_every},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=RunConfig(name=args.name, storage_path=args.storage),
    )
    result = trainer.fit()
    print(f"final metrics: {result.metrics}; checkpoint: {result.checkpoint}")
    return result


if __name__ == "__main__":
    main()
