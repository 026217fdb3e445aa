"""A real Prometheus server (Debian's `prometheus` package) on loopback, for tests, and promtool.

`ensure_prometheus()` installs the package when it is missing and this user may (root or passwordless
sudo: what `make install-test-tools` does), so a fresh machine runs the monitoring tests; without
either, the test skips and says why (helpers/tools.py).
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from helpers.tools import need_tools


def ensure_prometheus() -> tuple[str, str]:
    """(prometheus, promtool) executables, installing Debian's package if they are not on PATH and this
    user may; the calling test skips with the reason where not (helpers/tools.py)."""
    prometheus, promtool = need_tools("prometheus", "prometheus", "promtool")
    return prometheus, promtool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRICS_PORTS = range(20000, 32000)
"""Where a run's `train.metrics_port` is picked for a test: below the kernel's ephemeral ports (32768 on), which
every Ray process binds its gRPC servers on, and above Ray's worker ports (10002-19999). A port the kernel handed
out was free when picked and could be a Ray process's (this run's, or the other test worker's) a moment later: a
suite once scraped an HTTP/2 server there ("Unsolicited response ... \\x00\\x00\\x18\\x04") and rank 0's
metrics went to the fallback port, unscraped."""


def metrics_ports(count: int) -> int:
    """The first of `count` consecutive free ports in `METRICS_PORTS` (a rank's port: metrics_port + local rank)."""
    rng = random.Random()
    for _ in range(1000):
        first = rng.randrange(METRICS_PORTS.start, METRICS_PORTS.stop - count)
        try:
            with contextlib.ExitStack() as held:
                for port in range(first, first + count):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports in {METRICS_PORTS}")


class PrometheusServer:
    """Scrapes `targets` (host:port) every second; stopped by stop()."""

    def __init__(self, workdir: Path, targets: list[str], rule_file: Path | None = None) -> None:
        prometheus, _ = ensure_prometheus()
        self.port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": "vitscale", "static_configs": [{"targets": targets}]}]}
        if rule_file is not None:
            config["rule_files"] = [str(rule_file)]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self._log = (workdir / "prometheus.log").open("w")
        self._proc = subprocess.Popen(
            [prometheus, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not become ready: {(workdir / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        """The HTTP API's answer to an instant query (status, data or error), errors included."""
        params = {"query": expr, **({} if at is None else {"time": f"{at:.3f}"})}
        url = f"http://127.0.0.1:{self.port}/api/v1/query?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # 400/422: a bad expression; the body says why
            return json.loads(e.read())

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
