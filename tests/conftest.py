"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
from collections.abc import Iterator

import pytest
from hypothesis import settings

# No per-example wall-clock deadline: the suite runs beside multi-process Ray runs on 2 cores, where a
# 200-ms deadline times the neighbours, not the code (a dict merge once took 251 ms there). A property
# still fails on its counter-example; speed targets live in benchmarks/.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

# One thread for torch's CPU kernels in each test process, and in the processes the tests start. `make test`
# runs two of them on 2 cores beside the Ray runs they start; torch's default, a thread per core in each,
# oversubscribes the cores, and its threads spin waiting for each other: an in-process benchmark test ran
# in 49 s beside two busy processes with the default, in 13 s with one thread (11 s alone). Ray gives its
# workers one thread per CPU they hold anyway.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402 -- after the variable: torch reads it as it loads

torch.set_num_threads(1)  # where torch was loaded before this file (a plugin)

# The tests that stop runs with Ctrl-C or a closed terminal need those signals to arrive. A suite started under
# `nohup` (SIGHUP ignored) or as a background job of a script (SIGINT ignored) passes the ignoring on to every
# process it starts, as the kernel does: those tests then failed for the way the suite was launched. Each test
# process starts from the defaults; a test that wants a signal ignored says so (`helpers/ray_runs.start`).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with a slow end-to-end run first (stable, so the order is the same on every xdist worker).

    `make test` runs whole files on 2 workers (`-n 2 --dist loadfile --no-loadscope-reorder`: xdist's
    default would reorder files by their number of tests, putting the few-test slow files last);
    most of a slow test's wall time is Ray starting processes and waiting on them, which the other
    worker's tests fill. Taking the longest first keeps one worker from starting a slow file when
    the rest is nearly done.
    """
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_files)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[str]:
    """A real S3-protocol server (moto's standalone server) on loopback; yields its endpoint URL.

    Fake credentials and region go into the environment for the whole session so boto3's standard
    credential chain finds them; no real AWS configuration on the machine is consulted.
    """
    from moto.server import ThreadedMotoServer

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "VITSCALE_S3_ENDPOINT_URL"):
            mp.delenv(k, raising=False)
        # The server's per-request access log would drown test output.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.stop()


@pytest.fixture(scope="session")
def process_group() -> None:
    """A one-rank gloo group in this process, as Ray Train would set up for a worker."""
    import torch

    if not torch.distributed.is_initialized():
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                           "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if importlib.util.find_spec("deepspeed") is not None:
        from vitscale.train.engine import init_distributed

        init_distributed(on_gpu=False)  # as a worker joins: DeepSpeed adopts the group, builds no CPU op


@pytest.fixture(scope="session")
def small_synthetic(tmp_path_factory: pytest.TempPathFactory) -> str:
    """40 synthetic images of 3 classes at 32 px in shards of 20: enough for a pipeline's checks."""
    from vitscale.data.tools.write import write_dataset

    out = tmp_path_factory.mktemp("data") / "synthetic"
    write_dataset("synthetic", str(out), shard_size=20, max_side=32, progress=False,
                  source_options={"count": 40, "classes": 3, "image_size": 32})
    return str(out)
