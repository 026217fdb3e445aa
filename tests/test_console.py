"""What `vitscale run` shows on the terminal: its own lines, a summary table; the rest to the log file."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from vitscale.launch.console import (
    TerminalFilter,
    library_output_to,
    route_ray_output,
    run_ended,
    summary_table,
    workers_off_terminal,
)


def _filter(tmp_path: Path) -> tuple[TerminalFilter, io.StringIO]:
    console = io.StringIO()
    (tmp_path / "logs").mkdir(exist_ok=True)
    return TerminalFilter(console, open(tmp_path / "logs" / "ray.log", "a", buffering=1)), console


def test_router_keeps_vitscales_lines_and_logs_everything(tmp_path: Path) -> None:
    # Lines as Ray prints what it forwards from workers: "(Actor pid=N, ip=IP) line", the prefix
    # in colour unless RAY_COLOR_PREFIX=0; written in pieces, as print() does.
    out, console = _filter(tmp_path)
    for line in ["(RayTrainWorker pid=7, ip=10.0.0.1) [vitscale] step 20/252 epoch 0.48 loss 2.08",
                 "(RayTrainWorker pid=7, ip=10.0.0.1) TrainingReport(checkpoint=None, metrics={'step': 20}, "
                 "validation=False)",
                 "\x1b[36m(RayTrainWorker pid=7, ip=10.0.0.1)\x1b[0m [2026-11-23 00:41:30] [INFO] "
                 "[config.py:1000:print] DeepSpeedEngine configuration:"]:
        out.write(line)
        out.write("\n")
    out.write("(_probe_task pid=8, ip=10.0.0.1) UserWarning: accelerator not found\n"
              "(_probe_task pid=8, ip=10.0.0.1)   [vitscale] rank 1 failed: ValueError: bad\n")
    out.write("(raylet) Spilled 3 MiB\n")
    out.flush()
    assert console.getvalue().splitlines() == ["[vitscale] step 20/252 epoch 0.48 loss 2.08",
                                               "[vitscale] rank 1 failed: ValueError: bad"]
    log = (tmp_path / "logs" / "ray.log").read_text()
    assert "(RayTrainWorker pid=7, ip=10.0.0.1) TrainingReport(" in log
    assert "DeepSpeedEngine configuration" in log and "(_probe_task pid=8" in log and "accelerator" in log
    assert "Spilled" in log and "\x1b[" not in log


def test_the_drivers_own_lines_pass_and_libraries_go_to_their_log(tmp_path: Path) -> None:
    out, console = _filter(tmp_path)
    out.write("[vitscale] stage pretrain\nthe summary table\n")
    with workers_off_terminal():
        out.write("(RayTrainWorker pid=7) [vitscale] step 1/2\n[vitscale] cell 1 done\n")
    with library_output_to(tmp_path / "tune.log", verbose=False):
        assert out.library_log is None  # only filters installed as sys.stdout/stderr are switched
    with open(tmp_path / "tune.log", "a", buffering=1) as log:
        out.library_log = log
        out.write("== Status ==\n[vitscale] sweep: 2 trials\n(RayTrainWorker pid=9) [vitscale] step 2/2\n")
    assert console.getvalue().splitlines() == ["[vitscale] stage pretrain", "the summary table",
                                               "[vitscale] cell 1 done", "[vitscale] sweep: 2 trials",
                                               "[vitscale] step 2/2"]
    assert "== Status ==" in (tmp_path / "tune.log").read_text()
    assert "step 1/2" in (tmp_path / "logs" / "ray.log").read_text()


def test_once_the_run_has_ended_workers_lines_no_longer_reach_the_terminal(tmp_path: Path, monkeypatch) -> None:
    # A sweep's trial still printing at Ctrl-C: its step line must not land after the CLI's resume line.
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # both are routed; both are put back after the test
    route_ray_output(tmp_path / "ray.log", verbose=False)
    out = sys.stdout
    assert isinstance(out, TerminalFilter)
    out.write("(RayTrainWorker pid=7) [vitscale] step 1/9\n")
    run_ended()
    out.write("(RayTrainWorker pid=7) [vitscale] step 2/9\nvitscale: interrupted; resume it with `vitscale run x`\n")
    assert out.terminal.getvalue().splitlines() == ["[vitscale] step 1/9",
                                                    "vitscale: interrupted; resume it with `vitscale run x`"]
    assert "step 2/9" in (tmp_path / "ray.log").read_text()  # kept in the log, in full
    route_ray_output(tmp_path / "ray.log", verbose=False)  # the next run in this process shows them again
    out.write("(RayTrainWorker pid=8) [vitscale] step 1/3\n")
    assert out.terminal.getvalue().splitlines()[-1] == "[vitscale] step 1/3"
    out.log.close()
    fresh, _ = _filter(tmp_path)  # and the end of one run says nothing about another filter's
    fresh.write("(RayTrainWorker pid=9) [vitscale] step 1/2\n")
    assert fresh.terminal.getvalue() == "[vitscale] step 1/2\n"


def test_the_console_uses_no_private_ray_module() -> None:
    # A Ray upgrade must not silently flood the terminal again: nothing in vitscale imports ray._private, but
    # for the one guarded use that puts a local Ray's head out of the driver's process group (Ray has no
    # public setting for it; a release that moves the class leaves Ray as it was: tests/test_no_orphans.py).
    import vitscale

    root = Path(vitscale.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py") if "ray._private" in p.read_text()]
    assert offenders == ["launch/local_ray.py"]
    uses = [line.strip() for line in (root / "launch" / "local_ray.py").read_text().splitlines()
            if "ray._private" in line and not line.strip().startswith(("#", '"', "`", "Ray has no"))]
    assert uses == ["from ray._private import services"]


def test_a_real_ray_run_shows_only_vitscales_lines(tmp_path: Path) -> None:
    # A driver process with a real local Ray: a task prints chatter and one vitscale line.
    script = f"""
import ray, sys
from pathlib import Path
from vitscale.launch.console import quiet_driver_logs, route_ray_output
log = Path({str(tmp_path / "ray.log")!r})
quiet_driver_logs(log, verbose=False)
ray.init(num_cpus=1, include_dashboard=False)
print("[vitscale]", route_ray_output(log, verbose=False), flush=True)
@ray.remote
def work():
    print("DeepSpeed config table", flush=True)
    print("[vitscale] step 1/1 from the worker", flush=True)
    return 1
ray.get(work.remote())
import time; time.sleep(2)  # Ray forwards worker output in the background
print("done", flush=True)
ray.shutdown()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                            env={**__import__("os").environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "[vitscale] step 1/1 from the worker" in lines and "done" in lines, result.stdout
    assert "DeepSpeed config table" not in result.stdout + result.stderr
    assert "DeepSpeed config table" in (tmp_path / "ray.log").read_text()


def test_summary_table_names_each_stage_once() -> None:
    table = summary_table([("pretrain", [("final loss", "0.27"), ("steps", "252")]),
                           ("fewshot", [("digits", "5shot 0.30")])])
    lines = table.splitlines()
    assert len(lines) == 3
    assert lines[0].split() == ["pretrain", "final", "loss", "0.27"]
    assert lines[1].split() == ["steps", "252"]  # the stage is not repeated
    assert lines[2].split()[:2] == ["fewshot", "digits"]
    assert summary_table([]) == ""


def test_ray_notices_and_unfetched_errors_go_to_the_log_only(tmp_path) -> None:
    import io
    import logging

    from vitscale.launch.console import quiet_driver_logs

    logger = logging.getLogger("ray")
    terminal = io.StringIO()
    handler = logging.StreamHandler(terminal)
    logger.addHandler(handler)
    try:
        quiet_driver_logs(tmp_path / "ray.log", verbose=False)
        for name, fn, text in (("ray", "authentication_token_setup.py", "Token authentication is enabled"),
                               ("ray", "worker.py", "a real warning"),
                               ("ray._private.worker", "worker.py", "Unhandled error (suppress with "
                                "'RAY_IGNORE_UNHANDLED_ERRORS=1'): ray::ImplicitFunc.train() RuntimeError: release "
                                "unlocked lock")):
            logging.getLogger(name).handle(logger.makeRecord(name, logging.WARNING if name == "ray" else logging.ERROR,
                                                             fn, 1, text, None, None))
        assert "a real warning" in terminal.getvalue() and "Token" not in terminal.getvalue()
        assert "Unhandled" not in terminal.getvalue()  # an interrupted sweep's trial, after vitscale's last line
        logged = (tmp_path / "ray.log").read_text()
        assert "Token authentication is enabled" in logged and "release unlocked lock" in logged
    finally:
        logger.removeHandler(handler)
        for h in list(logger.handlers):
            if isinstance(h, logging.FileHandler) and h.baseFilename == str(tmp_path / "ray.log"):
                logger.removeHandler(h)
                h.close()


def test_trial_lines_name_the_trial_and_its_values(capsys) -> None:  # type: ignore[no-untyped-def]
    from vitscale.launch.console import labelled_lines, trial_label

    label = trial_label("3f2a1_00002", {"finetune.train.base_lr": 0.003, "model.dropout": 0.1})
    assert label == "trial 3f2a1_00002 base_lr=0.003 dropout=0.1"
    with labelled_lines(label):
        print("[vitscale] step 4/8 loss 1.2")
        print("DeepSpeed chatter [vitscale] inside", end="")
        print(" a line")
    print("[vitscale] after")
    assert capsys.readouterr().out.splitlines() == [
        "[vitscale] [trial 3f2a1_00002 base_lr=0.003 dropout=0.1] step 4/8 loss 1.2",
        "DeepSpeed chatter [vitscale] inside a line", "[vitscale] after"]
