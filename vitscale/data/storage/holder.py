"""Who holds a lease, and whether that process still lives on this machine (`data/storage/lease.py`).

A holder names its host, pid and start, and, where Linux tells, the machine (kernel boot id and pid
namespace: a host name alone is shared by containers and clones) and the process's start time, so a
lease whose holder provably died on this very machine can be taken over at once, and a pid reused by a
later process is not mistaken for the holder.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["DEFAULT_TTL_S", "Holder", "machine_id", "process_start"]

DEFAULT_TTL_S = 60.0
"""An S3 lease not renewed for this long belongs to a dead driver and may be taken over."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: written into it, shown to a refused writer."""

    host: str
    pid: int
    since: float
    """Unix time the lease was taken."""
    token: str
    """Random id of this holding (two holders on one host with a recycled pid still differ)."""
    ttl_s: float = DEFAULT_TTL_S
    machine: str | None = None
    """This kernel's boot and pid namespace (`machine_id`): where `pid` means this process; None = unknown."""
    started: int | None = None
    """The holder process's start time (clock ticks since boot, `process_start`): tells it from a later
    process given the same pid; None = unknown (a lease written by an older vitscale)."""

    @staticmethod
    def me(ttl_s: float) -> Holder:
        pid = os.getpid()
        return Holder(socket.gethostname(), pid, time.time(), uuid.uuid4().hex, ttl_s, machine_id(),
                      process_start(pid))

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"pid {self.pid} on host {self.host} since {when}"

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(data: bytes) -> Holder | None:
        """The holder in ``data``, or None when it is empty or not a holder (never raises)."""
        try:
            raw = json.loads(data.decode("utf-8"))
            machine, started = raw.get("machine"), raw.get("started")
            return Holder(host=str(raw["host"]), pid=int(raw["pid"]), since=float(raw["since"]),
                          token=str(raw["token"]), ttl_s=float(raw.get("ttl_s", DEFAULT_TTL_S)),
                          machine=None if machine is None else str(machine),
                          started=None if started is None else int(started))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError, AttributeError):
            return None

    def here(self) -> bool:
        """Whether `pid` names a process of this machine: same host name and, when recorded, same kernel
        boot and pid namespace (a container on another host, or beside this one, is elsewhere)."""
        return self.host == socket.gethostname() and (self.machine is None or self.machine == machine_id())

    def alive_here(self) -> bool:
        """Whether this holder may be a live process on this machine (False when it is elsewhere)."""
        return self.here() and not self.dead_here() and not no_such_process(self.pid)

    def dead_here(self) -> bool:
        """Whether this holder is provably gone: it was a process of this very machine (its recorded
        machine id is this one's) and no process with its pid and start time exists now. Unknown
        machine or start time (an older lease) proves nothing: the lease then waits for its expiry."""
        if self.machine is None or self.machine != machine_id() or self.host != socket.gethostname():
            return False
        now = process_start(self.pid)
        if now is None:
            return no_such_process(self.pid)
        return self.started is not None and now != self.started  # the pid was reused by a later process


def machine_id() -> str | None:
    """This kernel's boot id and this process's pid namespace (Linux), or None where unknown.

    A host name is no identity: containers, pods and cloned VMs share them. A pid means one process only
    within one pid namespace of one boot; two holders with the same `machine_id` see the same pids.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}/{namespace}"


def process_start(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (`/proc/PID/stat` field 22), or None when
    there is no such process or no /proc. Exact and immune to clock changes, unlike a wall time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:  # the name (field 2) may hold spaces and parentheses: count fields after its last ')'
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def no_such_process(pid: int) -> bool:
    """Whether no process of this machine has `pid` (one of another user's is one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # exists, owned by someone else
    return False
