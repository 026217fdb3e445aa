"""Writes tests/helpers/kuberay/schema-v1.7.0.json: KubeRay's CRD schemas cut down to the fields vitscale uses.

Not run by the tests (they read the JSON it wrote); run it again when k8s/ starts using a field the
trimmed schema lacks (the tests say so), with the CRDs read from the ray-project/kuberay repository:

    git --git-dir=KUBERAY/.git show v1.7.0:ray-operator/config/crd/bases/ray.io_rayjobs.yaml > rayjobs.yaml
    git --git-dir=KUBERAY/.git show v1.7.0:ray-operator/config/crd/bases/ray.io_rayclusters.yaml > rayclusters.yaml
    .venv/bin/python tests/helpers/kuberay/trim_crd.py rayclusters.yaml rayjobs.yaml

Trimming keeps, for every object the manifests reach, the CRD's full definition of each field they set
(type, enum, pattern, bounds, required, nested the same way), and the names of all the fields the CRD
allows there (`x-crd-properties`), so that a field KubeRay knows but the trimmed copy left out is told
apart from one KubeRay does not know at all. Descriptions are dropped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
OUT = Path(__file__).with_name("schema-v1.7.0.json")
SOURCE = {
    "repository": "github.com/ray-project/kuberay",
    "tag": "v1.7.0",
    "commit": "59d663aeec13760646da3db9c1cf8cfe883e30b7",
    "paths": ["ray-operator/config/crd/bases/ray.io_rayclusters.yaml",
              "ray-operator/config/crd/bases/ray.io_rayjobs.yaml"],
    "note": "identical to helm-chart/kuberay-operator/crds/ at that tag; trimmed by tests/helpers/kuberay/trim_crd.py",
}


#: Fields kept although vitscale does not set them: the ones the operator's cross-field rules
#: (tests/helpers/kuberay_rules.py) are about, so that those rules can be proven on schema-valid objects.
ALWAYS_KEEP = {"spec.suspend", "spec.clusterSelector", "spec.activeDeadlineSeconds", "spec.submitterConfig",
               "spec.rayClusterSpec.authOptions.enableK8sTokenAuth", "spec.authOptions.enableK8sTokenAuth"}


def trim(schema: dict[str, Any], instances: list[Any], path: str = "") -> dict[str, Any]:
    """The part of `schema` that `instances` (values it validates) reach, plus ALWAYS_KEEP."""
    out = {k: v for k, v in schema.items() if k not in ("description", "properties", "items", "additionalProperties")}
    if "properties" in schema:
        objects = [i for i in instances if isinstance(i, dict)]
        used = {k for o in objects for k in o if k in schema["properties"]}
        used |= {k for k in schema["properties"] if f"{path}{k}" in ALWAYS_KEEP}
        out["x-crd-properties"] = sorted(schema["properties"])
        out["properties"] = {k: trim(schema["properties"][k], [o[k] for o in objects if k in o], f"{path}{k}.")
                             for k in sorted(used)}
    if isinstance(schema.get("additionalProperties"), dict):
        values = [v for i in instances if isinstance(i, dict) for v in i.values()]
        out["additionalProperties"] = trim(schema["additionalProperties"], values)
    elif "additionalProperties" in schema:
        out["additionalProperties"] = schema["additionalProperties"]
    if "items" in schema:
        out["items"] = trim(schema["items"], [v for i in instances if isinstance(i, list) for v in i])
    return out


def crd_schema(path: Path) -> tuple[str, dict[str, Any]]:
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return crd["spec"]["names"]["kind"], version["schema"]["openAPIV3Schema"]


def vitscale_objects() -> list[dict[str, Any]]:
    """Every RayCluster and RayJob vitscale ships: the rendered overlays and the base cluster template."""
    docs = [d for d in yaml.safe_load_all((ROOT / "k8s/base/raycluster.yaml").read_text()) if d]
    for kustomization in sorted(ROOT.glob("k8s/overlays/**/kustomization.yaml")):
        rendered = subprocess.run(["kubectl", "kustomize", str(kustomization.parent)], check=True,
                                  capture_output=True, text=True).stdout
        docs += [d for d in yaml.safe_load_all(rendered) if d]
    return [d for d in docs if d.get("apiVersion") == "ray.io/v1"]


def main(crd_paths: list[str]) -> None:
    objects = vitscale_objects()
    kinds = {}
    for path in crd_paths:
        kind, schema = crd_schema(Path(path))
        kinds[kind] = trim(schema, [o for o in objects if o["kind"] == kind])
    OUT.write_text(json.dumps({"source": SOURCE, "kinds": kinds}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes) for {sorted(kinds)}")


if __name__ == "__main__":
    main(sys.argv[1:])
