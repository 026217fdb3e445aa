"""The deployment configs (k8s/, cluster/, Dockerfile) agree with each other and with the pipelines they run.

Nothing here talks to a cluster. The k8s/ checks read what `kubectl kustomize` renders (tests/k8s_render.py);
schema, operator and policy checks of the same output are in test_k8s_schemas.py and test_k8s_policy.py.
Ray's own cluster-config schema checks cluster/*.yaml.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from k8s_render import K8S, OVERLAYS, ROOT, one, render
from vitscale.config import PipelineConfig
from vitscale.stages import load_pipeline

CLUSTER_FILES = [ROOT / "cluster" / "aws-gpu.yaml", ROOT / "cluster" / "local.yaml"]
GPU = "nvidia.com/gpu"


def docs_of(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def app_dir() -> str:
    """Where the Dockerfile puts the checkout (its last WORKDIR)."""
    return re.findall(r"^WORKDIR\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M)[-1]


def entrypoint_pipeline(entrypoint: str) -> tuple[Path, list[str]]:
    """(pipeline file in this checkout, --set overrides) of a `vitscale run ...` entrypoint."""
    args = shlex.split(entrypoint)
    if args[:2] != ["vitscale", "run"] or len(args) < 3:
        raise ValueError(f"entrypoint must start with `vitscale run PIPELINE`: {entrypoint!r}")
    path = Path(args[2])
    if path.is_absolute():
        path = path.relative_to(app_dir())  # the image's checkout -> this checkout
    rest, overrides = args[3:], []
    while rest:
        if rest[0] != "--set" or len(rest) < 2:
            raise ValueError(f"unexpected entrypoint arguments {rest!r}")
        overrides.append(rest[1])
        rest = rest[2:]
    return ROOT / path, overrides


def rayjob(overlay: str) -> dict[str, Any]:
    return one(render(overlay), "RayJob", OVERLAYS[overlay][0])


def overlay_pipeline(overlay: str) -> PipelineConfig:
    path, overrides = entrypoint_pipeline(rayjob(overlay)["spec"]["entrypoint"])
    if not path.is_file() and path.name == "scaling-study.yaml":
        pytest.skip("pipelines/scaling-study.yaml is not in this checkout yet (written with the study stage)")
    return load_pipeline(path, overrides)


def worker(overlay: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(worker group, its Ray container) of an overlay's RayJob cluster."""
    (group,) = rayjob(overlay)["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return group, group["template"]["spec"]["containers"][0]


def vitscale_ports(ports: list[dict[str, Any]]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in ports if p["name"].startswith("vitscale-")}


def cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def ranks_per_pod(config: PipelineConfig, limits: dict[str, Any]) -> int:
    """The most Ray Train ranks one worker pod can host: KubeRay hands the container limits to `ray start`
    (one Ray node per pod); each rank reserves cluster.cpus_per_worker CPUs (and gpus_per_worker GPUs)."""
    fit = int(cpus(limits["cpu"]) // config.cluster.cpus_per_worker)
    if config.cluster.use_gpu:
        fit = min(fit, int(limits.get(GPU, 0) // config.cluster.gpus_per_worker))
    return fit


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels + In/NotIn/Exists) matches `labels`."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pod_labels(overlay: str) -> dict[str, dict[str, str]]:
    spec = rayjob(overlay)["spec"]
    return {"head": spec["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"],
            "worker": worker(overlay)[0]["template"]["metadata"]["labels"],
            "submitter": spec["submitterPodTemplate"]["metadata"]["labels"]}


# --------------------------------------------------------------------------- k8s/, rendered


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_is_one_rayjob_with_its_own_cluster(overlay: str) -> None:
    docs = render(overlay)
    assert not [d for d in docs if d["kind"] == "RayCluster"], "no standing cluster next to the job's own"
    assert all(d["metadata"].get("namespace") == "vitscale" for d in docs if d["kind"] != "Namespace")
    job = rayjob(overlay)["spec"]
    assert job["submissionMode"] == "K8sJobMode" and job["shutdownAfterJobFinishes"] is True
    assert "clusterSelector" not in job and "command" not in job["submitterPodTemplate"]["spec"]["containers"][0]
    on_gpu = OVERLAYS[overlay][2]
    assert (job["backoffLimit"] >= 1) is on_gpu  # GPU jobs retry (resuming); the laptop run does not
    assert ({d["kind"] for d in docs} >= {"PodMonitor", "PrometheusRule", "ConfigMap"}) is on_gpu


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_entrypoint_runs_a_shipped_pipeline_under_a_stable_run_name(overlay: str) -> None:
    entrypoint = rayjob(overlay)["spec"]["entrypoint"]
    # KubeRay pastes the entrypoint into `if ...; then ...; else ray job submit -- <entrypoint>; fi`.
    lexer = shlex.shlex(entrypoint, posix=True, punctuation_chars=True)
    assert not [t for t in lexer if set(t) <= set(";&|<>()")], f"shell operators in {entrypoint!r}"
    path, overrides = entrypoint_pipeline(entrypoint)
    assert path.parent == ROOT / "pipelines" and path.name == Path(OVERLAYS[overlay][1]).name
    # A retry is a new cluster: the same run name is what makes it resume instead of starting over.
    assert any(o.startswith("cluster.run_name=") for o in overrides)
    config = overlay_pipeline(overlay)
    assert config.cluster.use_gpu is OVERLAYS[overlay][2]
    assert config.run_name == next(o.split("=", 1)[1] for o in overrides if o.startswith("cluster.run_name="))
    if OVERLAYS[overlay][2]:
        assert config.cluster.storage_path.startswith("s3://")


def test_entrypoint_parser_rejects_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="vitscale run"):
        entrypoint_pipeline("python train.py")
    with pytest.raises(ValueError, match="unexpected"):
        entrypoint_pipeline("vitscale run pipelines/pretrain.yaml --address auto")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cluster_fits_the_pipeline_and_declares_every_ranks_metrics_port(overlay: str) -> None:
    config = overlay_pipeline(overlay)
    group, container = worker(overlay)
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"], "fixed size: Ray Train starts all ranks at once"
    limits = container["resources"]["limits"]
    fit = ranks_per_pod(config, limits)
    assert fit >= 1 and group["replicas"] * fit >= config.cluster.num_workers
    if config.train.metrics_port:
        expected = {f"vitscale-lr{r}": config.train.metrics_port + r for r in range(fit)}
        assert vitscale_ports(container["ports"]) == expected
    if OVERLAYS[overlay][2]:
        assert limits[GPU] == container["resources"]["requests"][GPU] == config.cluster.gpus_per_worker
    else:
        assert GPU not in yaml.safe_dump(render(overlay)), "a GPU request or toleration survived in the CPU overlay"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_networkpolicies_select_the_ray_pods(overlay: str) -> None:
    docs = render(overlay)
    everyone, dashboard = one(docs, "NetworkPolicy", "vitscale-ray"), one(docs, "NetworkPolicy", "vitscale-ray-dashboard")
    labels = pod_labels(overlay)
    assert all(selects(everyone["spec"]["podSelector"], pod) for pod in labels.values())
    assert selects(dashboard["spec"]["podSelector"], labels["head"])
    assert not selects(dashboard["spec"]["podSelector"], labels["worker"])
    # Prometheus (monitoring namespace) reaches Ray's metrics port and every rank's port.
    scrape_rules = [r for r in everyone["spec"]["ingress"] if "ports" in r]
    ranges = [(p["port"], p.get("endPort", p["port"])) for r in scrape_rules for p in r["ports"]]
    ports = worker(overlay)[1]["ports"]
    wanted = [p["containerPort"] for p in ports if p["name"] == "metrics" or p["name"].startswith("vitscale-")]
    assert all(any(lo <= port <= hi for lo, hi in ranges) for port in wanted), (wanted, ranges)
    assert {p["port"] for r in everyone["spec"]["egress"] for p in r.get("ports", [])} >= {53, 443}


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if OVERLAYS[o][2]])
def test_podmonitors_scrape_ray_and_every_rank(overlay: str) -> None:
    docs = render(overlay)
    labels = pod_labels(overlay)
    ray, train = one(docs, "PodMonitor", "vitscale-ray"), one(docs, "PodMonitor", "vitscale-train")
    assert selects(ray["spec"]["selector"], labels["head"]) and selects(ray["spec"]["selector"], labels["worker"])
    assert selects(train["spec"]["selector"], labels["worker"]) and not selects(train["spec"]["selector"], labels["head"])
    assert [ep["port"] for ep in ray["spec"]["podMetricsEndpoints"]] == ["metrics"]
    (endpoint,) = train["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True  # the series' own run and rank labels win
    (keep,) = [r for r in endpoint["relabelings"] if r["action"] == "keep"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    names = [p["name"] for p in worker(overlay)[1]["ports"]] + ["dashboard", "gcs-server", "client"]
    kept = {n for n in names if re.fullmatch(keep["regex"], n)}  # Prometheus anchors relabel regexes
    assert kept == set(vitscale_ports(worker(overlay)[1]["ports"]))


def _images(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["image"]] if isinstance(node.get("image"), str) else []
        return found + [i for k, v in node.items() if k != "image" for i in _images(v)]
    return [i for v in node for i in _images(v)] if isinstance(node, list) else []


def test_image_and_ray_versions_agree_across_files() -> None:
    version = re.search(r'^__version__\s*=\s*"([^"]+)"', (ROOT / "vitscale/_version.py").read_text(), re.M).group(1)
    for overlay, (_, _, on_gpu) in OVERLAYS.items():
        images = set(_images(rayjob(overlay)))
        assert images == {f"vitscale:{version}" if on_gpu else f"vitscale:{version}-cpu"}, (overlay, images)
        labels = {d["metadata"].get("labels", {}).get("app.kubernetes.io/version") for d in render(overlay)}
        assert labels == {version}, (overlay, labels)
    refs = [docs_of(p)[0]["docker"]["image"] for p in CLUSTER_FILES]
    assert all(r.rsplit("/", 1)[-1] == f"vitscale:{version}" for r in refs), refs
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f'org.opencontainers.image.version="{version}"' in dockerfile
    assert f"-t vitscale:{version} ." in dockerfile and f"-t vitscale:{version}-cpu ." in dockerfile
    (ray_version,) = re.findall(r"^ARG RAY_VERSION=(\S+)", dockerfile, re.M)
    assert {rayjob(o)["spec"]["rayClusterSpec"]["rayVersion"] for o in OVERLAYS} == {ray_version}


def test_token_secret_and_dashboard_access_are_documented() -> None:
    readme = (K8S / "README.md").read_text()
    secret = rayjob("gpu")["spec"]["rayClusterSpec"]["authOptions"]["secretName"]
    assert f"create secret generic {secret}" in readme and "auth_token" in readme
    policy = one(render("gpu"), "NetworkPolicy", "vitscale-ray-dashboard")
    (label,) = policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"]
    assert f"{label}=true" in readme


# --------------------------------------------------------------------------- cluster/


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_ray_cluster_launcher_config_is_valid_and_authenticated(path: Path) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = docs_of(path)[0]
    validate_config(prepare_config(raw))  # what `ray up` checks before touching any machine
    assert raw["file_mounts"]["~/vitscale"] == "."
    # The token made on the launching machine (`ray get-auth-token --generate`) reaches every node.
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert any("pip install" in c and "~/vitscale" in c for c in raw["setup_commands"])
    head, worker_cmd = raw["head_start_ray_commands"][-1], raw["worker_start_ray_commands"][-1]
    assert "--dashboard-host=0.0.0.0" in head
    assert all("--metrics-export-port=8080" in c and "RAY_AUTH_MODE=token" in c for c in (head, worker_cmd))


def test_ray_schema_catches_a_misspelt_launcher_field() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = docs_of(CLUSTER_FILES[0])[0]
    raw["available_node_types"]["head"]["node_cfg"] = raw["available_node_types"]["head"]["node_config"]
    with pytest.raises(Exception, match="node_cfg"):
        validate_config(prepare_config(raw))


def test_dockerignore_keeps_the_build_context_small() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "data_cache", "runs", "*.egg-info"} <= ignored
