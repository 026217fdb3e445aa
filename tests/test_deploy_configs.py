"""The deployment configs (k8s/, cluster/, Dockerfile) agree with each other and with the pipelines they run.

Nothing here talks to a cluster. The source checks read the YAML files as written: the base manifests,
and in the overlays only the JSON-patch operations that set the values checked (no kustomize emulation).
Where `kubectl` is on PATH, its built-in kustomize also builds every kustomization and the same
invariants are checked on what `kubectl apply -k` would send. Ray's own cluster-config schema checks
cluster/*.yaml.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from vitscale.stages import load_pipeline
from vitscale.config import PipelineConfig

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
BASE = K8S / "base"
OVERLAYS = {"pretrain-gpu": True, "quickstart-cpu": False}  # overlay -> runs on GPUs
KUSTOMIZE_DIRS = [BASE] + [K8S / "overlays" / name for name in OVERLAYS]
CLUSTER_FILES = [ROOT / "cluster" / "aws-gpu.yaml", ROOT / "cluster" / "local.yaml"]
WORKER_PREFIX = "/spec/workerGroupSpecs/0/template/spec/containers/0"
HEAD_PREFIX = "/spec/headGroupSpec/template/spec/containers/0"
GPU = "nvidia.com/gpu"

# Field names of the KubeRay ray.io/v1 types (ray-operator/apis/ray/v1/raycluster_types.go, rayjob_types.go)
# and of prometheus-operator's PodMonitor (pkg/apis/monitoring/v1/podmonitor_types.go): a misspelt
# field is dropped silently by the API server's pruning, so it is caught here.
RAYCLUSTER_SPEC = {"headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling",
                   "autoscalerOptions", "headServiceAnnotations", "suspend"}
HEAD_GROUP = {"serviceType", "headService", "enableIngress", "rayStartParams", "template"}
WORKER_GROUP = {"groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "rayStartParams",
                "template", "scaleStrategy"}
RAYJOB_SPEC = {"activeDeadlineSeconds", "backoffLimit", "rayClusterSpec", "submitterPodTemplate", "metadata",
               "clusterSelector", "submitterConfig", "managedBy", "deletionStrategy", "entrypoint",
               "runtimeEnvYAML", "jobId", "submissionMode", "entrypointResources", "entrypointNumCpus",
               "entrypointNumGpus", "ttlSecondsAfterFinished", "shutdownAfterJobFinishes", "suspend", "schedule"}
PODMONITOR_SPEC = {"jobLabel", "podTargetLabels", "podMetricsEndpoints", "selector", "namespaceSelector",
                   "sampleLimit", "targetLimit", "scrapeProtocols", "labelLimit", "labelNameLengthLimit",
                   "labelValueLengthLimit", "keepDroppedTargets", "attachMetadata", "scrapeClass"}
POD_METRICS_ENDPOINT = {"port", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout",
                        "tlsConfig", "bearerTokenSecret", "honorLabels", "honorTimestamps",
                        "trackTimestampsStaleness", "basicAuth", "oauth2", "authorization",
                        "metricRelabelings", "relabelings", "proxyUrl", "followRedirects", "enableHttp2",
                        "filterRunning"}
RELABEL = {"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"}


# --------------------------------------------------------------------------- reading the sources


def docs_of(path: Path) -> list[Any]:
    """Every YAML document of a file (empty documents dropped)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def kustomization(directory: Path) -> dict[str, Any]:
    return docs_of(directory / "kustomization.yaml")[0]


def local_resources(directory: Path) -> list[dict[str, Any]]:
    """The manifests a kustomization lists as files of its own directory."""
    out: list[dict[str, Any]] = []
    for entry in kustomization(directory).get("resources", []):
        if (directory / entry).is_file():
            out += docs_of(directory / entry)
    return out


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def base_docs() -> list[dict[str, Any]]:
    return local_resources(BASE)


def raycluster_patch(overlay: str) -> list[dict[str, Any]]:
    """The JSON-patch operations an overlay applies to the base RayCluster."""
    ops: list[dict[str, Any]] = []
    for patch in kustomization(K8S / "overlays" / overlay).get("patches", []):
        if patch.get("target", {}).get("kind") == "RayCluster":
            ops += docs_of(K8S / "overlays" / overlay / patch["path"])[0]
    return ops


def patched(overlay: str, path: str, default: Any) -> Any:
    """The value an overlay's RayCluster patch sets at exactly `path` (last add/replace wins), else default."""
    value = default
    for op in raycluster_patch(overlay):
        if op["path"] == path and op["op"] in ("add", "replace"):
            value = op["value"]
    return value


def removed(overlay: str, path: str) -> bool:
    return any(op["op"] == "remove" and op["path"] == path for op in raycluster_patch(overlay))


def base_spec() -> dict[str, Any]:
    return one(base_docs(), "RayCluster", "vitscale")["spec"]


def container(template: dict[str, Any]) -> dict[str, Any]:
    return template["spec"]["containers"][0]  # KubeRay: the Ray container comes first


def app_dir() -> str:
    """Where the Dockerfile puts the checkout (its last WORKDIR)."""
    return re.findall(r"^WORKDIR\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M)[-1]


def overlay_rayjob(overlay: str) -> dict[str, Any]:
    return one(local_resources(K8S / "overlays" / overlay), "RayJob")


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


def overlay_pipeline(overlay: str) -> PipelineConfig:
    path, overrides = entrypoint_pipeline(overlay_rayjob(overlay)["spec"]["entrypoint"])
    return load_pipeline(path, overrides)


def vitscale_ports(ports: list[dict[str, Any]]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in ports if p["name"].startswith("vitscale-")}


def cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def ranks_per_pod(config: PipelineConfig, limits: dict[str, Any]) -> int:
    """The most Ray Train ranks one worker pod can host.

    KubeRay hands the container limits to `ray start` (one Ray node per pod); each rank reserves
    cluster.cpus_per_worker CPUs and, on GPU runs, cluster.gpus_per_worker GPUs.
    """
    fit = int(cpus(limits["cpu"]) // config.cluster.cpus_per_worker)
    if config.cluster.use_gpu:
        fit = min(fit, int(limits.get(GPU, 0) // config.cluster.gpus_per_worker))
    return fit


def expected_ports(config: PipelineConfig, limits: dict[str, Any]) -> dict[str, int]:
    """The rank with local rank r in a pod serves Prometheus metrics on train.metrics_port + r
    (vitscale/train/loop.py, r = Ray Train's get_local_rank()): one port per rank the pod can host."""
    assert config.train.metrics_port, "the pipeline run on Kubernetes must set train.metrics_port"
    return {f"vitscale-lr{r}": config.train.metrics_port + r for r in range(ranks_per_pod(config, limits))}


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


def pod_labels(overlay: str | None) -> dict[str, dict[str, str]]:
    spec = base_spec()
    out = {"head": spec["headGroupSpec"]["template"]["metadata"]["labels"],
           "worker": spec["workerGroupSpecs"][0]["template"]["metadata"]["labels"]}
    if overlay is not None:
        out["submitter"] = overlay_rayjob(overlay)["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    return out


def worker_ports(overlay: str | None) -> list[dict[str, Any]]:
    ports = container(base_spec()["workerGroupSpecs"][0]["template"])["ports"]
    return ports if overlay is None else patched(overlay, f"{WORKER_PREFIX}/ports", ports)


def worker_limits(overlay: str | None) -> dict[str, Any]:
    resources = container(base_spec()["workerGroupSpecs"][0]["template"])["resources"]
    return (resources if overlay is None else patched(overlay, f"{WORKER_PREFIX}/resources", resources))["limits"]


# --------------------------------------------------------------------------- source checks


@pytest.mark.parametrize("path", sorted([*K8S.rglob("*.yaml"), *CLUSTER_FILES]), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_file_parses(path: Path) -> None:
    docs = docs_of(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(d, (dict, list)) for d in docs)


@pytest.mark.parametrize("directory", KUSTOMIZE_DIRS, ids=lambda p: str(p.relative_to(ROOT)))
def test_kustomization_references_exist(directory: Path) -> None:
    kust = kustomization(directory)
    for entry in kust["resources"]:
        target = directory / entry
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{directory}: {entry} missing"
    for patch in kust.get("patches", []):
        assert (directory / patch["path"]).is_file(), f"{directory}: patch {patch['path']} missing"
    for replacement in kust.get("replacements", []):
        src, (target,) = replacement["source"], replacement["targets"]
        assert src["kind"] == "RayCluster" and src["name"] == "vitscale" and src["fieldPath"] == "spec"
        job = one(local_resources(directory), "RayJob", target["select"]["name"])
        assert target["fieldPaths"] == ["spec.rayClusterSpec"] and "rayClusterSpec" not in job["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_entrypoint_runs_a_shipped_pipeline(overlay: str) -> None:
    entrypoint = overlay_rayjob(overlay)["spec"]["entrypoint"]
    # KubeRay pastes the entrypoint into `if ...; then ...; else ray job submit -- <entrypoint>; fi`.
    lexer = shlex.shlex(entrypoint, posix=True, punctuation_chars=True)
    assert not [t for t in lexer if set(t) <= set(";&|<>()")], f"shell operators in {entrypoint!r}"
    path, overrides = entrypoint_pipeline(entrypoint)
    assert path.is_file() and path.parent == ROOT / "pipelines", path
    config = load_pipeline(path, overrides)
    assert config.cluster.use_gpu is OVERLAYS[overlay]


def test_entrypoint_parser_rejects_what_it_cannot_read() -> None:
    with pytest.raises(ValueError, match="vitscale run"):
        entrypoint_pipeline("python train.py")
    with pytest.raises(ValueError, match="unexpected"):
        entrypoint_pipeline("vitscale run pipelines/pretrain.yaml --address auto")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_ports_are_every_local_rank_a_pod_can_host(overlay: str) -> None:
    config = overlay_pipeline(overlay)
    assert vitscale_ports(worker_ports(overlay)) == expected_ports(config, worker_limits(overlay))


def test_base_ports_are_its_one_gpu_pods_single_rank() -> None:
    # Independent of the replica count: every one-GPU pod hosts local rank 0 only, on metrics_port.
    config = load_pipeline(ROOT / "pipelines" / "pretrain.yaml")
    assert worker_limits(None)[GPU] == 1
    assert vitscale_ports(worker_ports(None)) == {"vitscale-lr0": config.train.metrics_port}
    assert expected_ports(config, worker_limits(None)) == {"vitscale-lr0": config.train.metrics_port}


def test_ranks_per_pod_counts_gpus_and_cpus() -> None:
    gpu = load_pipeline(ROOT / "pipelines" / "pretrain.yaml")  # 10 CPUs, 1 GPU per rank
    assert ranks_per_pod(gpu, {"cpu": "88", GPU: 8}) == 8  # a whole 8-GPU node: ports 9400..9407
    assert ranks_per_pod(gpu, {"cpu": "40", GPU: 8}) == 4  # CPU-bound
    assert ranks_per_pod(gpu, {"cpu": "11"}) == 0
    cpu = load_pipeline(ROOT / "pipelines" / "quickstart.yaml")  # 1 CPU per rank, no GPU
    assert ranks_per_pod(cpu, {"cpu": "2"}) == 2 and ranks_per_pod(cpu, {"cpu": "1500m"}) == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_requests_only_where_the_pipeline_uses_gpus(overlay: str) -> None:
    base_worker = container(base_spec()["workerGroupSpecs"][0]["template"])
    resources = patched(overlay, f"{WORKER_PREFIX}/resources", base_worker["resources"])
    head = patched(overlay, f"{HEAD_PREFIX}/resources", container(base_spec()["headGroupSpec"]["template"])["resources"])
    assert GPU not in head.get("requests", {}) and GPU not in head.get("limits", {})
    if OVERLAYS[overlay]:
        gpus = overlay_pipeline(overlay).cluster.gpus_per_worker
        assert resources["requests"][GPU] == resources["limits"][GPU] == gpus
    else:
        assert GPU not in resources.get("requests", {}) and GPU not in resources.get("limits", {})
        assert removed(overlay, "/spec/workerGroupSpecs/0/template/spec/tolerations")
        assert {"name": "DS_ACCELERATOR", "value": "cpu"} in patched(overlay, f"{WORKER_PREFIX}/env", [])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cluster_is_big_enough_for_the_pipeline(overlay: str) -> None:
    config = overlay_pipeline(overlay)
    group = base_spec()["workerGroupSpecs"][0]
    sizes = {k: patched(overlay, f"/spec/workerGroupSpecs/0/{k}", group[k]) for k in ("replicas", "minReplicas", "maxReplicas")}
    assert len(set(sizes.values())) == 1, f"fixed-size group expected, got {sizes}"
    # KubeRay hands the container limits to `ray start`; each rank reserves cpus_per_worker (and a GPU).
    fit = ranks_per_pod(config, worker_limits(overlay))
    assert fit >= 1 and sizes["replicas"] * fit >= config.cluster.num_workers


@pytest.mark.parametrize("overlay", [None, *OVERLAYS])
def test_networkpolicies_select_the_ray_pods(overlay: str | None) -> None:
    policies = {p["metadata"]["name"]: p for p in base_docs() if p["kind"] == "NetworkPolicy"}
    labels = pod_labels(overlay)
    everyone, dashboard = policies["vitscale-ray"], policies["vitscale-ray-dashboard"]
    assert all(selects(everyone["spec"]["podSelector"], pod) for pod in labels.values())
    assert selects(dashboard["spec"]["podSelector"], labels["head"])
    assert not selects(dashboard["spec"]["podSelector"], labels["worker"])
    head_ports = {p["name"]: p["containerPort"] for p in container(base_spec()["headGroupSpec"]["template"])["ports"]}
    assert [p["port"] for rule in dashboard["spec"]["ingress"] for p in rule["ports"]] == [head_ports["dashboard"]]
    # Prometheus (monitoring namespace) reaches Ray's metrics port and every rank's port.
    scrape_rules = [r for r in everyone["spec"]["ingress"] if "ports" in r]
    ranges = [(p["port"], p.get("endPort", p["port"])) for r in scrape_rules for p in r["ports"]]
    wanted = [head_ports["metrics"], *vitscale_ports(worker_ports(overlay)).values()]
    assert all(any(lo <= port <= hi for lo, hi in ranges) for port in wanted), (wanted, ranges)
    assert {p["port"] for r in everyone["spec"]["egress"] for p in r.get("ports", [])} >= {53, 443}


@pytest.mark.parametrize("overlay", [None, *OVERLAYS])
def test_podmonitor_scrapes_ray_and_every_rank(overlay: str | None) -> None:
    monitor = one(base_docs(), "PodMonitor", "vitscale")
    assert set(monitor["spec"]) <= PODMONITOR_SPEC
    labels = pod_labels(overlay)
    assert selects(monitor["spec"]["selector"], labels["head"]) and selects(monitor["spec"]["selector"], labels["worker"])
    ray_ep, vit_ep = monitor["spec"]["podMetricsEndpoints"]
    assert all(set(ep) <= POD_METRICS_ENDPOINT for ep in (ray_ep, vit_ep))
    assert all(set(r) <= RELABEL for r in vit_ep["relabelings"])
    assert ray_ep["port"] in {p["name"] for p in worker_ports(overlay)}
    (keep,) = [r for r in vit_ep["relabelings"] if r["action"] == "keep"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    names = [p["name"] for p in worker_ports(overlay)] + ["dashboard", "gcs-server", "client"]
    kept = {n for n in names if re.fullmatch(keep["regex"], n)}  # Prometheus anchors relabel regexes
    assert kept == set(vitscale_ports(worker_ports(overlay)))


def _images(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["image"]] if isinstance(node.get("image"), str) else []
        return found + [i for k, v in node.items() if k != "image" for i in _images(v)]
    return [i for v in node for i in _images(v)] if isinstance(node, list) else []


def test_image_and_ray_versions_agree_across_files() -> None:
    version = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    refs = [i for p in K8S.rglob("*.yaml") for d in docs_of(p) for i in _images(d)]
    refs += [docs_of(p)[0]["docker"]["image"] for p in CLUSTER_FILES]
    refs += [f"{e['newName']}:{e['newTag']}" for d in KUSTOMIZE_DIRS for e in kustomization(d).get("images", [])]
    assert len(refs) >= 8
    for ref in refs:
        repo, tag = ref.rsplit(":", 1)
        assert repo.rsplit("/", 1)[-1] == "vitscale" and tag in (version, f"{version}-cpu"), ref
    cpu_tag = {d.name: [e["newTag"] for e in kustomization(d).get("images", [])] for d in KUSTOMIZE_DIRS}
    assert cpu_tag["quickstart-cpu"] == [f"{version}-cpu"] and cpu_tag["pretrain-gpu"] == [version]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert f'org.opencontainers.image.version="{version}"' in dockerfile
    assert f"-t vitscale:{version} ." in dockerfile and f"-t vitscale:{version}-cpu ." in dockerfile
    (ray_version,) = re.findall(r"^ARG RAY_VERSION=(\S+)", dockerfile, re.M)
    assert base_spec()["rayVersion"] == ray_version


def test_kuberay_and_job_fields() -> None:
    spec = base_spec()
    assert set(spec) <= RAYCLUSTER_SPEC and set(spec["headGroupSpec"]) <= HEAD_GROUP
    assert all(set(group) <= WORKER_GROUP for group in spec["workerGroupSpecs"])
    assert [g["groupName"] for g in spec["workerGroupSpecs"]] == ["gpu"]  # the patches address group 0
    for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
        # map[string]string in the CRD: a bare number or yes/no would be rejected by the API server.
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        assert all(isinstance(v, str) for v in group["template"]["metadata"]["labels"].values())
        pod = group["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["serviceAccountName"] == "vitscale"
        shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert [m["mountPath"] for m in container(group["template"])["volumeMounts"]
                if m["name"] in {v["name"] for v in shm}] == ["/dev/shm"]
        assert {"secretRef": {"name": "vitscale-s3", "optional": True}} in container(group["template"])["envFrom"]
    for overlay in OVERLAYS:
        job = overlay_rayjob(overlay)["spec"]
        assert set(job) <= RAYJOB_SPEC and "clusterSelector" not in job
        assert job["submissionMode"] == "K8sJobMode" and job["shutdownAfterJobFinishes"] is True
        assert isinstance(job["ttlSecondsAfterFinished"], int) and job["ttlSecondsAfterFinished"] >= 0
        assert "command" not in job["submitterPodTemplate"]["spec"]["containers"][0]  # KubeRay fills it in
        # Without this annotation the overlay would also create the base cluster, idle next to the job's.
        assert patched(overlay, "/metadata/annotations", {}) == {"config.kubernetes.io/local-config": "true"}


def test_dashboard_access_label_is_documented() -> None:
    policy = one(base_docs(), "NetworkPolicy", "vitscale-ray-dashboard")
    (label,) = policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"]
    assert f"{label}=true" in (K8S / "README.md").read_text()


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=lambda p: p.name)
def test_ray_cluster_launcher_config_is_valid(path: Path) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = docs_of(path)[0]
    validate_config(prepare_config(raw))  # what `ray up` checks before touching any machine
    assert raw["file_mounts"] == {"~/vitscale": "."}
    assert any("pip install" in c and "~/vitscale" in c for c in raw["setup_commands"])
    head, worker = raw["head_start_ray_commands"][-1], raw["worker_start_ray_commands"][-1]
    assert "--dashboard-host=0.0.0.0" in head
    assert all("--metrics-export-port=8080" in c for c in (head, worker))


def test_ray_schema_catches_a_misspelt_launcher_field() -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = docs_of(CLUSTER_FILES[0])[0]
    raw["available_node_types"]["head"]["node_cfg"] = raw["available_node_types"]["head"]["node_config"]
    with pytest.raises(Exception, match="node_cfg"):
        validate_config(prepare_config(raw))


def test_dockerignore_keeps_the_build_context_small() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "data_cache", "runs", "*.egg-info"} <= ignored


# --------------------------------------------------------------------------- what kustomize builds

KUBECTL = shutil.which("kubectl")


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict[str, Any]]]:
    if KUBECTL is None:
        pytest.skip("kubectl not on PATH: kustomize output not checked")
    out = {}
    for directory in KUSTOMIZE_DIRS:
        result = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        out[directory.name] = [d for d in yaml.safe_load_all(result.stdout) if d]
    return out


def test_built_base_is_a_standing_cluster(built: dict[str, list[dict[str, Any]]]) -> None:
    docs = built["base"]
    one(docs, "RayCluster", "vitscale")
    assert not [d for d in docs if d["kind"] == "RayJob"]
    assert all(d["metadata"].get("namespace") == "vitscale" for d in docs if d["kind"] != "Namespace")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_built_overlay_is_one_rayjob_with_its_cluster(overlay: str, built: dict[str, list[dict[str, Any]]]) -> None:
    docs = built[overlay]
    assert not [d for d in docs if d["kind"] == "RayCluster"], "the base cluster must not be created too"
    assert all(d["metadata"].get("namespace") == "vitscale" for d in docs if d["kind"] != "Namespace")
    job = one(docs, "RayJob")
    cluster = job["spec"]["rayClusterSpec"]
    assert set(cluster) <= RAYCLUSTER_SPEC and set(job["spec"]) <= RAYJOB_SPEC
    config = overlay_pipeline(overlay)
    (group,) = cluster["workerGroupSpecs"]
    worker, head = container(group["template"]), container(cluster["headGroupSpec"]["template"])
    assert vitscale_ports(worker["ports"]) == expected_ports(config, worker["resources"]["limits"])
    if OVERLAYS[overlay]:
        assert worker["resources"]["limits"][GPU] == config.cluster.gpus_per_worker
        assert group["replicas"] * worker["resources"]["limits"][GPU] >= config.cluster.num_workers
        one(docs, "PodMonitor", "vitscale")
    else:
        assert GPU not in yaml.safe_dump(docs), "a GPU request or toleration survived in the CPU overlay"
        assert not [d for d in docs if d["kind"] == "PodMonitor"]
        assert group["replicas"] == config.cluster.num_workers
    tag = kustomization(K8S / "overlays" / overlay)["images"][0]["newTag"]
    assert {i.rsplit(":", 1)[1] for i in _images(job)} == {tag}
    policy = one(docs, "NetworkPolicy", "vitscale-ray")
    templates = [cluster["headGroupSpec"]["template"], group["template"], job["spec"]["submitterPodTemplate"]]
    assert all(selects(policy["spec"]["podSelector"], t["metadata"]["labels"]) for t in templates)
    assert head["ports"] and GPU not in head["resources"]["limits"]
