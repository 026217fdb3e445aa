"""Schema checks of rendered objects, as the API server would apply them with `kubectl apply --validate=strict`.

* Kubernetes' own kinds, and the pod templates inside KubeRay's objects, against the Kubernetes OpenAPI
  schemas that the kubernetes-validate package ships (strict: unknown fields are errors).
* RayCluster and RayJob against KubeRay v1.7.0's CRD schemas, trimmed to the fields vitscale uses
  (tests/helpers/kuberay/schema-v1.7.0.json, written by tests/helpers/kuberay/trim_crd.py, which says where they came
  from). Unknown fields are errors too, and the message tells a field KubeRay does not have from one it
  has that the trimmed copy left out.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema

KUBERNETES_VERSION = "1.32"  # the kubectl here; KubeRay 1.7 supports it
CRD_SCHEMA = Path(__file__).parent / "kuberay" / "schema-v1.7.0.json"
#: Kinds whose schemas come from CRDs that neither file above covers (the Prometheus Operator's); checked
#: by their own tests (tests/test_monitoring.py) and never let through silently.
OTHER_CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}


@functools.lru_cache(maxsize=1)
def _crd() -> dict[str, Any]:
    return json.loads(CRD_SCHEMA.read_text())


def crd_source() -> dict[str, Any]:
    return _crd()["source"]


def _unknown_fields(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    problems = []
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in value.items():
            if key in schema["properties"]:
                problems += _unknown_fields(schema["properties"][key], sub, f"{path}.{key}")
            elif key in schema.get("x-crd-properties", ()):
                problems.append(f"{path}.{key}: in KubeRay's CRD but not in the trimmed schema: "
                                "regenerate it with tests/helpers/kuberay/trim_crd.py")
            else:
                problems.append(f'{path}: unknown field "{key}"')
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, sub in value.items():
            problems += _unknown_fields(schema["additionalProperties"], sub, f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, sub in enumerate(value):
            problems += _unknown_fields(schema["items"], sub, f"{path}[{i}]")
    return problems


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI v3 (structural CRD schema) -> JSON Schema: the keywords jsonschema reads are the same
    except `nullable`; the x- extensions are ignored by jsonschema."""
    out = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.pop("nullable", False) and "type" in node:
                node["type"] = [node["type"], "null"]
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(out)
    return out


def crd_problems(doc: dict[str, Any]) -> list[str]:
    """A RayCluster or RayJob against KubeRay v1.7.0's schema: unknown fields, types, enums, required."""
    schema = _crd()["kinds"][doc["kind"]]
    where = f"{doc['kind']}/{doc['metadata']['name']}"
    problems = [f"{where}: {p}" for p in _unknown_fields(schema, doc, "")]
    validator = jsonschema.Draft7Validator(_json_schema(schema))
    problems += [f"{where}: .{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    return problems


def kubernetes_problems(doc: dict[str, Any]) -> list[str]:
    """A Kubernetes object against the Kubernetes schemas (strict); RayCluster/RayJob: their pod templates."""
    import kubernetes_validate

    from helpers.k8s_render import pod_templates

    where = f"{doc['kind']}/{doc['metadata']['name']}"
    if doc.get("apiVersion") == "ray.io/v1":
        targets = [(f"{where} {place}", {"apiVersion": "v1", "kind": "PodTemplate",
                                         "metadata": {"name": "check"}, "template": template})
                   for place, template in pod_templates(doc)]
    elif (doc.get("apiVersion"), doc.get("kind")) in OTHER_CRD_KINDS:
        return []
    else:
        targets = [(where, doc)]
    problems = []
    for name, target in targets:
        try:
            kubernetes_validate.validate(target, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{name}: .{'.'.join(map(str, e.path))}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{name}: no schema: {e.message}")
    return problems
