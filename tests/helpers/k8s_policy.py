"""House policy over rendered k8s/ objects: what every vitscale deployment must be, whatever its overlay.

Each rule returns its violations as strings starting with the rule's name; tests/test_k8s_policy.py
shows every rule passing on every overlay and rejecting a manifest mutated to break it.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from helpers.k8s_render import cluster_specs, pod_templates

GPU = "nvidia.com/gpu"
RAY_CONTROL_PORTS = {8265, 6379, 10001}  # dashboard + job API, GCS, Ray client: code execution on the cluster
OPERATOR_POD = {"app.kubernetes.io/name": "kuberay-operator"}  # the KubeRay Helm chart's pod label
SECRET_ENV = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL)", re.I)
ACCESS_KEY = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b|-----BEGIN [A-Z ]*PRIVATE KEY-----")
#: Node labels of spot (preemptible) capacity and their spot value: EKS managed node groups, Karpenter,
#: GKE, AKS (k8s/README.md, "Spot (preemptible) capacity").
SPOT_LABELS = {"eks.amazonaws.com/capacityType": "SPOT", "karpenter.sh/capacity-type": "spot",
               "cloud.google.com/gke-spot": "true", "kubernetes.azure.com/scalesetpriority": "spot"}
#: cluster.preemption_grace_s's default: how long Ray Train lets ranks go on past a preemption's deadline to
#: finish the grace checkpoint; a spot pod's terminationGracePeriodSeconds must exceed it.
PREEMPTION_GRACE_S = 120
#: How long `ray start --block` keeps a node's Ray processes after SIGTERM (Ray's default: 30 s).
DRAIN_ENV, RAY_DRAIN_DEFAULT_S = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", 30.0
KUBERNETES_GRACE_DEFAULT_S = 30  # a pod's terminationGracePeriodSeconds when unset


def _containers(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template.get("spec", {})
    return spec.get("initContainers", []) + spec.get("containers", [])


def token_auth(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for doc in docs:
        for spec in cluster_specs(doc):
            auth = spec.get("authOptions") or {}
            if auth.get("mode") != "token" or not auth.get("secretName"):
                out.append(f"token-auth: {doc['kind']}/{doc['metadata']['name']} lacks authOptions mode token "
                           "with the token from a named Secret")
        for place, template in pod_templates(doc):
            for c in _containers(template):
                for env in c.get("env", []):
                    if env["name"] == "RAY_AUTH_MODE" and env.get("value") != "token":
                        out.append(f"token-auth: {doc['metadata']['name']} {place}: RAY_AUTH_MODE={env.get('value')}")
    return out


def no_secrets(docs: list[dict[str, Any]]) -> list[str]:
    out = [f"no-secrets: {d['kind']}/{d['metadata']['name']} holds values" for d in docs if d["kind"] == "Secret"]
    for doc in docs:
        if ACCESS_KEY.search(yaml.safe_dump(doc)):
            out.append(f"no-secrets: {doc['kind']}/{doc['metadata']['name']} contains an access key")
        for place, template in pod_templates(doc):
            for c in _containers(template):
                for env in c.get("env", []):
                    if "value" in env and SECRET_ENV.search(env["name"]):
                        out.append(f"no-secrets: {doc['metadata']['name']} {place}: {env['name']} set in the manifest")
    return out


def not_exposed(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "Ingress" or doc["kind"] in ("Gateway", "HTTPRoute"):
            out.append(f"not-exposed: {where} exposes the cluster")
        if doc["kind"] == "Service" and doc.get("spec", {}).get("type") in ("LoadBalancer", "NodePort"):
            out.append(f"not-exposed: {where} is a {doc['spec']['type']}")
        for spec in cluster_specs(doc):
            head = spec["headGroupSpec"]
            kinds = {head.get("serviceType"), head.get("headService", {}).get("spec", {}).get("type")}
            if kinds & {"LoadBalancer", "NodePort"}:
                out.append(f"not-exposed: {where} head service is {kinds & {'LoadBalancer', 'NodePort'}}")
            if head.get("enableIngress"):
                out.append(f"not-exposed: {where} head has enableIngress")
        for place, template in pod_templates(doc):
            if template.get("spec", {}).get("hostNetwork"):
                out.append(f"not-exposed: {where} {place} uses the host network")
            for c in _containers(template):
                if any("hostPort" in p for p in c.get("ports", [])):
                    out.append(f"not-exposed: {where} {place} binds a host port")
    return out


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if selector.get("matchExpressions"):
        return False  # none of ours; an unknown selector is not taken as covering anything
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _covers_control_port(rule: dict[str, Any]) -> bool:
    if not rule.get("ports"):
        return True  # no ports: every port
    for p in rule["ports"]:
        low, high = p.get("port"), p.get("endPort", p.get("port"))
        if low is None or isinstance(low, str) or any(low <= port <= high for port in RAY_CONTROL_PORTS):
            return True  # a named port may name the dashboard
    return False


def _peer_ok(peer: dict[str, Any], rule: dict[str, Any]) -> bool:
    if set(peer) == {"podSelector"}:
        return True  # a pod of this namespace
    # The KubeRay operator polls the dashboard (8265 only) from its own namespace.
    return (set(peer) == {"namespaceSelector", "podSelector"} and bool(peer["namespaceSelector"].get("matchLabels"))
            and peer["podSelector"].get("matchLabels") == OPERATOR_POD and not peer["podSelector"].get("matchExpressions")
            and [(p.get("port"), p.get("endPort")) for p in rule.get("ports", [])] == [(8265, None)])


def namespace_only(docs: list[dict[str, Any]]) -> list[str]:
    """The head's control ports are admitted only from the namespace (and the operator to 8265)."""
    heads = [t["metadata"].get("labels", {}) for d in docs for place, t in pod_templates(d) if place == "headGroupSpec"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    out = []
    for labels in heads:
        guarding = [p for p in policies if _selects(p["spec"]["podSelector"], labels)
                    and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
        if not guarding:
            out.append(f"namespace-only: no NetworkPolicy isolates the Ray head {labels}")
        for policy in guarding:
            for rule in policy["spec"].get("ingress", []):
                if not _covers_control_port(rule):
                    continue
                if not rule.get("from"):
                    out.append(f"namespace-only: {policy['metadata']['name']} admits anyone to the head's control ports")
                for peer in rule.get("from", []):
                    if not _peer_ok(peer, rule):
                        out.append(f"namespace-only: {policy['metadata']['name']} admits {peer} to the head's control ports")
    return out


def resources(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for doc in docs:
        for place, template in pod_templates(doc):
            for c in _containers(template):
                r = c.get("resources", {})
                missing = [f"{kind}.{res}" for kind in ("requests", "limits") for res in ("cpu", "memory")
                           if res not in r.get(kind, {})]
                if missing:
                    out.append(f"resources: {doc['metadata']['name']} {place} {c['name']} lacks {missing}")
    return out


def gpu_limits(docs: list[dict[str, Any]]) -> list[str]:
    """A worker group meant for GPU nodes (tolerates the GPU taint or selects GPU nodes) has a GPU limit."""
    out = []
    for doc in docs:
        for spec in cluster_specs(doc):
            for group in spec.get("workerGroupSpecs", []):
                pod = group["template"]["spec"]
                wants_gpu = (any(GPU in t.get("key", "") for t in pod.get("tolerations", []))
                             or any(GPU in k for k in pod.get("nodeSelector", {})))
                for c in pod["containers"]:
                    limit = c.get("resources", {}).get("limits", {}).get(GPU)
                    request = c.get("resources", {}).get("requests", {}).get(GPU, limit)
                    if wants_gpu and c is pod["containers"][0] and not (isinstance(limit, int) and limit >= 1):
                        out.append(f"gpu-limits: {doc['metadata']['name']} group {group['groupName']} has no {GPU} limit")
                    if request != limit:
                        out.append(f"gpu-limits: {doc['metadata']['name']} group {group['groupName']} requests {request} "
                                   f"but limits {limit} GPUs")
    return out


def pinned_images(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for doc in docs:
        for place, template in pod_templates(doc):
            for c in _containers(template):
                image = c.get("image", "")
                name, _, tag = image.rpartition(":") if "@" not in image else (image, "", "digest")
                if "@sha256:" not in image and (not name or "/" in tag or tag in ("", "latest")):
                    out.append(f"pinned-images: {doc['metadata']['name']} {place}: {image!r} is not pinned")
    return out


def non_root(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for doc in docs:
        for place, template in pod_templates(doc):
            pod = template.get("spec", {}).get("securityContext", {})
            for c in _containers(template):
                ctx = c.get("securityContext", {})
                where = f"{doc['metadata']['name']} {place} {c['name']}"
                if not ctx.get("runAsNonRoot", pod.get("runAsNonRoot")) or ctx.get("runAsUser", pod.get("runAsUser")) == 0:
                    out.append(f"non-root: {where} may run as root")
                if ctx.get("allowPrivilegeEscalation") is not False or ctx.get("privileged"):
                    out.append(f"non-root: {where} allows privilege escalation")
    return out


def _required_terms(pod: dict[str, Any]) -> list[dict[str, Any]]:
    affinity = pod.get("affinity", {}).get("nodeAffinity", {})
    return affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])


def on_spot(pod: dict[str, Any]) -> bool:
    """The pod (spec) asks for spot nodes: its nodeSelector, or a required node-affinity term, names a
    spot label with its spot value."""
    selector = pod.get("nodeSelector", {})
    if any(selector.get(key) == value for key, value in SPOT_LABELS.items()):
        return True
    return any(e["key"] in SPOT_LABELS and e["operator"] == "In" and SPOT_LABELS[e["key"]] in e.get("values", [])
               for term in _required_terms(pod) for e in term.get("matchExpressions", []))


def avoids_spot(pod: dict[str, Any]) -> bool:
    """Every required node-affinity term of the pod (spec) excludes every provider's spot nodes."""
    terms = _required_terms(pod)

    def excluded(term: dict[str, Any]) -> set[str]:
        return {e["key"] for e in term.get("matchExpressions", []) if e["key"] in SPOT_LABELS and (
            e["operator"] == "DoesNotExist" or (e["operator"] == "NotIn" and SPOT_LABELS[e["key"]] in e.get("values", [])))}

    return bool(terms) and all(excluded(term) == set(SPOT_LABELS) for term in terms)


def drain_seconds(container: dict[str, Any]) -> float:
    values = [e.get("value") for e in container.get("env", []) if e["name"] == DRAIN_ENV]
    try:
        return float(values[-1]) if values else RAY_DRAIN_DEFAULT_S
    except (TypeError, ValueError):
        return RAY_DRAIN_DEFAULT_S  # Ray's env_float falls back to its default on a value it cannot read


def spot(docs: list[dict[str, Any]]) -> list[str]:
    """A spot worker group gets its notice and outlasts the grace checkpoint (spot-grace): Ray drains the
    node on the pod's SIGTERM (a drain of 0 s or less is no drain, so no notice), Kubernetes waits for the
    drain to end before SIGKILL, and longer than the cluster.preemption_grace_s the run gives the checkpoint.
    Next to a spot group, the head and the other groups keep off spot nodes (spot-isolation): losing the
    head ends the job, and a fixed group's pods are not meant to be reclaimed."""
    out = []
    for doc in docs:
        for spec in cluster_specs(doc):
            groups = spec.get("workerGroupSpecs", [])
            spot_groups = [g for g in groups if on_spot(g["template"]["spec"])]
            for group in spot_groups:
                pod, where = group["template"]["spec"], f"{doc['metadata']['name']} group {group['groupName']}"
                grace = pod.get("terminationGracePeriodSeconds", KUBERNETES_GRACE_DEFAULT_S)
                drain = drain_seconds(pod["containers"][0])
                if drain <= 0:
                    out.append(f"spot-grace: {where}: {DRAIN_ENV} {drain:g} turns Ray's drain off: no preemption notice")
                if grace <= max(drain, PREEMPTION_GRACE_S):
                    out.append(f"spot-grace: {where}: terminationGracePeriodSeconds {grace} does not outlast "
                               f"{DRAIN_ENV} ({drain:g} s) and cluster.preemption_grace_s ({PREEMPTION_GRACE_S} s)")
            if not spot_groups:
                continue
            others = [("head", spec["headGroupSpec"]["template"]["spec"])]
            others += [(f"group {g['groupName']}", g["template"]["spec"]) for g in groups if g not in spot_groups]
            for where, pod in others:
                if not avoids_spot(pod):
                    out.append(f"spot-isolation: {doc['metadata']['name']} {where} may be scheduled onto spot nodes "
                               f"(needs a required node affinity NotIn every one of {sorted(SPOT_LABELS)})")
    return out


RULES = [token_auth, no_secrets, not_exposed, namespace_only, resources, gpu_limits, pinned_images, non_root, spot]


def violations(docs: list[dict[str, Any]]) -> list[str]:
    return [v for rule in RULES for v in rule(docs)]
