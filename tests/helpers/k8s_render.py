"""What `kubectl apply -k` would send: every kustomization under k8s/ rendered by kubectl's own kustomize.

kubectl (with its built-in kustomize) is required: the manifests are never rendered by an imitation. Where it
is missing and this user cannot install it, the tests that render skip and say so (helpers/tools.py).
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import yaml

from helpers.tools import need_tools

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
#: overlay (relative to k8s/overlays) -> (the RayJob it runs, its pipeline file, runs on GPUs)
OVERLAYS = {
    "gpu": ("vitscale-pretrain", "pipelines/pretrain.yaml", True),
    "gpu/finetune-sweep": ("vitscale-finetune-sweep", "pipelines/finetune-sweep.yaml", True),
    "gpu/scaling-study": ("vitscale-scaling-study", "pipelines/scaling-study.yaml", True),
    "gpu-spot": ("vitscale-pretrain", "pipelines/pretrain.yaml", True),
    "dev": ("vitscale-quickstart", "pipelines/quickstart.yaml", False),
}


def kubectl() -> str:
    """kubectl (its built-in kustomize renders k8s/): installed where this user may, else the test skips."""
    return need_tools("kubectl", "kubectl")[0]


@functools.cache
def _render(directory: str) -> str:
    done = subprocess.run([kubectl(), "kustomize", directory], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{done.stderr}")
    return done.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    """The objects of one overlay (a fresh copy each call: tests mutate them)."""
    return [d for d in yaml.safe_load_all(_render(str(K8S / "overlays" / overlay))) if d]


def base_cluster_template() -> dict[str, Any]:
    """k8s/base/raycluster.yaml: the RayCluster every job's cluster is made from (local-config, not rendered)."""
    return yaml.safe_load((K8S / "base" / "raycluster.yaml").read_text())


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def cluster_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The RayCluster specs in an object: a RayCluster's spec, a RayJob's rayClusterSpec."""
    if doc.get("kind") == "RayCluster":
        return [doc["spec"]]
    if doc.get("kind") == "RayJob" and "rayClusterSpec" in doc.get("spec", {}):
        return [doc["spec"]["rayClusterSpec"]]
    return []


def pod_templates(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod template) of every pod an object makes: Ray head and workers, RayJob submitter, workloads."""
    out = []
    for spec in cluster_specs(doc):
        out.append(("headGroupSpec", spec["headGroupSpec"]["template"]))
        out += [(f"workerGroupSpecs[{g.get('groupName')}]", g["template"]) for g in spec.get("workerGroupSpecs", [])]
    if doc.get("kind") == "RayJob" and "submitterPodTemplate" in doc["spec"]:
        out.append(("submitterPodTemplate", doc["spec"]["submitterPodTemplate"]))
    if doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
        out.append(("template", doc["spec"]["template"]))
    if doc.get("kind") == "Pod":
        out.append(("pod", {"metadata": doc.get("metadata", {}), "spec": doc["spec"]}))
    return out
