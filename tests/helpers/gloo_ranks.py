"""Run a test file as the ranks of one gloo process group: one process per rank, CPU DeepSpeed.

tests/test_reshard.py and tests/test_uneven_shares.py launch themselves this way to run real ZeRO
engines and the real loop at several world sizes without Ray.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

PORT_TAKEN = ("address already in use", "eaddrinuse")
"""What rank 0's store says when the port picked for it was taken by another process before it bound it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(script: str, out: Path, world: int, *args: str, timeout_s: float = 300, tries: int = 3) -> None:
    """`python script *args` as ranks 0..world-1 (MASTER_ADDR/PORT, RANK, WORLD_SIZE set), each logging to a
    file in `out`; an AssertionError with every rank's last lines if any exits non-zero.

    The port is free when picked and bound by rank 0 a moment later; a process of the other test worker (a
    Ray node starting) may take it in between. Such a launch is run again on another port, up to `tries` in
    all; any other failure is reported at once."""
    for attempt in range(1, tries + 1):
        codes, logs = _launch_once(script, out, world, args, timeout_s)
        if not any(codes):
            return
        if attempt == tries or not _port_taken(logs):
            raise AssertionError(f"world {world} {args}: exit codes {codes}\n{logs}")


def _launch_once(script: str, out: Path, world: int, args: tuple[str, ...],
                 timeout_s: float) -> tuple[list[int], str]:
    """One launch on a newly picked port: every rank's exit code, and their logs' last lines."""
    port = str(_free_port())
    tag = "-".join((f"w{world}", *(a.rsplit("/", 1)[-1] for a in args)))
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        log = open(out / f"log-{tag}-r{rank}.txt", "w")  # noqa: SIM115 -- closed below
        procs.append((subprocess.Popen([sys.executable, script, *args], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    codes: list[int] = []
    for proc, log in procs:  # rank 0 first: the one that binds the port
        try:
            codes.append(proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        log.close()
        if codes == [codes[0]] and codes[0] and _port_taken(Path(log.name).read_text()):
            for other, _ in procs[1:]:  # waiting for a store that will never be there
                other.kill()
    return codes, "\n".join(Path(log.name).read_text()[-3000:] for _, log in procs)


def _port_taken(log: str) -> bool:
    return any(taken in log.lower() for taken in PORT_TAKEN)


def leave() -> NoReturn:
    """End a rank whose work is done and written: exit 0 without the interpreter's teardown. There a rank of
    tests/test_reshard.py aborted now and then ("terminate called without an active exception", exit -6: a C++
    thread still joinable when its object was destroyed), after every file was saved and its process group torn
    down, which failed every test of the file (2026-11-30 and 2026-12-01). A rank that failed raises before
    this and exits as Python does."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
