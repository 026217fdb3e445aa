"""Resume a DeepSpeed checkpoint on a different number of workers (ZeRO stages 0-3).

A ZeRO 1-3 checkpoint keeps the fp32 master weights and the Adam moments as flat partitions, one
file per data-parallel rank, cut for the world size that wrote it; DeepSpeed's own
`engine.load_checkpoint` refuses a different world size ("Automatic adjustment of ZeRO's optimizer
state partitioning with a new world size is not currently supported"). `load_resharded` goes
through DeepSpeed's universal checkpoint instead: a per-parameter layout that any world size can
partition again.

Files read (all under `<deepspeed_dir>/<tag>/`, the layout `engine.save_checkpoint` writes):

    mp_rank_00_model_states.pt                       stages 0-2: module weights, step counters, param shapes
    zero_pp_rank_{r}_mp_rank_00_model_states.pt      stage 3: the same, one per rank (param shapes per rank)
    zero_pp_rank_{r}_mp_rank_00_optim_states.pt      stages 1-3: rank r's flat fp32 partition and its
                                                     Adam exp_avg / exp_avg_sq, the per-group step,
                                                     and (stages 1-2) where each parameter sits in it

Every one of the `saved_world_size` ranks' optimizer files must be there: a missing shard is a
missing piece of every parameter, so it is refused, never treated as a smaller world.

What is preserved, per parameter by name: the fp32 master weights, Adam's exp_avg and exp_avg_sq
(bit for bit: the conversion only cuts and concatenates), each parameter group's step and
hyper-parameters, and the engine's global_steps / global_samples / skipped_steps counters. The
learning-rate scheduler is not (vitscale sets the learning rate itself from `lr_at(step)`), nor is
anything outside DeepSpeed's files (data-stream positions and RNG states are vitscale's per-rank
files: a new world size needs its own plan for those).

Route per stage:

    stage 0      every rank holds whole weights and whole optimizer state (the model-states file),
                 so DeepSpeed's own load works at any world size: nothing to convert.
    stages 1-3   `ds_to_universal` writes `zero/<param name>/{fp32,exp_avg,exp_avg_sq,step}.pt` into
                 scratch, and the engine's universal loading (`checkpoint.load_universal`) cuts this
                 rank's partition out of each whole parameter. At stage 3 DeepSpeed 0.19.8's loader
                 then gets the param groups wrong (see `_restore_stage3_groups`): put right here.

Tested (tests/test_reshard.py) for 2 -> 1, 1 -> 2 and 2 -> 3 workers at every stage in fp32, with bf16
at stages 1 and 3, and with CPU offload (DeepSpeedCPUAdam) at stages 2 and 3.

Every rank converts into its own scratch folder (`scratch/universal-rank{r}`) rather than rank 0
converting for all: the workers of a Ray Train run may sit on different nodes with no shared
scratch disk, and a conversion that only needs the checkpoint (which every rank can read) asks no
collective of anyone. The price is that each rank reads the whole checkpoint and writes about its
size into scratch once, on the rare resume that changes the world size; the folder is deleted after
the load. The conversion runs in this process, one shard at a time (no worker pool: a fork of a
process holding a process group is unsafe, and one order of work keeps it deterministic).

Every file DeepSpeed reads here, during the conversion and the load, is read with
`torch.load(weights_only=True)` (`engine.weights_only_loads`): a checkpoint is data, never code.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from vitscale.train.engine import convert_to_universal, load_checkpoint, weights_only_loads

UNIVERSAL_TAG = "universal"
"""The tag (folder name) the converted checkpoint gets inside this rank's scratch folder."""


def reshard_problem(zero_stage: int, saved_world_size: int, world_size: int) -> str | None:
    """Why a checkpoint of `zero_stage` written by `saved_world_size` workers cannot load at
    `world_size`; None when it can (pure: the question a resume asks before touching any file).

    The same world size always loads. Stage 0 loads at any world size (every rank saved and loads
    whole optimizer state); stages 1-3 reshard through DeepSpeed's universal checkpoint.
    """
    if zero_stage not in (0, 1, 2, 3):
        return f"ZeRO stage {zero_stage} is not one of 0, 1, 2, 3"
    if saved_world_size < 1 or world_size < 1:
        return f"world sizes must be positive (saved {saved_world_size}, now {world_size})"
    return None


def _saved_stage_kind(directory: Path) -> tuple[str, list[Path]]:
    """What the files of a saved checkpoint say about its ZeRO stage ("0", "1-2" or "3"), and its
    optimizer shards in rank order."""
    shards = sorted(directory.glob("*zero_pp_rank_*_optim_states.pt"),
                    key=lambda p: int(p.name.split("zero_pp_rank_")[1].split("_")[0]))
    if not shards:
        return "0", []
    if any(directory.glob("zero_pp_rank_*_model_states.pt")):
        return "3", shards
    return "1-2", shards


def _restore_stage3_groups(engine: Any, universal: Path) -> None:
    """Undo what DeepSpeed 0.19.8's ZeRO-3 universal load does wrong with more than one param group.

    `load_hp_checkpoint_state_from_checkpoint_dir_stage3` gives every group the hyper-parameters of
    group 0 (vitscale's no-decay group would get weight decay), and every group's state the same
    `step` tensor, which torch's Adam then increments in place once per group per step (the bias
    correction runs ahead). Each group gets its own saved hyper-parameters and its own step back.
    """
    import torch

    with weights_only_loads():
        state = torch.load(universal / "zero" / "optimizer_state.pt", weights_only=True, map_location="cpu")
    saved = state["optimizer_state_dict"]
    zero = engine.optimizer
    groups = zero.optimizer.param_groups
    if len(groups) != len(saved["param_groups"]):
        raise ValueError(f"{universal}: {len(saved['param_groups'])} optimizer param groups saved, "
                         f"the engine has {len(groups)}")
    for group, saved_group in zip(groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    for sub_group, flat in enumerate(zero.fp32_partitioned_groups_flat):
        saved_group = saved["param_groups"][zero.sub_group_to_group_id[sub_group]]
        # A group's flat partitions share its one step (DeepSpeed steps a group's sub-groups together).
        step = saved["state"][saved_group["params"][0]]["step"]
        zero.optimizer.state[flat]["step"] = step.clone() if isinstance(step, torch.Tensor) else step


def load_resharded(engine: Any, deepspeed_dir: str | os.PathLike[str], tag: str, saved_world_size: int, *,
                   scratch: Path) -> None:
    """Load the checkpoint `deepspeed_dir/tag` written by `saved_world_size` ranks into `engine`, which
    runs at whatever world size it was started with (a collective: every rank calls it).

    `scratch` is a folder this worker may write into (e.g. a temporary directory); the universal
    conversion goes into `scratch/universal-rank{r}` and is removed after the load. Raises
    `ValueError` when the files do not match the saved world size or the engine's ZeRO stage.
    """
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    stage = int(engine.zero_optimization_stage())
    problem = reshard_problem(stage, saved_world_size, world_size)
    if problem is not None:
        raise ValueError(f"{deepspeed_dir}: cannot load at {world_size} workers: {problem}")
    checkpoint = Path(deepspeed_dir) / tag
    kind, shards = _saved_stage_kind(checkpoint)
    expected = "0" if stage == 0 else "3" if stage == 3 else "1-2"
    if kind != expected:
        raise ValueError(f"{checkpoint}: written at ZeRO stage {kind}, this engine runs stage {stage}")
    if stage == 0 or saved_world_size == world_size:
        # Whole state on every rank (stage 0), or the partitions already fit: DeepSpeed's own load.
        load_checkpoint(engine, deepspeed_dir, tag)
        return
    if len(shards) != saved_world_size:
        raise ValueError(f"{checkpoint}: {len(shards)} ZeRO optimizer shards, expected one per saved rank "
                         f"({saved_world_size})")

    work = Path(scratch) / f"universal-rank{rank}"
    shutil.rmtree(work, ignore_errors=True)  # a conversion an earlier, killed attempt left half done
    try:
        convert_to_universal(checkpoint, work / UNIVERSAL_TAG)
        # The engine's universal loading is one config flag, read on every load_checkpoint: set for
        # this load only, so the run's own checkpoints load the ordinary way afterwards.
        config = engine._config
        before = config.load_universal_checkpoint
        config.load_universal_checkpoint = True
        try:
            load_checkpoint(engine, work, UNIVERSAL_TAG)
        finally:
            config.load_universal_checkpoint = before
        if stage == 3:
            _restore_stage3_groups(engine, work / UNIVERSAL_TAG)
    finally:
        shutil.rmtree(work, ignore_errors=True)
