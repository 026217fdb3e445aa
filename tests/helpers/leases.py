"""A run's or a dataset's lease held by another real process (a `python -c` that takes it and sleeps), killed
with SIGKILL where a test needs a crashed writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

HOLD = """
import sys, time
from vitscale.data.storage.lease import hold_run_lease
lease = hold_run_lease(sys.argv[1], ttl_s=float(sys.argv[2]), endpoint_url=sys.argv[3] or None)
print("held", flush=True)
time.sleep(600)
"""


def holder(url: str, ttl_s: float = 60.0, endpoint: str = "") -> subprocess.Popen:
    """A process that holds the lease of `url` until killed (returns once it holds it)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, url, str(ttl_s), endpoint], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ})
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if line.strip() != "held":
        proc.kill()
        raise AssertionError(f"holder did not take the lease: {line!r} {proc.stderr.read()}")  # type: ignore[union-attr]
    return proc


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
