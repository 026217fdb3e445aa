"""The private-disk test cluster (tests/private_cluster.py) has the shape of a real multi-node cluster.

Each node's /tmp and $HOME are its own; object storage (moto on loopback) is the only thing nodes
share; a node can be SIGKILLed whole and come back with an empty disk; token authentication is on.
"""

from __future__ import annotations

import json
import secrets
import textwrap
from pathlib import Path

import boto3
import pytest

from private_cluster import PrivateCluster

pytestmark = pytest.mark.slow

# Run as a Ray job: the driver runs on the head node; each task is placed on one node by its resource.
PROBE = textwrap.dedent("""
    import json, os, sys
    import boto3, ray

    ray.init(log_to_driver=False)
    bucket, endpoint = sys.argv[1], sys.argv[2]

    @ray.remote(num_cpus=0)
    def write(node):
        os.makedirs(os.path.expanduser("~"), exist_ok=True)
        for path in ("/tmp/private-" + node, os.path.expanduser("~/home-" + node)):
            with open(path, "w") as f:
                f.write(node)
        boto3.client("s3", endpoint_url=endpoint).put_object(Bucket=bucket, Key="from-" + node, Body=node.encode())
        return os.environ["HOME"]

    @ray.remote(num_cpus=0)
    def read(node, other):
        seen_local = [os.path.exists(p) for p in ("/tmp/private-" + other, os.path.expanduser("~/home-" + other))]
        body = boto3.client("s3", endpoint_url=endpoint).get_object(Bucket=bucket, Key="from-" + other)["Body"].read()
        return {"local": seen_local, "s3": body.decode()}

    on = lambda node: {"resources": {"node:" + node: 0.01}}
    home = ray.get(write.options(**on("worker1")).remote("worker1"))
    print("RESULT " + json.dumps({"home": home, "worker2": ray.get(read.options(**on("worker2")).remote("worker2", "worker1")),
                                  "worker1": ray.get(read.options(**on("worker1")).remote("worker1", "worker1"))}))
""")


@pytest.fixture(scope="module")
def cluster(moto_s3: str, tmp_path_factory: pytest.TempPathFactory):
    from private_cluster import skip_reason

    reason = skip_reason()
    if reason:
        pytest.skip(f"no private-disk cluster on this machine: {reason}")
    with PrivateCluster(workers=2, cpus=1, env={"AWS_ENDPOINT_URL": moto_s3}) as c:
        yield c


def _probe(cluster: PrivateCluster, moto_s3: str) -> dict:
    bucket = f"probe-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=moto_s3).create_bucket(Bucket=bucket)
    # The script travels in the command line: the head cannot see this machine's /tmp.
    done = cluster.submit("python", "-c", PROBE, bucket, moto_s3)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_nodes_share_object_storage_and_nothing_else(cluster: PrivateCluster, moto_s3: str, tmp_path: Path) -> None:
    result = _probe(cluster, moto_s3)
    assert result["home"] == "/tmp/home"
    # Worker 2 cannot see worker 1's /tmp or ~, but reads what it put in the bucket.
    assert result["worker2"] == {"local": [False, False], "s3": "worker1"}
    assert result["worker1"] == {"local": [True, True], "s3": "worker1"}
    # On the host, worker 1's files are on its disk only.
    assert cluster.nodes["worker1"].path("/tmp/private-worker1").read_text() == "worker1"
    assert cluster.nodes["worker1"].path("~/home-worker1").read_text() == "worker1"
    for name in ("head", "worker2"):
        assert not cluster.nodes[name].path("/tmp/private-worker1").exists()


def test_a_killed_node_leaves_and_comes_back_empty(cluster: PrivateCluster, moto_s3: str, tmp_path: Path) -> None:
    _probe(cluster, moto_s3)
    assert cluster.nodes["worker1"].path("/tmp/private-worker1").exists()
    cluster.kill("worker1")
    cluster.wait_for_nodes(2, timeout=120)  # the GCS marks it dead
    assert not cluster.nodes["worker1"].alive
    cluster.add("worker1")
    assert not cluster.nodes["worker1"].path("/tmp/private-worker1").exists()  # a new node, a new disk
    assert _probe(cluster, moto_s3)["worker2"]["s3"] == "worker1"  # placed on the new node, it runs


def test_the_cluster_refuses_a_client_without_its_token(cluster: PrivateCluster, tmp_path: Path) -> None:
    import subprocess

    from private_cluster import RAY

    env = {k: v for k, v in cluster.client_env().items() if not k.startswith("RAY_AUTH")} | {"HOME": str(tmp_path)}
    done = subprocess.run([RAY, "job", "submit", "--address", cluster.dashboard_address, "--", "echo", "ran"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "ran" not in done.stdout.split("Running entrypoint")[-1]
