"""The policy suite (tests/helpers/k8s_policy.py) holds on every overlay, and each rule rejects a manifest
mutated to break it, the way a careless edit would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from helpers.k8s_policy import DRAIN_ENV, violations
from helpers.k8s_render import OVERLAYS, one, render

Docs = list[dict[str, Any]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_meets_the_policy(overlay: str) -> None:
    assert violations(render(overlay)) == []


def _job(docs: Docs) -> dict[str, Any]:
    return one(docs, "RayJob")


def _head(docs: Docs) -> dict[str, Any]:
    return _job(docs)["spec"]["rayClusterSpec"]["headGroupSpec"]


def _worker(docs: Docs) -> dict[str, Any]:
    return _job(docs)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]


def _worker_container(docs: Docs) -> dict[str, Any]:
    return _worker(docs)["containers"][0]


def _dashboard_policy(docs: Docs) -> dict[str, Any]:
    return one(docs, "NetworkPolicy", "vitscale-ray-dashboard")


def _add(doc: dict[str, Any]) -> Callable[[Docs], None]:
    return lambda docs: docs.append(doc)


SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "dash", "namespace": "vitscale"},
           "spec": {"type": "LoadBalancer", "selector": {"app.kubernetes.io/component": "ray-head"},
                    "ports": [{"port": 8265}]}}
INGRESS = {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "dash"},
           "spec": {"defaultBackend": {"service": {"name": "dash", "port": {"number": 8265}}}}}
SECRET = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "vitscale-ray-token"},
          "stringData": {"auth_token": "0123456789abcdef"}}

# (rule broken, mutation of the gpu overlay's objects)
MUTANTS: list[tuple[str, Callable[[Docs], None]]] = [
    ("token-auth", lambda d: _job(d)["spec"]["rayClusterSpec"].pop("authOptions")),
    ("token-auth", lambda d: _job(d)["spec"]["rayClusterSpec"]["authOptions"].update(mode="disabled")),
    ("token-auth", lambda d: _job(d)["spec"]["rayClusterSpec"]["authOptions"].pop("secretName")),
    ("token-auth", lambda d: _worker_container(d)["env"].append({"name": "RAY_AUTH_MODE", "value": "disabled"})),
    ("no-secrets", _add(SECRET)),
    ("no-secrets", lambda d: _worker_container(d)["env"].append({"name": "AWS_SECRET_ACCESS_KEY", "value": "x/y"})),
    ("no-secrets", lambda d: _worker_container(d)["env"].append({"name": "RAY_AUTH_TOKEN", "value": "abc"})),
    ("no-secrets", lambda d: _job(d)["spec"].update(entrypoint=_job(d)["spec"]["entrypoint"]
                                                    + " --set data.key=AKIAIOSFODNN7EXAMPLE")),
    ("not-exposed", _add(SERVICE)),
    ("not-exposed", _add(INGRESS)),
    ("not-exposed", lambda d: _head(d).update(serviceType="NodePort")),
    ("not-exposed", lambda d: _head(d).update(enableIngress=True)),
    ("not-exposed", lambda d: _head(d)["template"]["spec"]["containers"][0]["ports"][1].update(hostPort=8265)),
    ("not-exposed", lambda d: _head(d)["template"]["spec"].update(hostNetwork=True)),
    ("namespace-only", lambda d: _dashboard_policy(d)["spec"]["ingress"][0].pop("from")),
    ("namespace-only", lambda d: _dashboard_policy(d)["spec"]["ingress"][0]["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}})),
    ("namespace-only", lambda d: _dashboard_policy(d)["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}})),
    ("namespace-only", lambda d: _dashboard_policy(d)["spec"]["ingress"][0]["from"][0].pop("podSelector")),
    ("namespace-only", lambda d: _dashboard_policy(d)["spec"]["ingress"][0]["ports"][0].update(port=6379)),
    ("namespace-only", lambda d: one(d, "NetworkPolicy", "vitscale-ray")["spec"]["ingress"].append(
        {"from": [{"namespaceSelector": {"matchLabels": {"team": "ml"}}}]})),
    ("namespace-only", lambda d: [d.remove(p) for p in [x for x in d if x["kind"] == "NetworkPolicy"]]),
    ("resources", lambda d: _worker_container(d)["resources"].pop("limits")),
    ("resources", lambda d: _job(d)["spec"]["submitterPodTemplate"]["spec"]["containers"][0]["resources"]["requests"].pop("memory")),
    ("gpu-limits", lambda d: [_worker_container(d)["resources"][k].pop("nvidia.com/gpu") for k in ("limits", "requests")]),
    ("gpu-limits", lambda d: _worker_container(d)["resources"]["requests"].update({"nvidia.com/gpu": 2})),
    ("pinned-images", lambda d: _worker_container(d).update(image="vitscale")),
    ("pinned-images", lambda d: _worker_container(d).update(image="registry.example.com:5000/vitscale:latest")),
    ("pinned-images", lambda d: _head(d)["template"]["spec"]["containers"][0].update(image="registry.example.com:5000/vitscale")),
    ("non-root", lambda d: _worker(d)["securityContext"].update(runAsNonRoot=False)),
    ("non-root", lambda d: _worker(d)["securityContext"].update(runAsUser=0)),
    ("non-root", lambda d: _worker_container(d)["securityContext"].update(allowPrivilegeEscalation=True)),
    ("non-root", lambda d: _worker_container(d)["securityContext"].pop("allowPrivilegeEscalation")),
    ("non-root", lambda d: _worker_container(d)["securityContext"].update(privileged=True)),
]


@pytest.mark.parametrize("rule,mutate", MUTANTS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(MUTANTS)])
def test_a_mutated_manifest_is_rejected(rule: str, mutate: Callable[[Docs], None]) -> None:
    docs = render("gpu")
    mutate(docs)
    found = violations(docs)
    assert any(v.startswith(f"{rule}:") for v in found), found


def _group(docs: Docs, name: str) -> dict[str, Any]:
    (group,) = [g for g in _job(docs)["spec"]["rayClusterSpec"]["workerGroupSpecs"] if g["groupName"] == name]
    return group


def _spot(docs: Docs) -> dict[str, Any]:
    return _group(docs, "gpu-spot")["template"]["spec"]


def _drain(docs: Docs) -> dict[str, Any]:
    (env,) = [e for e in _spot(docs)["containers"][0]["env"] if e["name"] == DRAIN_ENV]
    return env


def _spot_expressions(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"]


# (rule broken, mutation of the gpu-spot overlay's objects)
SPOT_MUTANTS: list[tuple[str, Callable[[Docs], None]]] = [
    ("spot-grace", lambda d: _spot(d).pop("terminationGracePeriodSeconds")),  # Kubernetes' 30 s
    ("spot-grace", lambda d: _spot(d).update(terminationGracePeriodSeconds=120)),  # not above the run's 120 s
    ("spot-grace", lambda d: _drain(d).update(value="0")),  # no drain, no notice
    ("spot-grace", lambda d: _drain(d).update(value="600")),  # past terminationGracePeriodSeconds
    ("spot-isolation", lambda d: _head(d)["template"]["spec"].pop("affinity")),
    ("spot-isolation", lambda d: _spot_expressions(_group(d, "gpu")["template"]["spec"]).pop(2)),  # GKE's label
    ("spot-isolation", lambda d: _spot_expressions(_head(d)["template"]["spec"])[0].update(operator="In")),
    ("gpu-limits", lambda d: [_spot(d)["containers"][0]["resources"][k].pop("nvidia.com/gpu") for k in ("limits", "requests")]),
]


@pytest.mark.parametrize("rule,mutate", SPOT_MUTANTS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(SPOT_MUTANTS)])
def test_a_mutated_spot_manifest_is_rejected(rule: str, mutate: Callable[[Docs], None]) -> None:
    docs = render("gpu-spot")
    mutate(docs)
    found = violations(docs)
    assert any(v.startswith(f"{rule}:") for v in found), found


def test_digest_pinned_images_pass() -> None:
    docs = render("gpu")
    _worker_container(docs).update(image="registry.example.com:5000/vitscale@sha256:" + "a" * 64)
    assert violations(docs) == []
