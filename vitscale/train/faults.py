"""Fault injection for tests and drills: the configured rank exits abruptly (or is sent SIGTERM) after the
configured step, once per run.

"Once per run" is remembered by a marker file in the run's *storage* (the folder or s3:// prefix
every node shares), not in a node's local run directory: Ray may restart the dead rank on another
node, which must see that the fault has already fired, or the run would die at that step forever.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from vitscale.say import say


def marker_name(rank: int, step: int) -> str:
    """The marker that says the fault of `rank` at `step` has fired."""
    return f"faults/fired-rank{rank}-step{step}.json"


def maybe_die(fault: Any, rank: int, step: int, storage: str, endpoint_url: str | None = None) -> None:
    """Exit the process (no cleanup, no exception), or send it SIGTERM, if `fault` targets this rank and step and
    has not fired."""
    if fault.kill_rank != rank or fault.kill_at_step != step:
        return
    from vitscale.data.storage import open_storage

    store = open_storage(storage, endpoint_url=endpoint_url)
    name = marker_name(rank, step)
    if store.exists(name):
        return
    store.write_bytes(name, json.dumps({"time": time.time()}).encode())
    if fault.kill_with == "SIGTERM":
        say(f"fault injection: rank {rank} is sent SIGTERM at step {step}")
        os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice: the process decides what follows
        return
    say(f"fault injection: rank {rank} exits at step {step}")
    os._exit(17)  # what a segfault or OOM kill looks like to Ray
