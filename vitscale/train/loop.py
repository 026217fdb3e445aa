"""The training loop that runs on every worker: plain PyTorch around a DeepSpeed engine.

Pre-training and fine-tuning are the same loop over a `TrainJob` (`train/job.py`); they differ in
the recipe, the initial weights and what is evaluated. Nothing here knows about Ray. The launcher
hands in a `WorkerContext` (rank, world size, where the run lives, how to report, which checkpoint
to resume from) and this module does the rest:
model from `models/`, ZeRO engine from `engine.py`, the shard stream from `data/loader/stream.py`, the
schedule from `optim.lr_at`, compute from `scaling.flops`.

Exact resumption: step k of an epoch always consumes the samples at positions
[k * n, (k + 1) * n) of this rank's plan for that epoch (n: its share of the global batch), so the stream
position is a pure function of the optimizer step, and a checkpoint at step k plus the plan gives
the exact sample where training continues.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from vitscale.data.storage.atomic import AppendOnly
from vitscale.scaling.flops import forward_flops
from vitscale.train import checkpoint as ckpt
from vitscale.train.engine import (
    build_engine,
    deepspeed_config,
    init_distributed,
    load_checkpoint,
    whole_weights,
)
from vitscale.train.evaluate import Polyak, accuracy
from vitscale.train.faults import maybe_die
from vitscale.train.job import EvalSet, TrainJob
from vitscale.train.metrics import (
    MetricsSink,
    StepMetrics,
    TensorBoardLog,
    mfu,
    peak_flops,
    progress_line,
)
from vitscale.train.optim import Decay, lr_at, resized_batch, schedule_length
from vitscale.train.step import Stepper
from vitscale.train.termination import Terminated

ReportFn = Callable[[dict[str, Any], "Path | None"], None]


@dataclass
class WorkerContext:
    """What the launcher tells a worker: who it is, where the run lives, how to report."""

    rank: int
    world_size: int
    run_dir: Path
    """Local (or shared-filesystem) run directory: metrics JSONL, sample logs, fault markers."""
    local_rank: int = 0
    """Rank among the workers on this node: picks this worker's metrics port."""
    report: ReportFn = field(default=lambda metrics, checkpoint_dir: None)
    """Report metrics (and a checkpoint directory) to the launcher; called by every rank."""
    resume_from: Path | None = None
    """A complete checkpoint directory to resume from, or None to start fresh."""
    restored: Callable[[], None] = field(default=lambda: None)
    """Called once `resume_from` is loaded: the launcher releases a downloaded copy then."""
    storage: str | None = None
    """The run's storage every node shares (a folder or s3:// prefix): fault markers; None = run_dir."""
    elastic: bool = False
    """The run's world size may change between restarts (`cluster.num_workers: [MIN, MAX]`): a
    checkpoint of another world size is resharded, not refused."""
    preemption: Callable[[], str | None] = field(default=lambda: None)
    """A notice that a node of the run is being preempted (one line), or None. Every rank calls it at the
    same steps, every `preemption_every_s` (under Ray Train it is a barrier through an actor: too slow
    for every step). On the first notice the loop checkpoints at once."""
    preemption_every_s: float = 5.0
    """How often the loop asks: Ray Train polls node drains every 5 s itself."""
    terminated: Callable[[], str | None] = field(default=lambda: None)
    """A notice that this process was told to stop (SIGTERM held back by `train/termination.py`), or None;
    local and cheap, asked every step. Every rank checkpoints at the step any rank's notice arrives, then
    raises `Terminated` (the told ranks leave; Ray Train restarts the group from that checkpoint)."""


class NonFiniteSteps(RuntimeError):
    """More steps had a non-finite loss or gradients than `train.max_skipped_steps` allows."""


def train(job: TrainJob, ctx: WorkerContext) -> dict[str, Any]:
    """Run (or resume) a training job to its configured number of steps; returns a summary."""
    from vitscale.data.loader.stream import ShardStream

    train, data, model_cfg = job.train, job.data, job.model
    on_gpu = torch.cuda.is_available() and job.use_gpu
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    init_distributed(on_gpu)

    # The global batch is the run's, whatever the world size: each worker's share of it in micro batches
    # (the driver checked every world size the run may reach). A size that does not divide it gives
    # uneven shares, whose micro-batch losses are weighted so the step is the global batch's mean (`Stepper`).
    batch = resized_batch(train.global_batch, train.micro_batch, ctx.world_size)
    # Global-batch layout: the samples each step consumes do not depend on the world size (data/order.py).
    stream = ShardStream(
        data.url, data.split, rank=ctx.rank, world_size=ctx.world_size, seed=data.seed,
        batch_size=batch.micro_batch, global_batch=batch.global_batch, resolution=model_cfg.img_size, train=True,
        num_workers=data.num_workers, shuffle_buffer=data.shuffle_buffer, error_budget=data.error_budget,
        endpoint_url=data.endpoint_url, carve=job.carve,
        # Page-locked batches: the step's copy to the GPU is asynchronous instead of a blocking staged one.
        pin_memory=on_gpu)
    num_classes = stream.dataset.num_classes
    per_rank_step = batch.share(ctx.rank)
    steps_per_epoch, total_steps = schedule_length(sum(stream.dataset.counts), batch.global_batch, train.epochs,
                                                   train.max_steps)
    eval_every = train.eval_every or (max(1, total_steps // job.evaluations) if job.evaluations else None)

    torch.manual_seed(train.seed)  # identical initial weights on every rank
    model = model_cfg.build(num_classes)
    if job.init is not None:
        from vitscale.data.storage.fetch import local_copy
        from vitscale.models.checkpoints import load_pretrained

        # Fine-tuning: pre-trained weights; head and pre-logits dropped, position embeddings
        # resampled to this resolution (Sec. 3.2), the zero-initialised head kept.
        # The file lives in the run's storage (handed over by the driver, stages/finetune.py): on a node
        # that shares no disk with the driver, a copy comes from there into the local cache.
        weights = local_copy(job.init)
        report = load_pretrained(model, weights)
        if ctx.rank == 0 and ctx.resume_from is None:
            # The file's digest says which weights a trial started from, whichever node it ran on.
            print(f"[vitscale] initialised from {job.init} (sha256 {ckpt.sha256_file(weights)}): "
                  f"{len(report.loaded)} tensors"
                  + (f", resampled {', '.join(report.resampled)}" if report.resampled else ""), flush=True)
    polyak = Polyak(model, train.polyak) if train.polyak is not None else None
    engine = build_engine(model, train, deepspeed_config(train, batch, on_gpu=on_gpu), on_gpu=on_gpu)
    stepper = Stepper(engine, train, batch, device, ctx.world_size)
    train_flops_per_example = 3 * forward_flops(model_cfg.name, img_size=model_cfg.img_size,
                                                num_classes=num_classes, **model_cfg.options)
    # "auto" knows no peak without CUDA (MFU left out); a peak the user states is used on any device.
    peak = peak_flops(train.peak_flops) if on_gpu or train.peak_flops != "auto" else None

    state = ckpt.TrainState(world_size=ctx.world_size)
    resume_stream = None
    if ctx.resume_from is not None:
        state, resume_stream = _restore(engine, ctx, polyak, job)
        ctx.restored()
        implied = _stream_state(state.step, steps_per_epoch, per_rank_step, data.seed)
        if state.world_size != ctx.world_size:
            # Resized: this rank's position is its share of the step's global batch at the new size; the
            # epoch's skipped-sample count (all ranks') goes on.
            resume_stream = {**implied, "skipped": resume_stream.get("skipped", 0) if implied["position"] else 0}
        if any(resume_stream.get(k) != v for k, v in implied.items()):
            raise RuntimeError(f"{ctx.resume_from}: rank {ctx.rank}'s saved stream position {resume_stream} is not "
                               f"the one step {state.step} implies ({implied}); the checkpoint does not belong "
                               "to this run's sample order")
    sink = MetricsSink(ctx.run_dir, run=ctx.run_dir.name, rank=ctx.rank, addr=train.metrics_addr,
                       port=None if train.metrics_port is None else
                       (0 if train.metrics_port == 0 else train.metrics_port + ctx.local_rank))
    if sink.port is not None:
        print(f"[vitscale] rank {ctx.rank}: Prometheus metrics on :{sink.port}/metrics", flush=True)
    samples_log = _SamplesLog(ctx) if train.record_samples else None
    # Rank 0's curves, keyed by optimiser step, in the run directory (pushed to the run's storage with
    # the metrics); a resumed run continues them from its checkpoint's step.
    board = TensorBoardLog(ctx.run_dir / "tensorboard", resumed_at=state.step) if ctx.rank == 0 else None
    compute_dtype = torch.bfloat16 if train.precision == "bf16" else torch.float32

    step = state.step
    examples, flops = state.examples_seen, state.flops
    skipped, first_skipped = state.skipped_steps, state.first_skipped_step
    loss_value = float("nan")
    scores: dict[str, float] = {}  # stays empty when a run resumed at its last step has nothing left to do
    batches = None
    noticed = False  # a preemption notice was answered with a checkpoint (one per notice is enough)
    attempt = time.time()  # marks this attempt's metrics lines: a restart starts a new one (train/restarts.py)
    last_asked = time.monotonic()
    t_run = time.perf_counter()
    while step < total_steps:
        if batches is None:  # (re)open the stream at the exact sample this step starts from
            # On resume: the checkpoint's own stream state (checked above against the step).
            stream.load_state_dict(resume_stream or _stream_state(step, steps_per_epoch, per_rank_step, data.seed))
            resume_stream = None
            batches = iter(stream)
        t0 = time.perf_counter()
        lr = lr_at(step, base_lr=train.base_lr, total_steps=total_steps, warmup_steps=train.warmup_steps,
                   decay=cast(Decay, train.lr_decay), end_lr=train.end_lr)
        # Votes every rank must agree on, summed over ranks in the step's loss all-reduce: rank 0's "time to ask
        # Ray about preemption" (so every rank asks at the same step), how many ranks were told to stop
        # (SIGTERM: all checkpoint at this step), and the epoch's skipped samples (the error budget's count).
        # Asked once the step's micro-batches have run, so a notice that arrived meanwhile counts at this step.
        heard: dict[str, Any] = {}
        outcome = stepper.step(batches, lr, votes=partial(_votes, ctx, last_asked, stream, heard))
        told = heard["told"]
        loss_value, applied, grad_norm = outcome.loss, outcome.applied, outcome.grad_norm
        data_wait = outcome.data_wait_s
        ask, stopping, epoch_skipped = outcome.votes[0] > 0, int(outcome.votes[1]), int(outcome.votes[2])
        keys = outcome.keys
        if not applied:
            skipped += 1
            first_skipped = step + 1 if first_skipped is None else first_skipped
            if ctx.rank == 0:
                print(f"[vitscale] step {step + 1}: loss {loss_value:.4g}, gradient norm {grad_norm:.4g}: "
                      f"not applied ({skipped} skipped so far)", flush=True)
            if skipped > train.max_skipped_steps:
                raise NonFiniteSteps(
                    f"step {step + 1}: loss or gradients not finite; {skipped} steps skipped, more than "
                    f"train.max_skipped_steps ({train.max_skipped_steps}); first at step {first_skipped}. Resume "
                    f"from a checkpoint before step {first_skipped} with a lower train.base_lr or more warm-up")
        elif polyak is not None:
            polyak.update(engine.module)
        step += 1
        if step % steps_per_epoch == 0:
            batches = None  # epoch finished: the next step opens the next epoch's plan
        # Every rank sees the same sum, so all raise `ErrorBudgetExceeded` at the same step (no rank is left
        # waiting in a collective); the launcher then ends the run instead of restarting it.
        stream.check_error_budget(epoch_skipped)
        examples += batch.global_batch
        flops += train_flops_per_example * batch.global_batch
        step_time = time.perf_counter() - t0
        images_per_s = batch.global_batch / step_time
        metrics = StepMetrics(
            step=step, loss=loss_value, lr=lr, grad_norm=grad_norm, images_per_s=images_per_s,
            step_time_s=step_time, data_wait_s=data_wait, compute_s=step_time - data_wait,
            examples_seen=examples, cumulative_exaflops=flops / 1e18,
            mfu=None if peak is None else mfu(train_flops_per_example * images_per_s / ctx.world_size, peak),
            skipped_samples=sum(stream.skipped().values()), epoch=step / steps_per_epoch,
            world_size=ctx.world_size, attempt=attempt)
        sink.record(metrics, stream.skipped())
        if board is not None:
            board.record(metrics)
        if samples_log is not None:
            samples_log.write(step, keys, ctx.world_size)
        if ctx.rank == 0 and (step % train.log_every == 0 or step == total_steps):
            _progress_line(metrics, total_steps, time.perf_counter() - t_run, step - state.step)
        maybe_die(train.fault, ctx.rank, step, ctx.storage or str(ctx.run_dir))
        scores = {}
        if job.evals and (step == total_steps or (eval_every and step % eval_every == 0) or step in job.eval_steps):
            scores = _evaluate(job, engine, polyak, ctx, device, compute_dtype)
            if board is not None:
                board.scores(step, scores)
        # A preemption notice: checkpoint now rather than lose the steps since the last periodic one; the
        # run goes on until Ray Train restarts it without the preempted node (from this checkpoint).
        notice = ctx.preemption() if ask and not noticed else None
        last_asked = time.monotonic() if ask else last_asked
        noticed = noticed or notice is not None
        if stopping:  # a told rank leaves after this step's checkpoint: no second notice comes
            notice = told or f"{stopping} rank(s) received SIGTERM"
        if notice is not None and (ctx.rank == 0 or told is not None):
            print(f"[vitscale] step {step}: {notice}: checkpointing now", flush=True)
        if step % train.checkpoint_every == 0 or step == total_steps or notice is not None:
            if board is not None:
                board.flush()
            new_state = ckpt.TrainState(step=step, examples_seen=examples, flops=flops, world_size=ctx.world_size,
                                        skipped_steps=skipped, first_skipped_step=first_skipped)
            t_save = time.perf_counter()
            stream_state = _stream_checkpoint(stream, step, steps_per_epoch, per_rank_step, data.seed)
            _save_and_report(engine, ctx, new_state, stream_state,
                             job.config_yaml, {**_report_metrics(metrics), **_restart_totals(sink),
                                               "skipped_steps": skipped,
                                               "checkpoint_score": checkpoint_score(step, first_skipped), **scores},
                             polyak)
            sink.checkpoint_saved(time.perf_counter() - t_save)
            if stopping:
                # One more report, from every rank (each is a barrier): a rank's report waits until the
                # launcher took its last one, so the checkpoint is registered before a told rank leaves.
                ctx.report({**_report_metrics(metrics), "skipped_steps": skipped, **scores}, None)
                if step < total_steps:  # (at the last step the run is done anyway)
                    sink.close()
                    if board is not None:
                        board.close()
                    raise Terminated(f"rank {ctx.rank}: {notice}", step, signalled=told is not None)
        elif step % train.log_every == 0 or scores:
            ctx.report({**_report_metrics(metrics), "skipped_steps": skipped, **scores}, None)
    sink.close()
    if board is not None:
        board.close()
    return {"steps": step, "total_steps": total_steps, "examples_seen": examples, "exaflops": flops / 1e18,
            "final_loss": loss_value, "num_classes": num_classes, "skipped_samples": stream.skipped(),
            "skipped_steps": skipped, **_restart_totals(sink), **scores}


def _restart_totals(sink: MetricsSink) -> dict[str, Any]:
    """Restarts of the run so far (failures, preemptions, resizes) and the seconds they cost, from this
    rank's metrics lines (every attempt's: the file is continued, on a new node pulled from storage)."""
    return {"restarts": len(sink.restarts), "restart_lost_s": round(sum(r.seconds_lost for r in sink.restarts), 1)}


def _votes(ctx: WorkerContext, last_asked: float, stream: Any, heard: dict[str, Any]) -> list[float]:
    """This rank's votes of a step (`Stepper.step`), taken once its micro-batches have run: time for rank 0 to
    ask Ray about preemption, told to stop (the notice is kept in `heard["told"]`), the epoch's skipped samples."""
    ask = ctx.rank == 0 and time.monotonic() - last_asked >= ctx.preemption_every_s
    heard["told"] = ctx.terminated()
    return [float(ask), float(heard["told"] is not None), float(stream.epoch_skipped())]


def _stream_state(step: int, steps_per_epoch: int, per_rank_step: int, seed: int) -> dict[str, int]:
    """Where this rank's stream stands before optimizer step `step + 1` (pure: the step fixes it)."""
    return {"epoch": step // steps_per_epoch, "position": (step % steps_per_epoch) * per_rank_step, "seed": seed}


def _stream_checkpoint(stream: Any, step: int, steps_per_epoch: int, per_rank_step: int, seed: int) -> dict[str, int]:
    """The stream state a checkpoint keeps: the position the step implies, and the error budget's
    count of the epoch so far (all ranks), so a restart goes on counting instead of starting over."""
    state = _stream_state(step, steps_per_epoch, per_rank_step, seed)
    return {**state, "skipped": stream.state_dict()["skipped"] if state["position"] else 0}


def checkpoint_score(step: int, first_skipped: int | None) -> float:
    """The score Ray's checkpoint rotation keeps the best of (`launch/ray_train.py`).

    The step, until a step has been skipped as non-finite; from then on every checkpoint scores
    below every earlier one, so rotation never deletes the last checkpoint written before the
    first bad step (Ray always keeps the newest besides).
    """
    return float(step) if first_skipped is None or step < first_skipped else float(step) - 2.0**50


def _evaluate(job: TrainJob, engine: Any, polyak: Polyak | None, ctx: WorkerContext, device: torch.device,
              dtype: torch.dtype) -> dict[str, float]:
    """Accuracy on every evaluation set, with the raw and (if on) the averaged weights; rank 0 measures.

    Every rank enters (gathering ZeRO-3 weights is a collective) and waits at the barrier, so
    ranks stay in step; the scores are rank 0's, which is whose metrics Ray keeps.
    """
    scores: dict[str, float] = {}
    with whole_weights(engine) as model:
        if ctx.rank == 0:
            for eval_set in job.evals:
                def measure(m: torch.nn.Module, eval_set: EvalSet = eval_set) -> float:
                    return accuracy(m, eval_set, resolution=job.model.img_size, batch_size=job.eval_batch,
                                    device=device, dtype=dtype, endpoint_url=job.data.endpoint_url,
                                    error_budget=job.data.error_budget)

                scores[f"{eval_set.name}_accuracy"] = measure(model)
                if polyak is not None:
                    with polyak.swapped_in(model) as averaged:
                        scores[f"{eval_set.name}_accuracy_polyak"] = measure(averaged)
            print("[vitscale] " + "  ".join(f"{k} {v:.4f}" for k, v in scores.items()), flush=True)
        torch.distributed.barrier()
    return scores


def _report_metrics(m: StepMetrics) -> dict[str, Any]:
    out = {k: v for k, v in m.__dict__.items() if v is not None}
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


def _progress_line(m: StepMetrics, total_steps: int, elapsed: float, steps_done: int) -> None:
    print(progress_line(m, total_steps, elapsed, steps_done), flush=True)


def _save_and_report(engine: Any, ctx: WorkerContext, state: ckpt.TrainState, stream_state: dict[str, Any],
                     config_yaml: str, metrics: dict[str, Any], polyak: Polyak | None) -> None:
    with tempfile.TemporaryDirectory(prefix=f"vitscale-ckpt-r{ctx.rank}-") as tmp:
        directory = Path(tmp)
        # A full disk, here or in the run's storage, is one line naming it and the space needed.
        with ckpt.space_for(tempfile.gettempdir(), step=state.step):
            # Every rank calls save: ZeRO keeps one optimizer shard per rank (DeepSpeed barriers inside).
            engine.save_checkpoint(str(directory / ckpt.DEEPSPEED_DIR), tag=ckpt.DEEPSPEED_TAG)
            ckpt.write_rank_part(directory, rank=ctx.rank, stream_state=stream_state, train_state=state,
                                 config_yaml=config_yaml, polyak=None if polyak is None else polyak.state_dict())
        with ckpt.space_for(ctx.storage or ctx.run_dir, step=state.step, parts=ctx.world_size, copying=directory):
            ctx.report(metrics, directory)
        ckpt.record_part(directory)


def _restore(engine: Any, ctx: WorkerContext, polyak: Polyak | None,
             job: TrainJob) -> tuple[ckpt.TrainState, dict[str, Any]]:
    """Load the checkpoint; (train state, this rank's saved stream state)."""
    from vitscale.train.resume import refuse_changed_run

    if ctx.resume_from is None:
        raise RuntimeError("_restore called without a checkpoint to resume from")
    directory = Path(ctx.resume_from)
    # The last line of defence against resuming a changed run (the driver checks first when it can
    # read the run's storage), before any state is loaded.
    info = ckpt.manifest_info(directory)
    saved_world = info[1] if info else ctx.world_size
    saved = directory / "config.yaml"
    if job.config_yaml and saved.exists():
        # An elastic run's world size may change between restarts; a fixed one's may not.
        refuse_changed_run(saved.read_text(), job.config_yaml, job.resume_scope, f"checkpoint {directory}",
                           None if ctx.elastic else saved_world, None if ctx.elastic else ctx.world_size)
    # A rank past the saved world size (the run grew) reads rank 0's part: stream and Polyak state are
    # the same on every rank.
    own = ctx.rank if ctx.rank < saved_world else 0
    # Sizes and presence of every saved rank's files, hashes of the parts this rank reads (all of them
    # when it regroups the ZeRO shards of another world size).
    problems = ckpt.check_complete(directory, saved_world,
                                   hash_ranks={0, own} if saved_world == ctx.world_size else None)
    if problems:
        raise RuntimeError("refusing to resume from an incomplete checkpoint:\n  " + "\n  ".join(problems))
    if saved_world == ctx.world_size:
        load_checkpoint(engine, directory / ckpt.DEEPSPEED_DIR, ckpt.DEEPSPEED_TAG)
    else:
        from vitscale.train.reshard import load_resharded

        with tempfile.TemporaryDirectory(prefix=f"vitscale-reshard-rank{ctx.rank}-") as scratch:
            load_resharded(engine, directory / ckpt.DEEPSPEED_DIR, ckpt.DEEPSPEED_TAG, saved_world,
                           scratch=Path(scratch))
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
        print(f"[vitscale] resumed from {directory} at step {state.step} "
              f"(stream epoch {part['stream']['epoch']}, position {part['stream']['position']}{resized})", flush=True)
    return state, dict(part["stream"])


class _SamplesLog:
    """Keys consumed per step and rank: proves no sample is repeated or skipped across a resume.

    Lines are appended; after a resume the steps since the checkpoint are written again, and the
    last line for a step is the one whose update survives in the weights.
    """

    def __init__(self, ctx: WorkerContext):
        directory = ctx.run_dir / "samples"
        directory.mkdir(parents=True, exist_ok=True)
        # Whole lines or nothing (data/storage/atomic.py), as the metrics: a full disk tears no record.
        self.file = AppendOnly(directory / f"rank{ctx.rank}.jsonl")

    def write(self, step: int, keys: list[str], world_size: int) -> None:
        # The world size and time say which attempt's lines survive when an elastic run resized.
        self.file.append(json.dumps({"step": step, "keys": keys, "world_size": world_size,
                                     "time": round(time.time(), 3)}))
