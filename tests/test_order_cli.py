"""`vitscale shards order` shows the order training reads: the pipeline's shuffle window, seed, ranks."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.datasets import write_test_dataset
from vitscale.cli import main
from vitscale.data.loader.stream import ShardStream

PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"


def test_order_from_a_pipeline_is_the_streams_order(tmp_path, capsys):
    data = write_test_dataset(tmp_path / "ds", {"train": [12, 12, 12]})
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f"extends: {PIPELINES / 'quickstart.yaml'}\n"
                        f"data: {{url: {data}, shuffle_buffer: 4, seed: 3}}\n"
                        "train: {global_batch: 8, micro_batch: 2}\n"
                        "cluster: {num_workers: 2}\n")
    capsys.readouterr()
    assert main(["shards", "order", "--pipeline", str(pipeline), "--rank", "1", "--epoch", "2", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    # Training's layout: rank 1's share of every global batch of 8.
    stream = ShardStream(str(data), rank=1, world_size=2, seed=3, shuffle_buffer=4, batch_size=2, global_batch=8,
                         resolution=8)
    stream.set_epoch(2)
    trained = [k for b in stream for k in b["key"]]
    assert shown == trained
    # Without the pipeline's window and global batch the order differs: the flags make them agree.
    assert main(["shards", "order", str(data), "--world-size", "2", "--rank", "1", "--epoch", "2",
                 "--seed", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) != trained
    assert main(["shards", "order", str(data), "--world-size", "2", "--rank", "1", "--epoch", "2",
                 "--seed", "3", "--shuffle-buffer", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) != trained
    assert main(["shards", "order", str(data), "--world-size", "2", "--rank", "1", "--epoch", "2",
                 "--seed", "3", "--shuffle-buffer", "4", "--global-batch", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == trained


def test_order_needs_a_dataset_and_ranks(capsys):
    assert main(["shards", "order", "--rank", "0", "--epoch", "0"]) == 2
    assert "needs DEST and --world-size" in capsys.readouterr().err
