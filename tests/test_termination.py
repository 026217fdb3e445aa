"""SIGTERM held back as a notice (train/termination.py), in a child process with a real signal.

The child stands in for a Ray worker: its main thread owns a Python SIGTERM handler that exits (as
Ray's does), and the notice is entered from another thread (as Ray's training thread does).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

CHILD = textwrap.dedent("""
    import os, signal, sys, threading, time
    from vitscale.train.termination import TerminationNotice

    signal.signal(signal.SIGTERM, lambda *_: (print("handler: exit", flush=True), os._exit(7)))
    mode, grace = sys.argv[1], float(sys.argv[2])

    def training():
        with TerminationNotice(grace, label="rank 1") as notice:
            if mode == "starved":  # the watcher thread gets no GIL until this thread lets go of it
                sys.setswitchinterval(100)
                # To this thread: the handler has run when the call returns (a signal to the process may be
                # handled by a thread the kernel schedules later), and this thread keeps the GIL meanwhile.
                signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
                print("first ask:", notice.notice(), flush=True)
                sys.setswitchinterval(0.005)
            else:  # (a second signal here could be delivered only after the context has left, on a busy host)
                os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(200):
                if notice.notice():
                    break
                time.sleep(0.01)
            print("notice:", notice.notice(), flush=True)
            if mode == "leave":
                notice.leave()
            elif mode == "hang":
                time.sleep(60)  # a step that never ends: the grace watch must end the process
        print("context left", flush=True)

    thread = threading.Thread(target=training)
    thread.start()
    while thread.is_alive():  # the main thread runs Python handlers between these sleeps
        time.sleep(0.01)
    print("main: after the context", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the process's own handler is back
    time.sleep(5)
    print("not reached", flush=True)
""")


def _run(mode: str, grace: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(grace)], capture_output=True, text=True,
                          timeout=60)
    return done.returncode, done.stdout, time.monotonic() - t0


def test_the_signal_is_held_as_a_notice_and_leave_ends_the_process_as_the_handler_would() -> None:
    code, out, _ = _run("leave", 30)
    assert "notice: rank 1 received SIGTERM" in out, out
    assert "handler: exit" in out and code == 7, (code, out)  # the process's own handler ran, after the notice
    assert "not reached" not in out


def test_leaving_the_context_without_leave_puts_the_handler_back() -> None:
    code, out, _ = _run("stay", 30)
    assert "notice: rank 1 received SIGTERM" in out and "context left" in out
    # The held signal is not replayed; the next SIGTERM goes to the process's own handler again.
    assert "main: after the context" in out and "handler: exit" in out and code == 7, (code, out)
    assert "no checkpoint within" not in out


def test_the_next_step_sees_the_signal_even_before_the_watcher_thread_runs() -> None:
    """On a busy host the watcher may wait steps on end for the GIL; the step right after the signal must
    still see it (CI once finished two more steps and the run's last before noticing)."""
    code, out, _ = _run("starved", 30)
    assert "first ask: rank 1 received SIGTERM" in out, out
    assert "context left" in out and code == 7, (code, out)


def test_a_hung_step_still_ends_within_the_grace_period() -> None:
    code, out, seconds = _run("hang", 2)
    assert "no checkpoint within 2 s of SIGTERM" in out, out
    assert "handler: exit" in out and code == 7, (code, out)
    assert "context left" not in out and seconds < 30


def test_a_fault_drill_names_how_it_kills_and_a_wrong_way_is_refused_by_its_key() -> None:
    import pytest

    from vitscale.config.checks import ConfigError
    from vitscale.stages import build_pipeline

    fault = {"kill_rank": 0, "kill_at_step": 2, "kill_with": "SIGTERM"}
    assert build_pipeline({"train": {"fault": fault}}).train.fault.kill_with == "SIGTERM"
    with pytest.raises(ConfigError, match="train.fault.kill_with"):
        build_pipeline({"train": {"fault": {**fault, "kill_with": "SIGKILL"}}})
