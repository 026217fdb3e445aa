"""What a worker builds once before its first step: the stream, the model, the engine, the restored state.

`set_up` turns a `TrainJob` and the launcher's `WorkerContext` into a `Worker`: the shard stream at this
rank's share of the global batch, the model (pre-trained weights for fine-tuning), the DeepSpeed engine
and its `Stepper`, the schedule's length, and, on resume, the checkpoint's state and stream position,
checked against the position the step implies. The loop (`train/loop.py`) only steps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from vitscale.say import say
from vitscale.train import checkpoint as ckpt
from vitscale.train.batch import BatchPlan, resized_batch
from vitscale.train.engine import build_engine, deepspeed_config, init_distributed, load_checkpoint
from vitscale.train.job import TrainJob
from vitscale.train.metrics import metrics_path
from vitscale.train.mfu import peak_flops
from vitscale.train.objective import Objective, objective_flops, objective_for
from vitscale.train.optim import Decay, lr_at, schedule_length, warmup_outlasts
from vitscale.train.polyak import Polyak
from vitscale.train.resume import dataset_identity
from vitscale.train.step import Stepper

if TYPE_CHECKING:
    from vitscale.train.context import WorkerContext


@dataclass
class Worker:
    """One worker's training set-up (built by `set_up`)."""

    job: TrainJob
    ctx: WorkerContext
    device: torch.device
    batch: BatchPlan
    """The global batch's split at this world size (uneven shares are loss-weighted by the `Stepper`)."""
    stream: Any
    """The shard stream (`data/loader/stream.py` `ShardStream`) of this rank's share of every global batch."""
    steps_per_epoch: int
    total_steps: int
    eval_every: int | None
    model: torch.nn.Module
    polyak: Polyak | None
    engine: Any
    stepper: Stepper
    objective: Objective
    """What the steps optimise (`train.objective`): the labels or masked patch prediction."""
    flops_per_example: float
    """Training FLOPs per example (3x forward, the paper's convention)."""
    peak: float | None
    """The device's peak FLOP/s for MFU, or None where it is not known."""
    state: ckpt.TrainState
    """Where training stands: step 0, or the resumed checkpoint's."""
    resume_stream: dict[str, Any] | None
    """The resumed checkpoint's stream state for this rank (checked against the step), until the loop opens it."""
    trained_on: dict[str, Any] | None = None
    """What the run reads and starts from (`resume.TRAINED_KEY`): recorded in every checkpoint, compared on resume."""

    @property
    def per_rank_step(self) -> int:
        """Samples this rank consumes per optimizer step."""
        return self.batch.share(self.ctx.rank)

    def stream_state(self, step: int) -> dict[str, int]:
        """Where this rank's stream stands before optimizer step `step + 1` (the step fixes it)."""
        return stream_state(step, self.steps_per_epoch, self.per_rank_step, self.job.data.seed)

    def reads_on(self, step: int) -> bool:
        """Whether optimizer step `step + 2` reads on from the stream step `step + 1` reads (the same epoch, and
        the run not over): then step `step + 1` may read the next one's first micro-batch ahead (`train/feed.py`)."""
        return (step + 1) % self.steps_per_epoch != 0 and step + 1 < self.total_steps

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step + 1` (`optim.lr_at`)."""
        t = self.job.train
        return lr_at(step, base_lr=t.base_lr, total_steps=self.total_steps, warmup_steps=t.warmup_steps,
                     decay=cast(Decay, t.lr_decay), end_lr=t.end_lr)


def stream_state(step: int, steps_per_epoch: int, per_rank_step: int, seed: int) -> dict[str, int]:
    """Where a rank's stream stands before optimizer step `step + 1` (pure: the step fixes it)."""
    return {"epoch": step // steps_per_epoch, "position": (step % steps_per_epoch) * per_rank_step, "seed": seed}


def set_up(job: TrainJob, ctx: WorkerContext) -> Worker:
    """Open the stream, build the model and engine, restore a checkpoint if the run resumes."""
    train, model_cfg = job.train, job.model
    on_gpu = torch.cuda.is_available() and job.use_gpu
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    init_distributed(on_gpu)
    # The global batch is the run's, whatever the world size: each worker's share of it in micro batches
    # (the driver checked every world size the run may reach).
    batch = resized_batch(train.global_batch, train.micro_batch, ctx.world_size)
    objective = objective_for(train, model_cfg)
    stream = _open_stream(job, ctx, batch, on_gpu, objective)
    num_classes = stream.dataset.num_classes
    if num_classes == 0 and train.objective == "supervised":  # the driver refuses it first (stages/pretrain.py)
        raise ValueError(f"{job.data.url} holds images without labels: supervised training needs labels "
                         "(train.objective: masked_patch learns from images alone)")
    steps_per_epoch, total_steps = schedule_length(sum(stream.dataset.counts), batch.global_batch, train.epochs,
                                                   train.max_steps)
    outlasts = warmup_outlasts(total_steps, train.warmup_steps, f"{job.train_key}.warmup_steps")
    # Said once, at the run's start: not on a resume, nor on a restart before the first checkpoint (whose
    # attempt before it left its step lines in the run folder).
    if outlasts and ctx.rank == 0 and ctx.resume_from is None and not metrics_path(ctx.run_dir, 0).exists():
        say(outlasts)
    torch.manual_seed(train.seed)  # identical initial weights on every rank
    model = _build_model(job, ctx, objective, num_classes)
    # Fine-tuning: the weights it starts from as loaded, before the engine moves or partitions them (an export's
    # file differs byte-wise each time it is written).
    trained_on = {"dataset": dataset_identity(stream.dataset.meta, job.data.split),
                  **({"init": ckpt.state_sha256(model)} if job.init is not None else {})}
    polyak = Polyak(model, train.polyak) if train.polyak is not None else None
    parameters = sum(p.numel() for p in model.parameters())
    engine = build_engine(model, train, deepspeed_config(train, batch, on_gpu=on_gpu, parameters=parameters),
                          on_gpu=on_gpu)
    worker = Worker(
        job=job, ctx=ctx, device=device, batch=batch, stream=stream, steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        eval_every=train.eval_every or (max(1, total_steps // job.evaluations) if job.evaluations else None),
        model=model, polyak=polyak, engine=engine, objective=objective,
        stepper=Stepper(engine, train, batch, device, ctx.world_size, objective),
        flops_per_example=3 * objective_flops(objective, model_cfg, num_classes),
        # "auto" knows no peak without CUDA (MFU left out); a peak the user states is used on any device.
        peak=peak_flops(train.peak_flops) if on_gpu or train.peak_flops != "auto" else None,
        state=ckpt.TrainState(world_size=ctx.world_size), resume_stream=None,
        trained_on=trained_on)
    if ctx.resume_from is not None:
        _resume(worker)
    return worker


def _open_stream(job: TrainJob, ctx: WorkerContext, batch: BatchPlan, on_gpu: bool, objective: Objective) -> Any:
    from vitscale.data.loader.stream import ShardStream

    data = job.data
    # Global-batch layout: the samples each step consumes do not depend on the world size (data/order.py).
    return ShardStream(
        data.url, data.split, rank=ctx.rank, world_size=ctx.world_size, seed=data.seed,
        batch_size=batch.micro_batch, global_batch=batch.global_batch, resolution=job.model.img_size, train=True,
        num_workers=data.num_workers, shuffle_buffer=data.shuffle_buffer, error_budget=data.error_budget,
        endpoint_url=data.endpoint_url, carve=job.carve, corruption=objective.corruption,
        # Page-locked batches: the step's copy to the GPU is asynchronous instead of a blocking staged one.
        pin_memory=on_gpu)


def _build_model(job: TrainJob, ctx: WorkerContext, objective: Objective, num_classes: int) -> torch.nn.Module:
    """The job's model for its objective; for fine-tuning, with the pre-trained weights it names."""
    model = objective.build_model(job.model, num_classes)
    if job.init is not None:
        from vitscale.data.storage.fetch import local_copy
        from vitscale.models.weights_files import load_pretrained

        # Fine-tuning: pre-trained weights; head and pre-logits dropped, position embeddings
        # resampled to this resolution (Sec. 3.2), the zero-initialised head kept.
        # The file lives in the run's storage (handed over by the driver, stages/finetune.py): on a node
        # that shares no disk with the driver, a copy comes from there into the local cache.
        weights = local_copy(job.init)
        report = load_pretrained(model, weights)
        if ctx.rank == 0 and ctx.resume_from is None:
            # The file's digest says which weights a trial started from, whichever node it ran on.
            say(f"initialised from {job.init} (sha256 {ckpt.sha256_file(weights)}): "
                  f"{len(report.loaded)} tensors"
                  + (f", resampled {', '.join(report.resampled)}" if report.resampled else ""))
    return model


class StreamMismatch(RuntimeError):
    """A checkpoint's saved stream position is not the one its step implies for this run (a checkpoint written
    before it recorded its dataset, whose dataset changed since): a restart would find the same, so it is not
    retried (`launch/failures.py`)."""


def _resume(worker: Worker) -> None:
    """Load the checkpoint into `worker` and check its stream position against the step's."""
    ctx = worker.ctx
    state, saved = restore(worker.engine, ctx, worker.polyak, worker.job, worker.trained_on)
    ctx.restored()
    implied = worker.stream_state(state.step)
    if state.world_size != ctx.world_size:
        # Resized: this rank's position is its share of the step's global batch at the new size; the
        # epoch's skipped-sample count (all ranks') goes on.
        saved = {**implied, "skipped": saved.get("skipped", 0) if implied["position"] else 0}
    if any(saved.get(k) != v for k, v in implied.items()):
        raise StreamMismatch(f"{ctx.resume_from}: rank {ctx.rank}'s saved stream position {saved} is not "
                             f"the one step {state.step} implies ({implied}); the checkpoint does not belong "
                             "to this run's sample order (its dataset or batch changed since; docs/resume.md): "
                             "start a new run with another cluster.run_name")
    worker.state, worker.resume_stream = state, saved


def restore(engine: Any, ctx: WorkerContext, polyak: Polyak | None, job: TrainJob,
            trained_on: dict[str, Any] | None = None) -> tuple[ckpt.TrainState, dict[str, Any]]:
    """Load the checkpoint `ctx.resume_from`; (train state, this rank's saved stream state). `trained_on`: what the
    job reads and starts from now (`resume.TRAINED_KEY`), refused if the checkpoint was trained on another."""
    from vitscale.train.resume import refuse_changed_run

    if ctx.resume_from is None:
        raise RuntimeError("restore called without a checkpoint to resume from")
    directory = Path(ctx.resume_from)
    # The last line of defence against resuming a changed run (the driver checks first when it can
    # read the run's storage), before any state is loaded.
    info = ckpt.manifest_info(directory)
    saved_world = info[1] if info else ctx.world_size
    saved = directory / "config.yaml"
    if job.config_yaml and saved.exists():
        # An elastic run's world size may change between restarts; a fixed one's may not.
        refuse_changed_run(saved.read_text(), job.config_yaml, job.resume_scope, f"checkpoint {directory}",
                           None if ctx.elastic else saved_world, None if ctx.elastic else ctx.world_size, trained_on)
    # A rank past the saved world size (the run grew) reads rank 0's part: stream and Polyak state are
    # the same on every rank.
    own = ctx.rank if ctx.rank < saved_world else 0
    # Sizes and presence of every saved rank's files, hashes of the parts this rank reads (all of them
    # when it regroups the ZeRO shards of another world size).
    problems = ckpt.check_complete(directory, saved_world,
                                   hash_ranks={0, own} if saved_world == ctx.world_size else None)
    if problems:
        raise RuntimeError("refusing to resume from an incomplete checkpoint:\n  " + "\n  ".join(problems))
    _load_engine(engine, ctx, directory, saved_world)
    part = ckpt.read_rank_part(directory, own)
    if own == ctx.rank:
        ckpt.set_rng_state(part["rng"])
    else:  # a new rank: host RNGs (dropout) from the run's seed, the step and the rank, not a copy of rank 0's
        ckpt.seed_rng(job.train.seed, ckpt.read_train_state(directory).step, ctx.rank)
    if polyak is not None:
        if "polyak" not in part:
            raise RuntimeError(f"{directory} has no Polyak average to resume (train.polyak was off when it was saved)")
        polyak.load_state_dict(part["polyak"])
    state = ckpt.read_train_state(directory)
    if ctx.rank == 0:
        resized = f", resharded from {saved_world} to {ctx.world_size} workers" if saved_world != ctx.world_size else ""
        say(f"resumed from {directory} at step {state.step} "
              f"(stream epoch {part['stream']['epoch']}, position {part['stream']['position']}{resized})")
    return state, dict(part["stream"])


def _load_engine(engine: Any, ctx: WorkerContext, directory: Path, saved_world: int) -> None:
    """The checkpoint's module, optimizer and ZeRO states into `engine`, regrouped if the world size changed."""
    if saved_world == ctx.world_size:
        load_checkpoint(engine, directory / ckpt.DEEPSPEED_DIR, ckpt.DEEPSPEED_TAG)
        return
    from vitscale.data.storage.cleanup import scratch_folder
    from vitscale.train.reshard import load_resharded

    with scratch_folder("vitscale-reshard-") as scratch:  # a rank killed meanwhile: swept by the next one
        load_resharded(engine, directory / ckpt.DEEPSPEED_DIR, ckpt.DEEPSPEED_TAG, saved_world, scratch=scratch)

