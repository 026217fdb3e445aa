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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_ranks(script: str, out: Path, world: int, *args: str, timeout_s: float = 300) -> None:
    """`python script *args` as ranks 0..world-1 (MASTER_ADDR/PORT, RANK, WORLD_SIZE set), each logging to a
    file in `out`; an AssertionError with every rank's last lines if any exits non-zero."""
    port = str(_free_port())
    tag = "-".join((f"w{world}", *(a.rsplit("/", 1)[-1] for a in args)))
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
        log = open(out / f"log-{tag}-r{rank}.txt", "w")  # noqa: SIM115 -- closed below
        procs.append((subprocess.Popen([sys.executable, script, *args], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        log.close()
    if any(codes):
        logs = "\n".join(Path(log.name).read_text()[-3000:] for _, log in procs)
        raise AssertionError(f"world {world} {args}: exit codes {codes}\n{logs}")
