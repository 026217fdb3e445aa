"""The training loop that runs on every worker: plain PyTorch around a DeepSpeed engine.

Pre-training and fine-tuning are the same loop over a `TrainJob` (`train/job.py`); they differ in
the recipe, the initial weights and what is evaluated. Nothing here knows about Ray. The launcher
hands in a `WorkerContext` (rank, world size, where the run lives, how to report, which checkpoint
to resume from); the loop is built from components, each in its own module (torchtitan's `Trainer`
shape): `worker.py` sets up once (stream, model, engine, restored state), `step.py` runs one optimizer
step, `observers.py` records it (metrics, TensorBoard, samples log, progress line), `stopvote.py`
decides whether a node is going away, `checkpointer.py` saves on its cadence and leaves after a
notice, `evaluate.py` scores the evaluation sets. A new feature goes into one of them, or a new one
(`tests/test_architecture.py` keeps every function under `train/` short).

Exact resumption: step k of an epoch always consumes the samples at positions
[k * n, (k + 1) * n) of this rank's plan for that epoch (n: its share of the global batch), so the stream
position is a pure function of the optimizer step, and a checkpoint at step k plus the plan gives
the exact sample where training continues.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from vitscale.say import say
from vitscale.train import checkpoint as ckpt
from vitscale.train.checkpointer import Checkpointer, checkpoint_score, report_metrics
from vitscale.train.context import WorkerContext
from vitscale.train.evaluate import evaluate, evaluation_due
from vitscale.train.faults import maybe_die
from vitscale.train.job import TrainJob
from vitscale.train.metrics import StepClock, StepMetrics
from vitscale.train.mfu import mfu
from vitscale.train.observers import Observers
from vitscale.train.step import StepOutcome
from vitscale.train.stopvote import StopVote
from vitscale.train.worker import Worker, set_up

__all__ = ["NonFiniteSteps", "WorkerContext", "checkpoint_score", "train"]

class NonFiniteSteps(RuntimeError):
    """More steps had a non-finite loss or gradients than `train.max_skipped_steps` allows."""


def train(job: TrainJob, ctx: WorkerContext) -> dict[str, Any]:
    """Run (or resume) a training job to its configured number of steps; returns a summary."""
    w = set_up(job, ctx)  # stream, model, engine, schedule, restored state
    observers, vote, clock = Observers(w), StopVote(ctx), StepClock()
    checkpointer = Checkpointer(w, observers)
    # The counts go on from the checkpoint's; a resized run's checkpoints record the new world size.
    state, stream, batch = replace(w.state, world_size=ctx.world_size), w.stream, w.batch
    loss, scores = float("nan"), {}  # scores stay empty when a run resumed at its last step has nothing to do
    batches = None
    while state.step < w.total_steps:
        if batches is None:  # (re)open the stream at the exact sample this step starts from
            # On resume: the checkpoint's own stream state (checked in set_up against the step).
            stream.load_state_dict(w.resume_stream or w.stream_state(state.step))
            w.resume_stream, batches = None, iter(stream)
        clock.start()
        lr = w.lr(state.step)
        outcome = w.stepper.step(batches, lr, votes=partial(vote.votes, stream), ahead=w.reads_on(state.step))
        loss = outcome.loss
        if outcome.applied:
            if w.polyak is not None:
                w.polyak.update(w.engine.module)
        else:
            state = _skipped(state, outcome.loss, outcome.grad_norm, job.train.max_skipped_steps, ctx.rank)
        step = state.step + 1
        epoch_done = step % w.steps_per_epoch == 0
        if epoch_done:
            batches = None  # epoch finished: the next step opens the next epoch's plan
        # Every rank sees the same sum, so all gather the bad shards and raise `ErrorBudgetExceeded` at the same
        # step (no rank is left waiting in a collective); the launcher then ends the run instead of restarting it.
        # The epoch's count so far, all ranks (a resumed epoch's included): the run's is the finished epochs' plus it.
        epoch_skips = stream.check_error_budget(vote.skipped_samples(outcome.votes), gather=vote.gather)
        state = replace(state, step=step, examples_seen=state.examples_seen + batch.global_batch,
                        flops=state.flops + w.flops_per_example * batch.global_batch,
                        skipped_samples=state.skipped_samples + (epoch_skips if epoch_done else 0))
        metrics = _step_metrics(w, state, outcome, lr, clock.lap(), observers.attempt, vote.skipped,
                                state.skipped_samples + (0 if epoch_done else epoch_skips))
        observers.record(metrics, outcome.keys, vote.skipped)
        maybe_die(job.train.fault, ctx.rank, step, ctx.storage or str(ctx.run_dir))
        clock.booked()
        scores = evaluate(w) if evaluation_due(w, step) else {}
        observers.scores(step, scores)
        notice = vote.decide(outcome.votes, step)
        if checkpointer.due(step, notice):
            checkpointer.save(state, metrics, scores)
            if notice is not None and (notice.stopping or notice.ending):
                checkpointer.leave(notice, step, metrics, state.skipped_steps, scores)
                break  # the driver's stop: every rank returns, and the run is resumed at the next step
        elif scores:  # Tune's trial curves; a checkpoint's report carries its step's metrics
            # Not one per logged step: each report is a barrier, and Ray Train's controller takes one per
            # poll (Ray's 2 s; launch/poll.py), so reporting fast steps held training to a step per poll
            # (the metrics sinks and the progress line have every step already).
            ctx.report({**report_metrics(metrics), "skipped_steps": state.skipped_steps, **scores}, None)
    observers.close()
    stream.close()  # the loader's processes, reading on into an epoch no step will take
    return {"steps": state.step, "total_steps": w.total_steps, "examples_seen": state.examples_seen,
            "exaflops": state.flops / 1e18, "final_loss": loss, "num_classes": stream.dataset.num_classes,
            "skipped_samples": vote.skipped, "skipped_steps": state.skipped_steps,
            **observers.restart_totals(), **scores}


def _skipped(state: ckpt.TrainState, loss: float, grad_norm: float, budget: int, rank: int) -> ckpt.TrainState:
    """`state` with step `state.step + 1` counted as not applied; past `train.max_skipped_steps`, the run stops."""
    step = state.step + 1
    skipped = state.skipped_steps + 1
    first = step if state.first_skipped_step is None else state.first_skipped_step
    if rank == 0:
        say(f"step {step}: loss {loss:.4g}, gradient norm {grad_norm:.4g}: "
              f"not applied ({skipped} skipped so far)")
    if skipped > budget:
        raise NonFiniteSteps(
            f"step {step}: loss or gradients not finite; {skipped} steps skipped, more than "
            f"train.max_skipped_steps ({budget}); first at step {first}. Resume "
            f"from a checkpoint before step {first} with a lower train.base_lr or more warm-up")
    return replace(state, skipped_steps=skipped, first_skipped_step=first)


def _step_metrics(w: Worker, state: ckpt.TrainState, outcome: StepOutcome, lr: float, step_time: float,
                  attempt: float, skipped: dict[str, int], run_skipped: int) -> StepMetrics:
    """What one step measured: loss, LR, throughput, MFU, compute spent, samples skipped (this rank's in this
    process, and `run_skipped`: the run's), epoch."""
    images_per_s = w.batch.global_batch / step_time
    world = w.ctx.world_size
    return StepMetrics(
        step=state.step, loss=outcome.loss, lr=lr, grad_norm=outcome.grad_norm, images_per_s=images_per_s,
        step_time_s=step_time, data_wait_s=outcome.data_wait_s, compute_s=step_time - outcome.data_wait_s,
        examples_seen=state.examples_seen, cumulative_exaflops=state.flops / 1e18,
        mfu=None if w.peak is None else mfu(w.flops_per_example * images_per_s / world, w.peak),
        skipped_samples=sum(skipped.values()), run_skipped_samples=run_skipped, epoch=state.step / w.steps_per_epoch,
        world_size=world, attempt=attempt, launch=w.ctx.launched, patch_accuracy=outcome.patch_accuracy)
