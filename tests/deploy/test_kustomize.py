"""The kustomize manifests (k8s/) render offline, validate, and stay equal to the Helm chart's output."""

from __future__ import annotations

import difflib
import shutil
import subprocess
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from support.chart import CHART, ROOT, merged

K8S = ROOT / "k8s"
KUBE_VERSION = "1.32.0"
KUBECTL = shutil.which("kubectl")

pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl not installed (Debian/Ubuntu: apt-get install kubectl from the Kubernetes or Google Cloud apt repo)",
)

# Chart values each overlay must equal (release name "kubesgl"). Objects only Helm makes are switched off:
# the generated NATS Secret (kustomize references one the operator creates), the helm test pod, dashboards.
KUSTOMIZE_EQUIVALENT = {
    "nats": {"auth": {"existingSecret": "kubesgl-nats-auth"}},
    "tests": {"enabled": False},
    "metrics": {"grafanaDashboards": {"enabled": False}},
}
OVERLAY_VALUES: dict[str, dict[str, Any]] = {
    "cpu-demo": yaml.safe_load((CHART / "ci" / "cpu-demo-values.yaml").read_text()),
    "gpu": {"scheduler": {"tp": 2}},
}
HELM_ONLY_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/version"}


def kustomize(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` output as a list of objects (offline: no cluster is contacted)."""
    done = subprocess.run(
        [KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def helm_objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(merged(values, KUSTOMIZE_EQUIVALENT), name="kubesgl", namespace="default")
    docs = []
    for template, text in rendered.items():
        if not template.endswith("NOTES.txt"):
            docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


def comparable(obj: dict[str, Any]) -> dict[str, Any]:
    """The object without what only one tool can produce (Helm's labels and config checksum, namespace)."""
    obj = yaml.safe_load(yaml.safe_dump(obj))
    metadata = obj["metadata"]
    metadata.pop("namespace", None)
    metadata["labels"] = {k: v for k, v in metadata.get("labels", {}).items() if k not in HELM_ONLY_LABELS}
    template = obj.get("spec", {}).get("template", {})
    template.get("metadata", {}).get("annotations", {}).pop("checksum/config", None)
    pod = template.get("spec", {})
    # Volumes and mounts are keyed sets to Kubernetes; strategic-merge patches reorder them.
    pod.get("volumes", []).sort(key=lambda v: v["name"])
    for container in pod.get("initContainers", []) + pod.get("containers", []):
        container.get("volumeMounts", []).sort(key=lambda m: m["mountPath"])
    return obj


def by_identity(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): comparable(o) for o in objects}


@pytest.mark.parametrize("path", ["base", "overlays/cpu-demo", "overlays/gpu"])
def test_kustomization_renders_valid_objects(path: str) -> None:
    objects = kustomize(K8S / path)
    assert {o["kind"] for o in objects} >= {"Deployment", "StatefulSet", "Service", "ConfigMap"}
    for obj in objects:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("overlay", sorted(OVERLAY_VALUES))
def test_overlay_equals_chart_render(overlay: str) -> None:
    ours = by_identity(kustomize(K8S / "overlays" / overlay))
    helms = by_identity(helm_objects(OVERLAY_VALUES[overlay]))
    assert sorted(ours) == sorted(helms)
    for identity, helm_obj in helms.items():
        if ours[identity] != helm_obj:
            diff = difflib.unified_diff(
                yaml.safe_dump(helm_obj).splitlines(),
                yaml.safe_dump(ours[identity]).splitlines(),
                "chart",
                overlay,
                lineterm="",
            )
            pytest.fail(
                f"{identity} differs between the chart and k8s/overlays/{overlay}:\n" + "\n".join(diff)
            )


def test_gpu_overlay_tp_matches_gpus() -> None:
    scheduler = next(
        o
        for o in kustomize(K8S / "overlays" / "gpu")
        if o["kind"] == "StatefulSet" and "scheduler" in o["metadata"]["name"]
    )
    container = scheduler["spec"]["template"]["spec"]["containers"][0]
    tp = int(container["args"][container["args"].index("--tp") + 1])
    assert tp == 2
    assert container["resources"]["limits"]["nvidia.com/gpu"] == tp
    assert container["resources"]["requests"]["nvidia.com/gpu"] == tp


def test_manifests_hold_no_credentials() -> None:
    for path in ["base", "overlays/cpu-demo", "overlays/gpu"]:
        kinds = {o["kind"] for o in kustomize(K8S / path)}
        assert "Secret" not in kinds, (
            f"k8s/{path} must reference Secrets the operator creates, not carry them"
        )
