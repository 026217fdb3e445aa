"""SIGTERM and SIGHUP to a CLI verb that writes clean up as Ctrl-C does (cli/interrupt.py): a real
`vitscale shards write` in its own process, a real signal mid-write; `vitscale run` is left alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vitscale.cli import build_parser, main
from vitscale.cli.interrupt import SIGNALS, as_interruptions, is_writing


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_write_removes_what_it_wrote_and_the_folders_it_made(tmp_path: Path, signum: int) -> None:
    out = tmp_path / "x" / "y" / "z"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitscale", "shards", "write", "--source", "synthetic", "--count", "40000",
         "--image-size", "32", "--max-side", "32", "--shard-size", "50", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ})
    try:
        deadline = time.monotonic() + 120
        while not (out.is_dir() and any(p.suffix == ".tar" for p in out.iterdir())):  # mid-write: shards there
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, err
    assert err.strip() == f"vitscale: interrupted by {signal.Signals(signum).name}", err
    assert not (tmp_path / "x").exists()  # the shards, marker, lease and every folder the write created


def test_only_verbs_that_write_take_the_signals_and_only_while_they_run(tmp_path: Path) -> None:
    choices = {}
    parser = build_parser()
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        for name, sub in action.choices.items():
            nested = [a for a in sub._actions if hasattr(a, "choices") and isinstance(a.choices, dict)]
            for inner in nested:
                choices.update({f"{name} {n}": p for n, p in inner.choices.items()})
            if not nested:
                choices[name] = sub
    writing = {verb for verb, p in choices.items() if is_writing(p.get_default("func"))}
    # A run's driver stops its workers, then itself (launch/interruption.py); a worker's SIGTERM keeps its own
    # meaning, a preemption notice (train/termination.py), in processes of their own.
    assert writing == {"shards write", "shards index", "shards reindex", "shards dedup", "export", "inspect",
                       "study report", "run", "finetune"}
    before = [signal.getsignal(s) for s in SIGNALS]
    with as_interruptions(False):
        assert [signal.getsignal(s) for s in SIGNALS] == before
    with as_interruptions():
        assert all(signal.getsignal(s) not in before for s in SIGNALS)
    assert [signal.getsignal(s) for s in SIGNALS] == before
    # A signal the process was started ignoring stays ignored (`nohup vitscale run ... &` outlives its terminal).
    ignored = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with as_interruptions():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in before
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, ignored)
    assert main(["shards", "index", str(tmp_path / "none")]) == 2  # an error, and the handlers are back
    assert [signal.getsignal(s) for s in SIGNALS] == before
