"""Result tables: parquet and CSV keep the numbers; the markdown shows times as people read them."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq

from vitscale.eval.tables import duration, write_table


def test_markdown_times_are_readable_and_parquet_keeps_numbers(tmp_path: Path) -> None:
    started = time.mktime((2026, 11, 23, 20, 0, 5, 0, 0, -1))
    rows = [{"trial_id": "a", "started_at": started, "wall_time_s": 3725.2, "metric": 0.51234},
            {"trial_id": "b", "started_at": None, "wall_time_s": 7.25, "metric": None}]
    write_table(rows, tmp_path, "results")
    md = (tmp_path / "results.md").read_text().splitlines()
    assert md[0] == "| trial_id | started_at | wall_time | metric |"
    assert md[2] == "| a | 2026-11-23 20:00:05 | 1:02:05 | 0.5123 |"
    assert md[3] == "| b |  | 7.2 s |  |"
    table = pq.read_table(tmp_path / "results.parquet").to_pylist()
    assert table[0]["wall_time_s"] == 3725.2 and table[0]["started_at"] == started


def test_duration() -> None:
    assert duration(0.04) == "0.0 s" and duration(59.94) == "59.9 s"
    assert duration(60) == "0:01:00" and duration(36000) == "10:00:00"
