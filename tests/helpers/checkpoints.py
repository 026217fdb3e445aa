"""A complete checkpoint folder (every rank's part and manifest) for tests of checkpoint discovery."""

from __future__ import annotations

from pathlib import Path

from vitscale.train import checkpoint as ckpt


def complete_checkpoint(directory: Path, step: int, world_size: int = 2) -> Path:
    """`directory` as a complete checkpoint of `step` written by `world_size` ranks (a 10-byte payload)."""
    directory.mkdir(parents=True)
    (directory / "payload.bin").write_bytes(b"x" * 10)
    for rank in range(world_size):
        ckpt.write_rank_part(directory, rank=rank, stream_state={"epoch": 0, "position": step, "seed": 0},
                             train_state=ckpt.TrainState(step=step, world_size=world_size), config_yaml="")
    return directory
