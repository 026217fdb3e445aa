"""Every object `kubectl apply -k k8s/overlays/...` would send passes the Kubernetes schemas, KubeRay
v1.7.0's CRD schemas (strict: unknown fields rejected) and the KubeRay operator's own cross-field rules;
and each of those checks rejects an object broken the way it guards against. No cluster needed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from helpers.k8s_render import OVERLAYS, base_cluster_template, one, render
from helpers.k8s_schema import crd_problems, crd_source, kubernetes_problems
from helpers.kuberay_rules import MAX_RAYJOB_NAME, operator_problems


def all_problems(doc: dict[str, Any]) -> list[str]:
    problems = kubernetes_problems(doc)
    if doc.get("apiVersion") == "ray.io/v1":
        problems += crd_problems(doc)
        # The operator only ever sees what the API server admitted.
        problems += [] if problems else operator_problems(doc)
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_is_valid(overlay: str) -> None:
    docs = render(overlay)
    assert {d["kind"] for d in docs} >= {"Namespace", "ServiceAccount", "NetworkPolicy", "RayJob"}
    assert [p for d in docs for p in all_problems(d)] == []


def test_the_cluster_template_is_a_valid_raycluster() -> None:
    assert all_problems(base_cluster_template()) == []


def test_trimmed_schema_says_where_it_came_from() -> None:
    source = crd_source()
    assert source["repository"] == "github.com/ray-project/kuberay" and source["tag"] == "v1.7.0"
    assert len(source["commit"]) == 40 and all(p.endswith(".yaml") for p in source["paths"])


def _job() -> dict[str, Any]:
    return one(render("gpu"), "RayJob", "vitscale-pretrain")


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        node[int(last) if last.isdigit() else last] = value
    return mutate


# (what breaks, mutation of the pretrain RayJob, text of the expected complaint)
MUTANTS = [
    ("misspelt RayJob field", _set("spec.shutdownAfterJobFinish", True), 'unknown field "shutdownAfterJobFinish"'),
    ("misspelt cluster field", _set("spec.rayClusterSpec.authOption", {"mode": "token"}), 'unknown field "authOption"'),
    ("unknown auth option", _set("spec.rayClusterSpec.authOptions.token", "abc"), 'unknown field "token"'),
    ("field KubeRay has, trimmed away", _set("spec.entrypointNumCpus", 1), "trim_crd.py"),
    ("wrong type", _set("spec.backoffLimit", "2"), "is not of type 'integer'"),
    ("auth mode enum", _set("spec.rayClusterSpec.authOptions.mode", "password"), "is not one of"),
    ("rayStartParams values are strings", _set("spec.rayClusterSpec.headGroupSpec.rayStartParams.num-cpus", 0),
     "is not of type 'string'"),
    ("unknown container field", _set("spec.rayClusterSpec.workerGroupSpecs.0.template.spec.containers.0.resource", {}),
     "resource"),
    ("bad pod field type", _set("spec.submitterPodTemplate.spec.containers.0.ports", "8265"), "is not of type"),
    ("missing required", lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][0].pop("groupName"),
     "'groupName' is a required property"),
    ("RayJob name too long", _set("metadata.name", "v" * (MAX_RAYJOB_NAME + 1)), "no more than 47 characters"),
    ("RayJob name not DNS-1035", _set("metadata.name", "1-pretrain"), "DNS1035"),
    ("suspend without shutdown", lambda d: d["spec"].update(suspend=True, shutdownAfterJobFinishes=False,
                                                            ttlSecondsAfterFinished=0),
     "not allowed to be suspended"),
    ("TTL without shutdown", _set("spec.shutdownAfterJobFinishes", False), "cannot have TTLSecondsAfterFinished"),
    ("retries in InteractiveMode", _set("spec.submissionMode", "InteractiveMode"), "incompatible with InteractiveMode"),
    ("retries with a cluster selector", lambda d: d["spec"].update(clusterSelector={"ray.io/cluster": "c"}),
     "incompatible with ClusterSelector"),
    ("negative backoffLimit", _set("spec.backoffLimit", -1), "backoffLimit must be a positive integer"),
    ("token auth on an old Ray", _set("spec.rayClusterSpec.rayVersion", "2.50.0"), "minimum Ray version is 2.52.0"),
    ("K8s token auth on a RayJob", _set("spec.rayClusterSpec.authOptions.enableK8sTokenAuth", True),
     "not supported for RayJob"),
    ("min above max", _set("spec.rayClusterSpec.workerGroupSpecs.0.minReplicas", 64), "greater than maxReplicas"),
]


@pytest.mark.parametrize("mutate,expected", [m[1:] for m in MUTANTS], ids=[m[0] for m in MUTANTS])
def test_a_broken_rayjob_is_rejected(mutate: Callable[[dict[str, Any]], None], expected: str) -> None:
    job = _job()
    assert all_problems(job) == []
    mutate(job)
    problems = all_problems(job)
    assert any(expected in p for p in problems), problems


# (what breaks, mutation of the gpu-spot RayJob's spot group, workerGroupSpecs[1], text of the expected complaint)
SPOT_MUTANTS = [
    ("spot min above max", _set("spec.rayClusterSpec.workerGroupSpecs.1.minReplicas", 17), "greater than maxReplicas"),
    ("negative spot replicas", _set("spec.rayClusterSpec.workerGroupSpecs.1.minReplicas", -1), "negative"),
    ("grace period as a string", _set("spec.rayClusterSpec.workerGroupSpecs.1.template.spec.terminationGracePeriodSeconds",
                                      "160"), "is not of type 'integer'"),
    ("misspelt grace period", lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]["template"]["spec"].update(
        terminationGracePeriod=160), "terminationGracePeriod"),
    # GKE's label value unquoted in YAML is a boolean, which no node label matches
    ("unquoted label value", lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]["template"]["spec"][
        "nodeSelector"].update({"cloud.google.com/gke-spot": True}), "is not of type 'string'"),
    ("affinity values not a list", _set("spec.rayClusterSpec.headGroupSpec.template.spec.affinity.nodeAffinity."
                                        "requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.0."
                                        "matchExpressions.0.values", "SPOT"), "is not of type 'array'"),
]


@pytest.mark.parametrize("mutate,expected", [m[1:] for m in SPOT_MUTANTS], ids=[m[0] for m in SPOT_MUTANTS])
def test_a_broken_spot_group_is_rejected(mutate: Callable[[dict[str, Any]], None], expected: str) -> None:
    job = one(render("gpu-spot"), "RayJob", "vitscale-pretrain")
    assert job["spec"]["rayClusterSpec"]["workerGroupSpecs"][1]["groupName"] == "gpu-spot"
    assert all_problems(job) == []
    mutate(job)
    problems = all_problems(job)
    assert any(expected in p for p in problems), problems


def test_a_broken_kubernetes_object_is_rejected() -> None:
    policy = one(render("gpu"), "NetworkPolicy", "vitscale-ray")
    assert kubernetes_problems(policy) == []
    policy["spec"]["ingres"] = policy["spec"].pop("ingress")
    assert any("'ingres' was unexpected" in p for p in kubernetes_problems(policy))
