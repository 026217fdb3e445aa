"""The KubeRay operator's own checks that a CRD schema cannot express, as KubeRay v1.7.0 makes them
(ray-operator/controllers/ray/utils/validation.go at tag v1.7.0, commit 59d663a: ValidateRayJobMetadata,
ValidateRayJobSpec, validateDeletionConfiguration, ValidateRayClusterMetadata, ValidateRayClusterSpec;
the name limits from utils/constant.go). Only the rules that concern fields vitscale can set are here;
the operator refuses such an object when it reconciles it, long after `kubectl apply` said "created".
"""

from __future__ import annotations

import re
from typing import Any

MAX_RAYCLUSTER_NAME = 53  # MaxRayClusterNameLength
MAX_RAYJOB_NAME = MAX_RAYCLUSTER_NAME - 6  # MaxRayJobNameLength: room for the cluster name's suffix
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def _version(text: str) -> tuple[int, ...] | None:
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?.*", text)
    return None if m is None else tuple(int(g or 0) for g in m.groups())


def cluster_spec_problems(spec: dict[str, Any]) -> list[str]:
    """ValidateRayClusterSpec's rules on the fields vitscale sets."""
    problems = []
    if not spec["headGroupSpec"]["template"]["spec"].get("containers"):
        problems.append("headGroupSpec should have at least one container")
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    for group in spec.get("workerGroupSpecs", []):
        name = group.get("groupName")
        if not group["template"]["spec"].get("containers"):
            problems.append("workerGroupSpec should have at least one container")
        low, high = group.get("minReplicas"), group.get("maxReplicas")
        if not autoscaling and (low is None or high is None):
            problems.append(f"worker group {name} must set both minReplicas and maxReplicas when autoscaling is disabled")
        if (low is not None and low < 0) or (high is not None and high < 0):
            problems.append(f"worker group {name} has negative minReplicas or maxReplicas")
        if low is not None and high is not None and low > high:
            problems.append(f"worker group {name} has minReplicas {low} greater than maxReplicas {high}")
    auth = spec.get("authOptions") or {}
    k8s_auth = bool(auth.get("enableK8sTokenAuth"))
    if auth.get("mode") == "token":
        version = _version(spec.get("rayVersion", ""))
        if version is None:
            problems.append("authOptions.mode is 'token' but rayVersion is missing or not a version (2.52.0+ required)")
        elif version < (2, 52, 0):
            problems.append(f"authOptions.mode is 'token' but minimum Ray version is 2.52.0, got {spec['rayVersion']}")
        elif k8s_auth and version < (2, 55, 0):
            problems.append("authOptions.enableK8sTokenAuth needs Ray 2.55.0 or later")
        if k8s_auth and auth.get("secretName"):
            problems.append("authOptions.enableK8sTokenAuth is enabled and authOptions.secretName is also set")
    elif k8s_auth:
        problems.append("authOptions.enableK8sTokenAuth is enabled but authOptions.mode not set to 'token'")
    return problems


def rayjob_problems(job: dict[str, Any]) -> list[str]:
    """ValidateRayJobMetadata + ValidateRayJobSpec (+ the cluster spec's rules) on one RayJob."""
    name, spec = job["metadata"]["name"], job["spec"]
    problems = []
    if len(name) > MAX_RAYJOB_NAME:
        problems.append(f"RayJob name should be no more than {MAX_RAYJOB_NAME} characters: {name!r}")
    if not DNS1035.fullmatch(name):
        problems.append(f"RayJob name should be a valid DNS1035 label: {name!r}")
    shutdown, mode = bool(spec.get("shutdownAfterJobFinishes")), spec.get("submissionMode", "K8sJobMode")
    selector = bool(spec.get("clusterSelector"))
    backoff = spec.get("backoffLimit")
    if spec.get("suspend") and not shutdown:
        problems.append("a RayJob with shutdownAfterJobFinishes set to false is not allowed to be suspended")
    if spec.get("ttlSecondsAfterFinished", 0) < 0:
        problems.append("TTLSecondsAfterFinished must be a non-negative integer")
    if not shutdown and spec.get("ttlSecondsAfterFinished", 0) > 0:
        problems.append("a RayJob with shutdownAfterJobFinishes set to false cannot have TTLSecondsAfterFinished")
    if spec.get("suspend") and selector:
        problems.append("the ClusterSelector mode doesn't support the suspend operation")
    if "rayClusterSpec" not in spec and not selector:
        problems.append("one of RayClusterSpec or ClusterSelector must be set")
    if selector and mode == "SidecarMode":
        problems.append("ClusterSelector is not supported in SidecarMode")
    if selector and backoff is not None and backoff > 0:
        problems.append("BackoffLimit is incompatible with ClusterSelector mode")
    if mode == "InteractiveMode" and backoff is not None and backoff > 0:
        problems.append("BackoffLimit is incompatible with InteractiveMode")
    if mode == "SidecarMode":
        if "submitterPodTemplate" in spec:
            problems.append("SidecarMode doesn't support SubmitterPodTemplate")
        if "submitterConfig" in spec:
            problems.append("SidecarMode doesn't support SubmitterConfig")
        restart = spec.get("rayClusterSpec", {}).get("headGroupSpec", {}).get("template", {}).get("spec", {}).get("restartPolicy")
        if restart not in (None, "", "Never"):
            problems.append("restartPolicy for head Pod should be Never or unset when using SidecarMode")
    if "rayClusterSpec" in spec:
        if (spec["rayClusterSpec"].get("authOptions") or {}).get("enableK8sTokenAuth"):
            problems.append("K8s token auth mode is currently not supported for RayJob")
        problems += cluster_spec_problems(spec["rayClusterSpec"])
    if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] <= 0:
        problems.append("activeDeadlineSeconds must be a positive integer")
    if backoff is not None and backoff < 0:
        problems.append("backoffLimit must be a positive integer")
    return [f"RayJob/{name}: {p}" for p in problems]


def raycluster_problems(cluster: dict[str, Any]) -> list[str]:
    name = cluster["metadata"]["name"]
    problems = [] if len(name) <= MAX_RAYCLUSTER_NAME else [f"RayCluster name should be no more than {MAX_RAYCLUSTER_NAME} characters"]
    return [f"RayCluster/{name}: {p}" for p in problems + cluster_spec_problems(cluster["spec"])]


def operator_problems(doc: dict[str, Any]) -> list[str]:
    if doc.get("kind") == "RayJob":
        return rayjob_problems(doc)
    if doc.get("kind") == "RayCluster":
        return raycluster_problems(doc)
    return []
