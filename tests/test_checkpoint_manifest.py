"""A checkpoint is used only when every rank's manifest is there and its files match them."""

from __future__ import annotations

from pathlib import Path

from vitscale.train.checkpoint import TrainState, check_complete, latest_complete, manifest_info, write_rank_part


def write_checkpoint(directory: Path, step: int, world_size: int = 2) -> Path:
    directory.mkdir(parents=True)
    for rank in range(world_size):
        (directory / f"shard-{rank}.bin").write_bytes(bytes([rank]) * 1000)
    for rank in range(world_size):
        # Each rank's manifest covers what is in the folder when it writes (in a run: its own folder).
        write_rank_part(directory, rank=rank, stream_state={"epoch": 0, "position": step, "seed": 0},
                        train_state=TrainState(step=step, world_size=world_size), config_yaml="name: x\n")
    return directory


def test_complete_checkpoint_passes(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "checkpoint_000000004", 4)
    assert check_complete(ckpt, 2) == []
    assert manifest_info(ckpt) == (4, 2)


def test_missing_manifest_corrupt_file_and_wrong_world_size_are_named(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "c", 4)
    (ckpt / "MANIFEST-rank1.json").unlink()
    assert any("no manifest from rank 1" in p for p in check_complete(ckpt, 2))
    ckpt = write_checkpoint(tmp_path / "d", 4)
    data = bytearray((ckpt / "shard-0.bin").read_bytes())
    data[10] ^= 1  # same size, different bytes: only the hash sees it
    (ckpt / "shard-0.bin").write_bytes(bytes(data))
    assert any("SHA-256" in p for p in check_complete(ckpt, 2, hash_ranks={0}))
    assert check_complete(ckpt, 2, hash_ranks=set()) == []  # sizes alone cannot tell
    assert any("same number of workers" in p for p in check_complete(write_checkpoint(tmp_path / "e", 4), 3))


def test_latest_complete_skips_a_newer_incomplete_one(tmp_path: Path) -> None:
    old = write_checkpoint(tmp_path / "checkpoint_000000004", 4)
    new = write_checkpoint(tmp_path / "checkpoint_000000008", 8)
    assert latest_complete([old, new], 2) == new
    (new / "shard-1.bin").write_bytes(b"truncated")
    assert latest_complete([old, new], 2) == old
    assert latest_complete([old, new]) == old  # world size from the manifests (export's case)
