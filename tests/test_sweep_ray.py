"""The sweep stage on a real local Ray, driven through `vitscale run` as a user would.

- TensorBoard is the sweep's live view: a real TensorBoard server on loopback, pointed at the run
  directory, serves every trial's dev-accuracy series, equal to what Tune recorded.
- A sweep whose driver is SIGKILLed as soon as its first trial has ended (before Tune's own record of
  the experiment, copied every >= 10 s, says so) resumes when run again: the finished trial is not run
  again (it keeps its start and finish times), the unfinished one resumes its own Train checkpoints,
  and the table ends with every trial once.
- A trial that fails is a row with its error, and the sweep goes on to select a winner.
- A finished sweep run again with another grid is refused in one line, before Ray starts.

Every sweep is tiny (a one-block ViT at 16 px, one worker per trial, two trials at a time); what
costs time is Ray and Ray Train starting up.
"""

from __future__ import annotations

import contextlib
import glob
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from helpers.ray_runs import RUN_TIMEOUT_S, finished, kill_tree, run, start
from vitscale.config.loader import merge
from vitscale.data.tools.write import write_dataset
from vitscale.stages.sweep_results import FINAL_REPORT

pytestmark = pytest.mark.slow
psutil = pytest.importorskip("psutil")
pytest.importorskip("ray")

BIN = Path(sys.executable).parent
VITSCALE = str(BIN / "vitscale")
MODEL = {"name": "ViT-Ti/8", "img_size": 16, "depth": 1, "width": 32, "mlp_dim": 32, "heads": 2}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny 3-class dataset, a copy of it whose training shards are unreadable, and ViT weights."""
    import torch

    from vitscale.models import create_model, export_state_dict

    root = tmp_path_factory.mktemp("sweep-assets")
    data = root / "data"
    write_dataset("synthetic", str(data), shard_size=40, max_side=16, progress=False,
                  splits={"train": 0.8, "test": 0.2}, source_options={"count": 100, "classes": 3, "image_size": 16})
    # Metadata and index intact, so every check on the driver passes; the bytes of every training
    # shard zeroed, so no training sample can be read: the trial fails in its worker, every time.
    broken = root / "broken"
    shutil.copytree(data, broken)
    for shard in broken.glob("train-*.tar"):
        shard.write_bytes(bytes(shard.stat().st_size))
    torch.manual_seed(0)
    weights = root / "weights.pt"
    export_state_dict(create_model("ViT-Ti/8", num_classes=5, **{k: v for k, v in MODEL.items() if k != "name"}),
                      weights)
    return {"data": str(data), "broken": str(broken), "weights": str(weights)}


def write_pipeline(path: Path, assets: dict[str, str], name: str, space: dict[str, list[Any]],
                   finetune: dict[str, Any] | None = None, sweep: dict[str, Any] | None = None) -> Path:
    raw = {
        "name": name,
        "stages": ["sweep"],
        "model": MODEL,
        "finetune": merge({"checkpoint": assets["weights"], "resolution": 16, "dev_fraction": 0.2,
                           "data": {"url": assets["data"], "num_workers": 0},
                           "train": {"base_lr": 0.01, "max_steps": 6, "global_batch": 8, "micro_batch": 8,
                                     "precision": "fp32", "log_every": 2}}, finetune or {}),
        "sweep": {"scheduler": "grid", "workers_per_trial": 1, "retrain": False, "space": space, **(sweep or {})},
        # max_failures 0: a deterministic failure is not retried three more times inside its trial
        # (Tune retries the trial itself, sweep.trial_retries times).
        "cluster": {"num_workers": 1, "use_gpu": False, "cpus_per_worker": 1, "local_num_cpus": 2,
                    "max_failures": 0, "storage_path": str(path.parent / "runs")},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


# -- reading what Tune and the stage wrote --------------------------------------------------------


def tune_results(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Trial id -> {"dir": its folder in the Tune experiment, "lines": its result.json records}."""
    trials: dict[str, dict[str, Any]] = {}
    for path in sorted(glob.glob(str(run_dir / "sweep-trials" / "*" / "result.json"))):
        lines = []
        for line in Path(path).read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # the last line may be half-written
                lines.append(json.loads(line))
        trial_id = next((r["trial_id"] for r in lines if "trial_id" in r), None)
        if trial_id is not None:
            trials[trial_id] = {"dir": Path(path).parent, "lines": lines}
    return trials


def results_table(run_dir: Path) -> list[dict[str, Any]]:
    import pandas as pd

    return pd.read_parquet(run_dir / "sweep" / "results.parquet").to_dict("records")


def saved_reports(storage: Path, name: str) -> dict[str, dict[str, Any]]:
    """Trial id -> the final report the trial saved in its own folder as it ended (`sweep/trials/<id>`)."""
    return {p.parent.name: json.loads(p.read_text())
            for p in (storage / name / "sweep" / "trials").glob(f"*/{FINAL_REPORT}")}


def train_checkpoints(storage: Path, name: str, trial_id: str) -> list[int]:
    """Steps of the checkpoints the trial's own Train run (inside the run: `<run>/sweep/trials/<id>`) has written."""
    return sorted(int(p.name.split("_")[1]) for p in (storage / name / "sweep" / "trials" / trial_id).glob("checkpoint_*")
                  if p.is_dir())


# -- TensorBoard ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def tensorboard(logdir: Path, log: Path):
    """A real TensorBoard server on loopback; yields its base URL once it answers."""
    port = _free_port()
    script = BIN / "tensorboard"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "tensorboard.main"]
    with log.open("w") as out:
        proc = subprocess.Popen([*command, "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port),
                                 "--reload_interval", "1"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"TensorBoard exited: {log.read_text()[-2000:]}"
            try:
                _get_json(f"{url}/data/runs")
                break
            except OSError:
                assert time.monotonic() < deadline, f"TensorBoard did not answer: {log.read_text()[-2000:]}"
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_tensorboard_serves_every_trials_accuracy_curve(assets: dict[str, str], tmp_path: Path) -> None:
    # Dev accuracy every 2 of 6 steps: three points per trial, and the trial's final report.
    # With `scratch_baseline`, the pre-trained and the random-weights winners are then retrained
    # side by side (the cluster fits both), each tested once.
    pipeline = write_pipeline(tmp_path / "tb.yaml", assets, "tb", {"finetune.train.base_lr": [0.003, 0.03]},
                              finetune={"train": {"eval_every": 2}}, sweep={"retrain": True, "scratch_baseline": True})
    output = run(pipeline, tmp_path / "tb.log")
    run_dir = tmp_path / "runs" / "tb"
    for folder in (run_dir / "sweep", run_dir / "sweep" / "scratch"):
        selected = json.loads((folder / "selected.json").read_text())
        assert 0.0 <= selected["test_accuracy"] <= 1.0 and selected["params"]["finetune.train.base_lr"] in (0.003, 0.03)
    for final in (run_dir / "sweep" / "final", run_dir / "sweep" / "scratch" / "final"):  # inside the run
        assert [p.name for p in final.glob("checkpoint_*") if p.is_dir()] == ["checkpoint_000000006"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["tb"]  # nothing of the run beside it
    assert "[vitscale] retraining 2 winners at once" in output
    assert set(json.loads(output.strip().splitlines()[-1])["finetune"]) == {"pretrained", "scratch"}
    rows = {r["trial_id"]: r for r in results_table(run_dir)}
    trials = tune_results(run_dir)
    assert set(trials) == set(rows) and len(rows) == 2

    tag = "ray/tune/dev_accuracy"  # Tune's TensorBoard logger writes every reported metric under ray/tune/
    expected = {}
    for trial_id, trial in trials.items():
        run_name = trial["dir"].relative_to(run_dir).as_posix()  # TensorBoard's run: the folder under logdir
        points = [(r["training_iteration"], r["dev_accuracy"]) for r in trial["lines"] if "dev_accuracy" in r]
        assert len(points) >= 3, (trial_id, points)  # measured along the way, not only at the end
        expected[run_name] = (trial_id, points)

    with tensorboard(run_dir, tmp_path / "tensorboard.log") as url:
        deadline = time.monotonic() + 120
        while True:  # TensorBoard loads event files in the background
            tags = _get_json(f"{url}/data/plugin/scalars/tags")
            if all(tag in tags.get(name, {}) for name in expected):
                break
            assert time.monotonic() < deadline, f"runs/tags TensorBoard serves: {json.dumps(tags)[:2000]}"
            time.sleep(1)
        for name, (trial_id, points) in expected.items():
            query = urllib.parse.urlencode({"run": name, "tag": tag})
            series = _get_json(f"{url}/data/plugin/scalars/scalars?{query}")  # [[wall_time, step, value], ...]
            # Event files hold float32 values; the steps are Tune's training iterations.
            assert [(step, value) for _, step, value in series] == \
                [(it, float(np.float32(acc))) for it, acc in points], name
            assert series[-1][2] == pytest.approx(rows[trial_id]["metric"], rel=1e-6)


@pytest.mark.parametrize("stop", ["SIGKILL", "Ctrl-C"])
def test_a_stopped_sweep_resumes_where_it_stopped(stop: str, assets: dict[str, str], tmp_path: Path) -> None:
    """Killed (the driver's whole process tree SIGKILLed) or interrupted (SIGINT to the driver, as Ctrl-C
    sends it as soon as the trials are training: the CLI's one line naming the command that resumes, exit
    130, no process left): the same command resumes (after Ctrl-C the resume is as after the kill, from the
    trials' own checkpoints and Tune's record; measured once by hand, not here, to keep the suite's minutes)."""
    # Two trials at once: a short one that finishes first and a long one (checkpointed every 200
    # steps) that is still training when the driver is killed, once the short one has saved its final
    # report and the long one a checkpoint. The long one runs about 100 steps/s here: 2,000 steps leave
    # it training well after that, however far apart the two trials' workers start on two busy cores.
    name, long_steps = "resume", 2000
    pipeline = write_pipeline(tmp_path / "resume.yaml", assets, name, {"finetune.train.max_steps": [4, long_steps]},
                              finetune={"train": {"checkpoint_every": 200, "log_every": 200}})
    storage, run_dir = tmp_path / "runs", tmp_path / "runs" / name
    log = tmp_path / "first.log"

    proc = start(pipeline, log)
    finished: dict[str, dict[str, Any]] = {}
    others: dict[str, list[int]] = {}
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the sweep ended before it could be killed:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no trial finished in time:\n{log.read_text()[-4000:]}"
            finished = saved_reports(storage, name)
            others = {p.name: train_checkpoints(storage, name, p.name)
                      for p in (run_dir / "sweep" / "trials").glob("*") if p.name not in finished}
            # Ctrl-C only needs trials running (a checkpoint written); the kill is followed by a resume
            # that must skip a finished trial and continue an unfinished one's checkpoints.
            if any(others.values()) and (finished or stop == "Ctrl-C"):
                break
            time.sleep(0.2)
        if stop == "Ctrl-C":
            tree = psutil.Process(proc.pid).children(recursive=True)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 130, log.read_text()[-4000:]
            last = log.read_text().rstrip("\n").splitlines()[-1]
            assert last == (f"vitscale: interrupted; the run is kept at {run_dir}: resume it from its last "
                            f"complete checkpoint with `vitscale run {pipeline}`"), log.read_text()[-4000:]
            _, alive = psutil.wait_procs(tree, timeout=30)
            survivors = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        else:
            survivors = kill_tree(proc)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert not survivors, f"processes of the stopped sweep still running: {survivors}"
    if stop == "Ctrl-C":
        return
    assert len(finished) == 1 and len(others) == 1, (finished, others, log.read_text()[-4000:])
    (first_id, first), (second_id, before_kill) = next(iter(finished.items())), next(iter(others.items()))
    assert first["step"] == 4 and before_kill[-1] < long_steps, (first, before_kill)

    output = run(pipeline, tmp_path / "second.log")
    assert "resuming the sweep" in output
    # The unfinished trial's own Train run resumed from one of its checkpoints (its rank 0 says so).
    resumed = [line for line in output.splitlines() if "resumed from" in line and f"{name}/sweep/trials/{second_id}/" in line]
    assert resumed, output[-4000:]
    assert any(f"at step {step} " in resumed[0] for step in before_kill), (resumed, before_kill)

    rows = results_table(run_dir)
    assert sorted(r["trial_id"] for r in rows) == sorted([first_id, second_id])  # every trial, once
    assert all(r["status"] == "finished" for r in rows), rows
    by_id = {r["trial_id"]: r for r in rows}
    # The finished trial was not run again: its times are those it had before the kill.
    assert by_id[first_id]["started_at"] == first["started_at"]
    assert by_id[first_id]["finished_at"] == first["finished_at"]
    assert by_id[first_id]["steps"] == 4 and by_id[first_id]["metric"] == first["dev_accuracy"]
    assert by_id[second_id]["steps"] == long_steps and isinstance(by_id[second_id]["metric"], float)
    assert train_checkpoints(storage, name, second_id)[-1] == long_steps
    selected = json.loads((run_dir / "sweep" / "selected.json").read_text())
    assert selected["trial_id"] in by_id


def test_a_failed_trial_is_a_row_with_its_error(assets: dict[str, str], tmp_path: Path) -> None:
    # One grid value points at the dataset whose training shards are unreadable: it passes every
    # check on the driver and fails in its worker, on the first attempt and on the retry.
    pipeline = write_pipeline(tmp_path / "fail.yaml", assets, "fail",
                              {"finetune.data.url": [assets["data"], assets["broken"]]}, sweep={"trial_retries": 1})
    output = run(pipeline, tmp_path / "fail.log")
    run_dir = tmp_path / "runs" / "fail"
    rows = {r["finetune.data.url"]: r for r in results_table(run_dir)}
    assert set(rows) == {assets["data"], assets["broken"]}
    failed, good = rows[assets["broken"]], rows[assets["data"]]
    assert failed["status"] == "error", failed
    assert failed["metric"] is None or np.isnan(failed["metric"]), failed  # no score: it never trained
    # The row names the worker's own error, not Ray's wrappers around it.
    assert "ErrorBudgetExceeded" in failed["error"] and "train-000000.tar" in failed["error"], failed["error"]
    assert good["status"] == "finished" and isinstance(good["metric"], float)
    selected = json.loads((run_dir / "sweep" / "selected.json").read_text())
    assert selected["trial_id"] == good["trial_id"] and selected["params"] == {"finetune.data.url": assets["data"]}
    assert "error" in output and good["trial_id"] in output
    # Where it was raised is in the run's log, written by the driver from the trial's error (Ray's forwarding of
    # the worker's own lines is not waited for).
    log = (run_dir / "logs" / "ray.log").read_text()
    assert re.search(rf"\[vitscale\] trial {failed['trial_id']}: the traceback of rank 0, as Ray Train returned it "
                     r"to the driver:\nTraceback \(most recent call last\):\n(?:.*\n)*?.*ErrorBudgetExceeded", log), \
        log[-3000:]

    # Run again with another grid: Tune's restore answered it with this sweep's trials and winner, exit 0. Now
    # the sweep's record (sweep/config.yaml) refuses it in one line naming the changed key, before Ray starts
    # (the same grid again resumes: the stopped sweep's test above).
    other = write_pipeline(tmp_path / "other.yaml", assets, "fail",
                           {"finetune.data.url": [assets["data"]]}, sweep={"trial_retries": 1})
    code, again = finished(other, tmp_path / "other.log")
    lines = again.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("vitscale: error: sweep.space.finetune.data.url:"), \
        again[-4000:]
    assert sorted(r["finetune.data.url"] for r in results_table(run_dir)) == sorted([assets["data"], assets["broken"]])

