"""The deployment configs (k8s/, cluster/, Dockerfile) agree with each other and with the pipelines they run.

Nothing here talks to a cluster. The k8s/ checks read what `kubectl kustomize` renders (tests/helpers/k8s_render.py);
schema, operator and policy checks of the same output are in test_k8s_schemas.py and test_k8s_policy.py.
Ray's own cluster-config schema checks cluster/*.yaml, and botocore's EC2 model the AWS node configs in it.
"""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers.k8s_policy import DRAIN_ENV, PREEMPTION_GRACE_S, SPOT_LABELS, drain_seconds, on_spot
from helpers.k8s_render import K8S, OVERLAYS, ROOT, one, render
from vitscale.config import PipelineConfig
from vitscale.config.pipeline import ClusterConfig
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


def workers(overlay: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(worker group, its Ray container) of each group of an overlay's RayJob cluster."""
    groups = rayjob(overlay)["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return [(group, group["template"]["spec"]["containers"][0]) for group in groups]


def worker_range(config: PipelineConfig) -> tuple[int, int]:
    """(MIN, MAX) of the pipeline's cluster.num_workers: N, or an elastic [MIN, MAX]."""
    n = config.cluster.num_workers
    return (n, n) if isinstance(n, int) else (n[0], n[-1])


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
    """Labels of the head, the submitter and each worker group's pods ("worker <group>")."""
    spec = rayjob(overlay)["spec"]
    return {"head": spec["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"],
            **{f"worker {g['groupName']}": g["template"]["metadata"]["labels"] for g, _ in workers(overlay)},
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
    capacity = 0
    for group, container in workers(overlay):
        if on_spot(group["template"]["spec"]):
            # KubeRay keeps asking for all of them, and replaces each one a preemption takes.
            assert group["replicas"] == group["maxReplicas"] >= group["minReplicas"]
        else:
            assert group["replicas"] == group["minReplicas"] == group["maxReplicas"], \
                "fixed size: Ray Train starts all ranks at once"
        limits = container["resources"]["limits"]
        fit = ranks_per_pod(config, limits)
        assert fit >= 1
        capacity += group["replicas"] * fit
        if config.train.metrics_port:
            expected = {f"vitscale-lr{r}": config.train.metrics_port + r for r in range(fit)}
            assert vitscale_ports(container["ports"]) == expected
        if OVERLAYS[overlay][2]:
            assert limits[GPU] == container["resources"]["requests"][GPU] == config.cluster.gpus_per_worker
    assert capacity >= worker_range(config)[1]
    if not OVERLAYS[overlay][2]:
        assert GPU not in yaml.safe_dump(render(overlay)), "a GPU request or toleration survived in the CPU overlay"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_networkpolicies_select_the_ray_pods(overlay: str) -> None:
    docs = render(overlay)
    everyone, dashboard = one(docs, "NetworkPolicy", "vitscale-ray"), one(docs, "NetworkPolicy", "vitscale-ray-dashboard")
    labels = pod_labels(overlay)
    assert all(selects(everyone["spec"]["podSelector"], pod) for pod in labels.values())
    assert selects(dashboard["spec"]["podSelector"], labels["head"])
    assert not any(selects(dashboard["spec"]["podSelector"], pod) for name, pod in labels.items() if name.startswith("worker"))
    # Prometheus (monitoring namespace) reaches Ray's metrics port and every rank's port.
    scrape_rules = [r for r in everyone["spec"]["ingress"] if "ports" in r]
    ranges = [(p["port"], p.get("endPort", p["port"])) for r in scrape_rules for p in r["ports"]]
    ports = [p for _, container in workers(overlay) for p in container["ports"]]
    wanted = [p["containerPort"] for p in ports if p["name"] == "metrics" or p["name"].startswith("vitscale-")]
    assert all(any(lo <= port <= hi for lo, hi in ranges) for port in wanted), (wanted, ranges)
    assert {p["port"] for r in everyone["spec"]["egress"] for p in r.get("ports", [])} >= {53, 443}


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if OVERLAYS[o][2]])
def test_podmonitors_scrape_ray_and_every_rank(overlay: str) -> None:
    docs = render(overlay)
    labels = pod_labels(overlay)
    ray, train = one(docs, "PodMonitor", "vitscale-ray"), one(docs, "PodMonitor", "vitscale-train")
    assert selects(ray["spec"]["selector"], labels["head"]) and not selects(train["spec"]["selector"], labels["head"])
    assert [ep["port"] for ep in ray["spec"]["podMetricsEndpoints"]] == ["metrics"]
    (endpoint,) = train["spec"]["podMetricsEndpoints"]
    assert endpoint["honorLabels"] is True  # the series' own run and rank labels win
    (keep,) = [r for r in endpoint["relabelings"] if r["action"] == "keep"]
    assert keep["sourceLabels"] == ["__meta_kubernetes_pod_container_port_name"]
    for group, container in workers(overlay):
        pod = labels[f"worker {group['groupName']}"]
        assert selects(ray["spec"]["selector"], pod) and selects(train["spec"]["selector"], pod)
        names = [p["name"] for p in container["ports"]] + ["dashboard", "gcs-server", "client"]
        kept = {n for n in names if re.fullmatch(keep["regex"], n)}  # Prometheus anchors relabel regexes
        assert kept == set(vitscale_ports(container["ports"]))


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


# --------------------------------------------------------------------------- k8s/: spot capacity

SPOT_OVERLAY = "gpu-spot"
#: The notice EKS (the spot component's default provider) gives before it reclaims a spot node: the drain
#: must end inside it (k8s/components/spot/raycluster-spot.yaml).
EKS_NOTICE_S = 120
GPU_NODE, GPU_TAINT = {"nvidia.com/gpu.present": "true"}, {"key": GPU, "value": "present", "effect": "NoSchedule"}
#: A spot node's labels and taints on each provider (k8s/README.md's table); the GPU's are added below.
SPOT_NODES = {
    "EKS": ({"eks.amazonaws.com/capacityType": "SPOT"}, []),
    "Karpenter": ({"karpenter.sh/capacity-type": "spot"}, []),
    "GKE": ({"cloud.google.com/gke-spot": "true"},
            [{"key": "cloud.google.com/gke-spot", "value": "true", "effect": "NoSchedule"}]),
    "AKS": ({"kubernetes.azure.com/scalesetpriority": "spot"},
            [{"key": "kubernetes.azure.com/scalesetpriority", "value": "spot", "effect": "NoSchedule"}]),
}
ON_DEMAND_GPU_NODE = ({"eks.amazonaws.com/capacityType": "ON_DEMAND", **GPU_NODE}, [GPU_TAINT])
CPU_NODE: tuple[dict[str, str], list[dict[str, str]]] = ({"eks.amazonaws.com/capacityType": "ON_DEMAND"}, [])


def preemption_grace_s(config: PipelineConfig) -> float:
    """The pipeline's cluster.preemption_grace_s (its documented default where this checkout lacks the field)."""
    return getattr(config.cluster, "preemption_grace_s", PREEMPTION_GRACE_S)


def spot_and_fixed(overlay: str) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], list[tuple[dict[str, Any], dict[str, Any]]]]:
    groups = workers(overlay)
    return ([(g, c) for g, c in groups if on_spot(g["template"]["spec"])],
            [(g, c) for g, c in groups if not on_spot(g["template"]["spec"])])


def tolerates(pod: dict[str, Any], taint: dict[str, str]) -> bool:
    for t in pod.get("tolerations", []):
        if t.get("effect") and t["effect"] != taint["effect"]:
            continue
        if t.get("operator", "Equal") == "Exists" and t.get("key") in (None, "", taint["key"]):
            return True
        if t.get("operator", "Equal") == "Equal" and t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def schedulable(pod: dict[str, Any], node: tuple[dict[str, str], list[dict[str, str]]]) -> bool:
    """Whether the scheduler may put a pod (spec) on a node (labels, taints): nodeSelector, required node
    affinity, NoSchedule/NoExecute taints."""
    labels, taints = node
    if any(labels.get(k) != v for k, v in pod.get("nodeSelector", {}).items()):
        return False
    required = pod.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms", [])
    if terms and not any(selects(term, labels) for term in terms):
        return False
    return all(tolerates(pod, t) for t in taints if t["effect"] in ("NoSchedule", "NoExecute"))


def test_spot_group_sizes_follow_the_pipelines_worker_range() -> None:
    config = overlay_pipeline(SPOT_OVERLAY)
    low, high = worker_range(config)
    spot, fixed = spot_and_fixed(SPOT_OVERLAY)
    assert [g["groupName"] for g, _ in spot] == ["gpu-spot"] and fixed
    names = [g["groupName"] for g, _ in spot + fixed]
    assert len(set(names)) == len(names), "KubeRay finds a group's pods by its name"
    (per_pod,) = {ranks_per_pod(config, c["resources"]["limits"]) for _, c in spot + fixed}
    assert per_pod == 1, "one rank per GPU pod: replicas x GPUs a pod = workers"
    ((group, _),) = spot
    floor = sum(g["replicas"] for g, _ in fixed)  # on-demand pods: replicas == minReplicas == maxReplicas
    assert 0 <= floor * per_pod <= low
    assert ((floor + group["minReplicas"]) * per_pod, (floor + group["maxReplicas"]) * per_pod) == (low, high)
    assert group["replicas"] == group["maxReplicas"], "KubeRay keeps asking for every spot pod, and replaces lost ones"


def test_the_spot_overlay_runs_the_gpu_overlays_run_elastic() -> None:
    """Same pipeline, run name and storage as k8s/overlays/gpu (switching overlays resumes the run), only
    cluster.num_workers differs: a range the spot pods grow into, whose every size has a batch plan."""
    from dataclasses import replace

    spot, plain = overlay_pipeline(SPOT_OVERLAY), overlay_pipeline("gpu")
    low, high = worker_range(spot)
    assert low < high and high == worker_range(plain)[1]
    assert replace(spot, cluster=replace(spot.cluster, num_workers=plain.cluster.num_workers)) == plain
    spot.train.check_batch_split(range(low, high + 1))


def test_spot_pods_are_the_gpu_pods_but_for_where_they_run_and_how_they_end() -> None:
    spot, fixed = spot_and_fixed(SPOT_OVERLAY)

    def core(group: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        template = copy.deepcopy(group["template"])
        pod = template["spec"]
        for key in ("affinity", "terminationGracePeriodSeconds"):
            pod.pop(key, None)
        pod["nodeSelector"] = {k: v for k, v in pod.get("nodeSelector", {}).items() if k not in SPOT_LABELS}
        pod["tolerations"] = [t for t in pod.get("tolerations", []) if t["key"] not in SPOT_LABELS]
        for c in pod["containers"]:
            c["env"] = [e for e in c.get("env", []) if e["name"] not in (DRAIN_ENV, "RAY_NODE_MARKET_TYPE")]
        return template, group["rayStartParams"]

    assert core(spot[0][0]) == core(fixed[0][0])


def test_spot_pods_outlast_the_grace_checkpoint() -> None:
    grace = preemption_grace_s(overlay_pipeline(SPOT_OVERLAY))
    ((group, container),), _ = spot_and_fixed(SPOT_OVERLAY)
    pod = group["template"]["spec"]
    assert any(e["name"] == DRAIN_ENV for e in container["env"]), "set: Ray's default (30 s) is no checkpoint's"
    drain = drain_seconds(container)
    assert 0 < drain < EKS_NOTICE_S, "the preempted ranks' checkpoint ends before the node does"
    assert pod["terminationGracePeriodSeconds"] > max(drain, grace)
    # The pod's SIGTERM is the notice: no preStop hook before it, and KubeRay's own command, which runs
    # `ray start --block` as the container's PID 1 (its SIGTERM handler starts the drain).
    assert "lifecycle" not in container and "command" not in container and "args" not in container
    assert {"name": "RAY_NODE_MARKET_TYPE", "value": "spot"} in container["env"]


def test_the_policys_grace_period_is_the_pipelines_default() -> None:
    default = getattr(ClusterConfig(), "preemption_grace_s", None)
    if default is None:
        pytest.skip("cluster.preemption_grace_s is not in this checkout's ClusterConfig yet")
    assert default == PREEMPTION_GRACE_S


@pytest.mark.parametrize("provider", SPOT_NODES)
def test_spot_pods_land_on_spot_nodes_and_nothing_else_does(provider: str) -> None:
    spec = rayjob(SPOT_OVERLAY)["spec"]["rayClusterSpec"]
    head = spec["headGroupSpec"]["template"]["spec"]
    (spot,), (fixed,) = [[g["template"]["spec"] for g, _ in part] for part in spot_and_fixed(SPOT_OVERLAY)]
    labels, taints = SPOT_NODES[provider]
    spot_gpu_node = ({**labels, **GPU_NODE}, [GPU_TAINT, *taints])
    # The manifest selects EKS's spot label; another provider's is one nodeSelector entry away (the
    # tolerations already cover every provider's spot taint).
    assert schedulable(spot, spot_gpu_node) is (provider == "EKS")
    switched = copy.deepcopy(spot)
    switched["nodeSelector"] = {k: v for k, v in spot["nodeSelector"].items() if k not in SPOT_LABELS} | labels
    assert schedulable(switched, spot_gpu_node)
    assert not schedulable(switched, ON_DEMAND_GPU_NODE) and not schedulable(switched, CPU_NODE)
    # The head and the on-demand group never land on spot nodes, tainted or not.
    assert not schedulable(fixed, spot_gpu_node) and not schedulable(head, (labels, taints))
    assert schedulable(fixed, ON_DEMAND_GPU_NODE) and schedulable(head, CPU_NODE)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_spot_capacity_is_documented_and_linked() -> None:
    readme, patch = (K8S / "README.md").read_text(), (K8S / "components/spot/raycluster-spot.yaml").read_text()
    for text in (readme, patch):
        assert all(label in text for label in SPOT_LABELS)
        assert all(word in text for word in ("cluster.preemption_grace_s", DRAIN_ENV, "terminationGracePeriodSeconds"))
    resume = (ROOT / "docs" / "resume.md").read_text()
    section = resume.split("## Spot capacity", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\(([^)]+)\)", section)
    assert {link.split("#")[0] for link in links} >= {"../k8s/README.md", "../cluster/README.md"}
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / "docs" / path).resolve()
        assert target.is_file() and ROOT in target.parents, link  # inside the repository
        headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
        assert not anchor or anchor in {_anchor(h) for h in headings}, link


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


def aws_config() -> dict[str, Any]:
    return docs_of(CLUSTER_FILES[0])[0]


def run_instances_problems(node_config: dict[str, Any]) -> list[str]:
    """What EC2 would refuse in a node_config, by botocore's EC2 model: Ray hands it to `ec2.create_instances`
    (RunInstances) with the counts and a subnet. Unknown or mistyped fields, and values outside an enum."""
    import botocore.session
    from botocore.validate import ParamValidator

    shape = botocore.session.get_session().get_service_model("ec2").operation_model("RunInstances").input_shape
    request = {**node_config, "MinCount": 1, "MaxCount": 1, "SubnetId": "subnet-0123456789abcdef0"}
    report = ParamValidator().validate(request, shape)
    problems = [report.generate_report()] if report.has_errors() else []

    def enums(value: Any, shape: Any, path: str) -> None:
        if shape.type_name == "structure" and isinstance(value, dict):
            for key, sub in value.items():
                if key in shape.members:
                    enums(sub, shape.members[key], f"{path}.{key}")
        elif shape.type_name == "list" and isinstance(value, list):
            for i, sub in enumerate(value):
                enums(sub, shape.member, f"{path}[{i}]")
        elif getattr(shape, "enum", None) and value not in shape.enum:
            problems.append(f"{path}: {value!r} is not one of {shape.enum}")

    enums(request, shape, "")
    return problems


@pytest.mark.parametrize("node_type", sorted(aws_config()["available_node_types"]))
def test_aws_node_configs_are_requests_ec2_accepts(node_type: str) -> None:
    assert run_instances_problems(aws_config()["available_node_types"][node_type]["node_config"]) == []


@pytest.mark.parametrize("mutate,expected", [
    (lambda market: market.update(MarketType="Spot"), "'Spot' is not one of"),
    (lambda market: market["SpotOptions"].update(InstanceInterruptionBehaviour="terminate"), "Unknown parameter"),
    (lambda market: market["SpotOptions"].update(MaxPrice=2.5), "Invalid type"),
], ids=["market type enum", "misspelt field", "price not a string"])
def test_ec2_request_check_catches_a_broken_spot_request(mutate: Any, expected: str) -> None:
    node_config = aws_config()["available_node_types"]["gpu_h100_spot"]["node_config"]
    mutate(node_config["InstanceMarketOptions"])
    assert any(expected in p for p in run_instances_problems(node_config))


def test_aws_spot_node_type_is_the_on_demand_machine_on_spot() -> None:
    raw = aws_config()
    types = raw["available_node_types"]
    spot = {name: t for name, t in types.items() if "InstanceMarketOptions" in t["node_config"]}
    assert list(spot) == ["gpu_h100_spot"]
    node_type, on_demand = spot["gpu_h100_spot"], types["gpu_h100"]
    market = node_type["node_config"]["InstanceMarketOptions"]
    assert market == {"MarketType": "spot", "SpotOptions": {"SpotInstanceType": "one-time",
                                                             "InstanceInterruptionBehavior": "terminate"}}
    # The same machine (same GPUs, same pace), so one run may use both.
    assert {k: v for k, v in node_type["node_config"].items() if k != "InstanceMarketOptions"} == on_demand["node_config"]
    assert node_type["resources"] == {"CPU": 192, "GPU": 8}  # a p5.48xlarge
    assert node_type["min_workers"] == 0 <= node_type["max_workers"], "spot capacity is never promised"
    workers = [t["max_workers"] for name, t in types.items() if name != raw["head_node_type"]]
    assert raw["max_workers"] >= sum(workers)
    assert raw["provider"]["cache_stopped_nodes"] is False  # spot instances cannot be stopped, only terminated


def test_aws_config_sized_for_an_elastic_run_is_valid() -> None:
    """cluster.num_workers: [16, 32] at 8 ranks a node: 2 on-demand nodes, up to 2 spot nodes (the comment
    in cluster/aws-gpu.yaml), still a config `ray up` accepts."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = aws_config()
    types = raw["available_node_types"]
    low, high, per_node = 16, 32, types["gpu_h100_spot"]["resources"]["GPU"]
    types["gpu_h100"].update(min_workers=low // per_node, max_workers=low // per_node)
    types["gpu_h100_spot"].update(max_workers=(high - low) // per_node)
    raw["max_workers"] = types["gpu_h100"]["max_workers"] + types["gpu_h100_spot"]["max_workers"]
    validate_config(prepare_config(raw))
