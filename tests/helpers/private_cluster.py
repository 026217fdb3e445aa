"""A Ray cluster of several nodes on this one machine, each with a disk of its own.

The clusters vitscale runs on (a KubeRay GPU cluster, a `ray up` cluster) give every node its own
disk; object storage is the only thing the nodes share. This module builds a cluster of that shape
on one machine so tests (and users, `make private-cluster`) can check that nothing a run needs lives
on a node's disk:

- every node is `ray start --block` inside its own mount namespace (`unshare --mount`), with a
  private `/tmp` (a host folder bind-mounted over it) and `$HOME` inside that `/tmp`, so a file one
  node writes under `/tmp` or `~` is invisible to every other node and to the driver's machine;
- every node is in a session of its own, so `kill(name)` SIGKILLs that node's raylet and all its
  workers at once, as a preempted VM would vanish, and `add(name)` brings a node of that name back;
- token authentication is on (`RAY_AUTH_MODE=token`), as in production: the token travels in the
  environment, since no file outside a node's own disk would be readable by it;
- each node carries a custom resource `node:<name>` so work can be placed on a chosen node.

Object storage is not started here (tests use the `moto_s3` fixture, a moto server on loopback).
Requires root and `unshare`; `skip_reason()` says why a machine cannot build it.

    python tests/helpers/private_cluster.py up [--workers 2] [--cpus 2]    # prints the addresses, Ctrl-C stops it
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
NODE_HOME = "/tmp/home"
"""$HOME inside every node: under the node's private /tmp, so it is private too."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def skip_reason() -> str | None:
    """Why this machine cannot build a private-disk cluster, or None when it can."""
    if RAY is None:
        return "the ray CLI is not installed"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    if os.geteuid() != 0:
        return "mount namespaces with bind mounts need root"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "mount", "-t", "tmpfs",
                            "tmpfs", "/mnt"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare --mount is not permitted here: {probe.stderr.strip()[:200]}"
    return None


@dataclass
class Node:
    """One node: its name, its private /tmp on the host, and the session its processes live in."""

    name: str
    disk: Path
    """The host folder mounted as this node's /tmp (its whole private disk)."""
    process: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def path(self, inside: str) -> Path:
        """Where a path on this node's private disk (`/tmp/...`, `~/...`) lies on the host."""
        inside = inside.replace("~", NODE_HOME, 1) if inside.startswith("~") else inside
        if not inside.startswith("/tmp"):
            raise ValueError(f"{inside!r} is not on a node's private disk (/tmp or ~)")
        return self.disk / inside.removeprefix("/tmp").lstrip("/")


@dataclass
class PrivateCluster:
    """A head and workers, each in its own mount namespace; see the module docstring."""

    workers: int = 2
    cpus: int = 2
    """CPUs each worker node offers to Ray."""
    head_cpus: int = 0
    """CPUs the head offers: none by default, as on KubeRay, so training lands on worker nodes only."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every node (e.g. AWS_* for the object storage)."""
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="vsnodes-")))
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    nodes: dict[str, Node] = field(default_factory=dict)
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_address(self) -> str:
        """What `ray job submit --address` takes."""
        return f"http://127.0.0.1:{self.dashboard_port}"

    def client_env(self) -> dict[str, str]:
        """The environment of a client on the host (`ray job submit`, `ray status`): the cluster's token."""
        # This interpreter's bin/ first, so `python`, `ray` and `vitscale` on every node are this environment's.
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        env = {**os.environ, **self.env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
               "RAY_USAGE_STATS_ENABLED": "0", "PATH": path}
        for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
            env.pop(key, None)
        return env

    # -- life cycle --------------------------------------------------------------------------------

    def start(self, timeout: float = 240) -> PrivateCluster:
        """The head, then the workers one by one; returns once every node is alive in the GCS."""
        self._start_node("head")
        # Workers give up if the head's node is not in the GCS when they start (seen on a loaded machine).
        self.wait_for_nodes(1, timeout)
        for i in range(self.workers):
            # `add` starts a node again whose `ray start` missed Ray's own 30-s start-up deadline ("The current node
            # timed out during startup"), as worker1 once did with `make test`'s other worker busy beside it.
            self.add(f"worker{i + 1}", timeout)
        return self

    def add(self, name: str, timeout: float = 180, attempts: int = 3) -> Node:
        """Bring a worker node (new, or one that was killed) into the cluster with an empty disk.

        A node whose `ray start` gives up (Ray's own start-up deadline, missed on a loaded machine) is
        started again, up to `attempts` times, as an operator or an autoscaler would.
        """
        if name in self.nodes and self.nodes[name].alive:
            raise ValueError(f"node {name} is running")
        before = self.alive_node_count()
        for attempt in range(1, attempts + 1):
            node = self._start_node(name)
            try:
                self.wait_for_nodes(before + 1, timeout)
                return node
            except TimeoutError:
                if node.alive or attempt == attempts:
                    raise
                self.kill(name)  # what the failed start left in its session (a raylet that may register late)
        raise AssertionError("unreachable")

    def kill(self, name: str) -> None:
        """SIGKILL node `name` whole: its raylet, object store, agents and every worker process on it."""
        node = self.nodes[name]
        if node.process is None:
            return
        victims = _session_members(node.process.pid)
        for process in victims:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(victims, timeout=30)
        node.process.wait(timeout=30)

    def stop(self) -> None:
        """Kill every node (workers first) and remove their disks."""
        for name in sorted(self.nodes, key=lambda n: n == "head"):
            with contextlib.suppress(Exception):
                self.kill(name)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PrivateCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what tests ask ----------------------------------------------------------------------------

    def alive_node_count(self) -> int:
        """Nodes the GCS counts as alive (through `ray list nodes`, the public state CLI)."""
        done = subprocess.run([RAY, "list", "nodes", "--format", "json", "--address", self.dashboard_address,
                               "--limit", "100"], env=self.client_env(), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            return 0
        try:
            rows = json.loads(done.stdout)
        except json.JSONDecodeError:
            return 0
        return sum(1 for row in rows if row.get("state") == "ALIVE")

    def wait_for_nodes(self, count: int, timeout: float = 180) -> None:
        """Until exactly `count` nodes are alive (a killed node's death is seen by the GCS late)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.alive_node_count() == count:
                return
            dead = [n.name for n in self.nodes.values() if n.process is not None and n.process.poll() is not None
                    and n.process.returncode not in (-signal.SIGKILL, None) and n.name == "head"]
            if dead:
                raise RuntimeError(f"the head exited: {self.tail('head')}")
            time.sleep(1)
        exited = "".join(f"\n--- {n.name} exited ({n.process.returncode}):\n{self.tail(n.name, 15)}"
                         for n in self.nodes.values() if n.process is not None and n.process.poll() is not None)
        raise TimeoutError(f"{count} alive nodes not reached in {timeout:.0f} s "
                           f"(have {self.alive_node_count()}){exited}")

    def submit(self, *argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
        """`ray job submit -- argv` to the head, with the cluster's token; the driver runs on the head node."""
        for _ in range(20):
            done = subprocess.run([RAY, "job", "submit", "--address", self.dashboard_address, "--", *argv],
                                  env=self.client_env(), capture_output=True, text=True, timeout=timeout)
            # A head that has just started may not have its job agent up yet: nothing ran, so retry.
            if "No available agent to submit job" not in done.stdout + done.stderr:
                return done
            time.sleep(3)
        return done

    def tail(self, name: str, lines: int = 40) -> str:
        log = self.nodes[name].log
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log and log.exists() else ""

    # -- internals ---------------------------------------------------------------------------------

    def _start_node(self, name: str) -> Node:
        disk = self.root / name / "disk"
        shutil.rmtree(disk, ignore_errors=True)  # a node that comes back comes back empty, as a new VM would
        (disk / "home").mkdir(parents=True)
        log = self.root / name / "ray-start.log"
        cpus = self.head_cpus if name == "head" else self.cpus
        common = ["--block", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", "--num-gpus=0",
                  f"--resources={json.dumps({f'node:{name}': 1})}", "--disable-usage-stats",
                  f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
                  "--temp-dir=/tmp/ray"]
        if name == "head":
            argv = [RAY, "start", "--head", f"--port={self.gcs_port}", f"--dashboard-port={self.dashboard_port}",
                    "--dashboard-host=127.0.0.1", f"--ray-client-server-port={free_port()}", *common]
        else:
            argv = [RAY, "start", f"--address={self.gcs_address}", *common]
        # Inside the new namespace: the node's folder over /tmp, then Ray. `exec` keeps one process tree.
        script = 'mount --bind "$1" /tmp && shift && exec "$@"'
        env = {**self.client_env(), "HOME": NODE_HOME, "TMPDIR": "/tmp"}
        process = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
                                    "sh", str(disk), *argv], env=env, stdout=log.open("wb"),
                                   stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
        node = Node(name=name, disk=disk, process=process, log=log)
        self.nodes[name] = node
        return node


def _session_members(session: int) -> list[psutil.Process]:
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(process.pid) == session:
                members.append(process)
    return members


def main() -> None:
    parser = argparse.ArgumentParser(description="A Ray cluster of nodes with private disks on this machine.")
    parser.add_argument("command", choices=["up"])
    parser.add_argument("--workers", type=int, default=2, help="worker nodes (default: 2)")
    parser.add_argument("--cpus", type=int, default=2, help="CPUs each node offers Ray (default: 2)")
    args = parser.parse_args()
    reason = skip_reason()
    if reason:
        sys.exit(f"cannot build a private-disk cluster here: {reason}")
    with PrivateCluster(workers=args.workers, cpus=args.cpus) as cluster:
        print(f"{1 + args.workers} nodes up, each with a private /tmp and $HOME under {cluster.root}\n"
              f"  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN={cluster.token}\n"
              f"  ray job submit --address {cluster.dashboard_address} -- vitscale run PIPELINE\n"
              "Ctrl-C stops every node.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while all(node.alive for node in cluster.nodes.values()):
                time.sleep(1)


if __name__ == "__main__":
    main()
