"""Reading a micro-batch ahead (`train/feed.py`): the loop consumes the same samples at every step, across
an epoch's end, with the same weights after, as when each is read as its step starts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.loop_runs import Recorder, steps
from helpers.loop_runs import weights as final_weights
from vitscale.data.tools.write import write_dataset
from vitscale.stages import build_pipeline
from vitscale.stages.pretrain import pretraining_job
from vitscale.train.feed import Feed


def _keys(run_dir: Path) -> list[list[str]]:
    return [json.loads(line)["keys"] for line in (run_dir / "samples" / "rank0.jsonl").read_text().splitlines()]


def test_reading_ahead_changes_no_sample_and_no_weight(tmp_path: Path, process_group: None,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """9 steps over epochs of 4 (64 samples, 16 a step in two micro-batches): the first micro-batch of each
    step read ahead within an epoch, the second always; against every micro-batch read as it is needed."""
    from vitscale.train.loop import WorkerContext, train

    data = tmp_path / "data"
    write_dataset("synthetic", str(data), shard_size=23, max_side=16, seed=0,
                  source_options={"count": 64, "classes": 4, "image_size": 16}, progress=False)
    job = pretraining_job(build_pipeline({
        "model": {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "mlp_dim": 64, "heads": 2},
        "data": {"url": str(data), "num_workers": 0, "shuffle_buffer": 32},
        "train": {"global_batch": 16, "micro_batch": 8, "max_steps": 9, "warmup_steps": 2, "base_lr": 1e-3,
                  "zero_stage": 1, "precision": "fp32", "checkpoint_every": 9, "log_every": 1,
                  "record_samples": True},
        "cluster": {"num_workers": 1, "use_gpu": False},
    }))
    reads: list[str] = []
    real_take = Feed.take

    def take(feed: Feed, batches: Iterator[dict[str, Any]]) -> tuple[dict[str, Any], torch.Tensor, float]:
        reads.append("ahead" if feed.next is not None and feed.next[0] is batches else "as needed")
        return real_take(feed, batches)

    monkeypatch.setattr(Feed, "take", take)
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "ahead", report=Recorder(tmp_path / "a")))
    # Each step's second micro-batch was read ahead, and its first one too except where an epoch began.
    assert reads[1::2] == ["ahead"] * 9
    assert [i + 1 for i, how in enumerate(reads[0::2]) if how == "as needed"] == [1, 5, 9]

    monkeypatch.setattr(Feed, "ahead", lambda feed, batches: 0.0)  # read nothing ahead: as before `feed.py`
    reads.clear()
    train(job, WorkerContext(rank=0, world_size=1, run_dir=tmp_path / "plain", report=Recorder(tmp_path / "p")))
    assert set(reads) == {"as needed"}
    assert _keys(tmp_path / "ahead") == _keys(tmp_path / "plain") and len(_keys(tmp_path / "plain")) == 9
    assert [m["loss"] for m in steps(tmp_path / "ahead")] == [m["loss"] for m in steps(tmp_path / "plain")]
    a, b = final_weights(tmp_path / "a" / "checkpoint_000000009"), final_weights(tmp_path / "p" / "checkpoint_000000009")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_micro_batch_read_ahead_from_a_left_epoch_is_dropped() -> None:
    feed = Feed(torch.device("cpu"))
    old = iter([{"image": torch.zeros(1), "n": 0}, {"image": torch.ones(1), "n": 1}])
    new = iter([{"image": torch.full((1,), 2.0), "n": 2}])
    assert feed.take(old)[0]["n"] == 0
    assert feed.ahead(old) >= 0 and feed.next is not None
    micro, pixels, waited = feed.take(new)  # the loop opened another epoch: what was read ahead of `old` goes
    assert micro["n"] == 2 and float(pixels) == 2.0 and waited >= 0 and feed.next is None


def test_what_reading_ahead_raises_is_raised_where_the_batch_is_wanted() -> None:
    """A one-rank stream raises `ErrorBudgetExceeded` as it reads a bad sample: read ahead, the step before
    must still end (and checkpoint) as it did, the error coming with the step that wanted the batch."""

    def failing() -> Iterator[dict[str, Any]]:
        yield {"image": torch.zeros(1)}
        raise RuntimeError("the 4th bad sample")

    feed, batches = Feed(torch.device("cpu")), failing()
    feed.take(batches)
    assert feed.ahead(batches) >= 0  # nothing raised yet: this step goes on to its read
    with pytest.raises(RuntimeError, match="the 4th bad sample"):
        feed.take(batches)
    assert feed.failed is None and feed.next is None
