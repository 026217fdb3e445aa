"""What `vitscale run` shows on the terminal: its own lines, a summary table; the rest to the log file."""

from __future__ import annotations

import io
from pathlib import Path

from vitscale.launch.console import LogRouter, summary_table


def test_router_keeps_vitscales_lines_and_logs_everything(tmp_path: Path) -> None:
    console = io.StringIO()
    router = LogRouter(tmp_path / "logs" / "ray.log", console=console)
    router({"pid": 7, "ip": "10.0.0.1", "actor_name": "RayTrainWorker", "is_err": False, "lines": [
        "[vitscale] step 20/252 epoch 0.48 loss 2.08",
        "TrainingReport(checkpoint=None, metrics={'step': 20}, validation=False)",
        "[2026-11-23 00:41:30] [INFO] [config.py:1000:print] DeepSpeedEngine configuration:",
    ]})
    router({"pid": 8, "ip": "10.0.0.1", "task_name": "_probe_task", "is_err": True,
            "lines": ["UserWarning: accelerator not found", "  [vitscale] rank 1 failed: ValueError: bad"]})
    assert console.getvalue().splitlines() == ["[vitscale] step 20/252 epoch 0.48 loss 2.08",
                                               "[vitscale] rank 1 failed: ValueError: bad"]
    log = (tmp_path / "logs" / "ray.log").read_text()
    assert "(RayTrainWorker pid=7, ip=10.0.0.1) TrainingReport(" in log
    assert "DeepSpeedEngine configuration" in log and "(_probe_task pid=8" in log and "accelerator" in log


def test_summary_table_names_each_stage_once() -> None:
    table = summary_table([("pretrain", [("final loss", "0.27"), ("steps", "252")]),
                           ("fewshot", [("digits", "5shot 0.30")])])
    lines = table.splitlines()
    assert len(lines) == 3
    assert lines[0].split() == ["pretrain", "final", "loss", "0.27"]
    assert lines[1].split() == ["steps", "252"]  # the stage is not repeated
    assert lines[2].split()[:2] == ["fewshot", "digits"]
    assert summary_table([]) == ""


def test_ray_notices_go_to_the_log_only(tmp_path) -> None:
    import io
    import logging

    from vitscale.launch.console import quiet_driver_logs

    logger = logging.getLogger("ray")
    terminal = io.StringIO()
    handler = logging.StreamHandler(terminal)
    logger.addHandler(handler)
    try:
        quiet_driver_logs(tmp_path / "ray.log", verbose=False)
        for fn, text in (("authentication_token_setup.py", "Token authentication is enabled"),
                         ("worker.py", "a real warning")):
            logger.handle(logger.makeRecord("ray", logging.WARNING, fn, 1, text, None, None))
        assert "a real warning" in terminal.getvalue() and "Token" not in terminal.getvalue()
        assert "Token authentication is enabled" in (tmp_path / "ray.log").read_text()
    finally:
        logger.removeHandler(handler)
        for h in list(logger.handlers):
            if isinstance(h, logging.FileHandler) and h.baseFilename == str(tmp_path / "ray.log"):
                logger.removeHandler(h)
                h.close()
