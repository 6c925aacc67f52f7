"""Day-2 behaviour of the chart with real Helm: upgrades that would change an immutable field are refused at
render time (Helm's `lookup` reading the installed objects from FakeKubeAPI, a stand-in for the API server),
renders are byte-identical run after run (no secret is generated at render time), and the NATS credentials
hook Job creates its Secret once and keeps it."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import helm_python
import pytest
import yaml
from support.chart import CHART, NAMESPACE, RELEASE, ROOT, merged, render
from support.fake_kube_api import FakeKubeAPI
from test_chart import VALUE_SETS, credential_files, one

ORPHAN = f"kubectl -n {NAMESPACE} delete statefulset {{name}} --cascade=orphan"


def render_installed(api: FakeKubeAPI, values: dict[str, Any]) -> dict[str, str]:
    """An upgrade's render: Helm's lookup asks `api` for the installed objects."""
    config = helm_python.Config(kube_apiserver=api.url, kube_token="test", namespace=NAMESPACE)
    try:
        with helm_python.Chart.load(CHART) as chart:
            return config.render(chart, values, name=RELEASE, namespace=NAMESPACE, is_upgrade=True)
    finally:
        config.close()


def render_text(values: dict[str, Any]) -> dict[str, str]:
    with helm_python.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.fixture
def cluster() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI().serving() as api:
        yield api


HF_SIZE = {"model": {"huggingface": {"storage": {"size": "80Gi"}}}}
PVC_SOURCE = {"model": {"source": "pvc", "pvc": {"claimName": "models"}}}
FULL = VALUE_SETS["full-features"]
MULTI = VALUE_SETS["multinode-gpu"]
ROLES = VALUE_SETS["disaggregation"]

# case -> (installed values, new values, the refusal names, the StatefulSet/Deployment it names)
REFUSED: dict[str, tuple[dict[str, Any], dict[str, Any], str, str]] = {
    "model volume size": (
        {},
        HF_SIZE,
        "model.huggingface.storage.size changed (installed: 50Gi, now: 80Gi)",
        "statefulset kubesgl-scheduler",
    ),
    "model StorageClass": (
        {},
        {"model": {"huggingface": {"storage": {"storageClassName": "fast-ssd"}}}},
        "model.huggingface.storage.storageClassName changed (installed: (cluster default), now: fast-ssd)",
        "statefulset kubesgl-scheduler",
    ),
    "model access modes": (
        {},
        {"model": {"huggingface": {"storage": {"accessModes": ["ReadWriteOncePod"]}}}},
        'model.huggingface.storage.accessModes changed (installed: ["ReadWriteOnce"], now: ["ReadWriteOncePod"])',
        "statefulset kubesgl-scheduler",
    ),
    "model source huggingface to pvc": (
        {},
        PVC_SOURCE,
        "model.source changed (installed: huggingface, now: pvc)",
        "statefulset kubesgl-scheduler",
    ),
    "model source pvc to huggingface": (
        PVC_SOURCE,
        {},
        "model.source changed (installed: pvc or demo (no model volume), now: huggingface)",
        "statefulset kubesgl-scheduler",
    ),
    "pod management policy": (
        {},
        {"scheduler": {"podManagementPolicy": "OrderedReady"}},
        "scheduler.podManagementPolicy changed (installed: Parallel, now: OrderedReady)",
        "statefulset kubesgl-scheduler",
    ),
    "JetStream turned on": (
        {},
        {"nats": {"bundled": {"jetstream": {"enabled": True}}}},
        "nats.bundled.jetstream.enabled changed (installed: false, now: true)",
        "statefulset kubesgl-nats",
    ),
    "JetStream turned off": (
        FULL,
        merged(FULL, {"nats": {"bundled": {"jetstream": {"enabled": False}}}}),
        "nats.bundled.jetstream.enabled changed (installed: true, now: false)",
        "statefulset kubesgl-nats",
    ),
    "JetStream volume size": (
        FULL,
        merged(FULL, {"nats": {"bundled": {"jetstream": {"size": "20Gi"}}}}),
        "nats.bundled.jetstream.size changed (installed: 10Gi, now: 20Gi)",
        "statefulset kubesgl-nats",
    ),
    "multi-node model volume size": (
        MULTI,
        merged(MULTI, {"model": {"huggingface": {"storage": {"size": "600Gi"}}}}),
        "model.huggingface.storage.size changed (installed: 500Gi, now: 600Gi)",
        "leaderworkerset kubesgl-scheduler",
    ),
    "multi-node model StorageClass": (
        MULTI,
        merged(MULTI, {"model": {"huggingface": {"storage": {"storageClassName": "slow-hdd"}}}}),
        "model.huggingface.storage.storageClassName changed (installed: fast-ssd, now: slow-hdd)",
        "leaderworkerset kubesgl-scheduler",
    ),
    "multi-node model source huggingface to pvc": (
        MULTI,
        merged(MULTI, PVC_SOURCE),
        "model.source changed (installed: huggingface, now: pvc)",
        "leaderworkerset kubesgl-scheduler",
    ),
    "a disaggregation role's model volume size": (
        ROLES,
        merged(ROLES, HF_SIZE),
        "model.huggingface.storage.size changed (installed: 50Gi, now: 80Gi)",
        "statefulset kubesgl-scheduler-prefill",
    ),
    "selector labels": (
        {"fullnameOverride": "kubesgl"},
        {"fullnameOverride": "kubesgl", "nameOverride": "llm"},
        "nameOverride (the app.kubernetes.io/name selector label) changed",
        "kubesgl-",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_upgrade_refuses_an_immutable_change(case: str, cluster: FakeKubeAPI) -> None:
    before, after, names, target = REFUSED[case]
    cluster.install(render(before), NAMESPACE)
    # A first install (nothing in the cluster) of the same values is fine: nothing is immutable yet.
    render_text(after)
    with pytest.raises(helm_python.HelmError) as refused:
        render_installed(cluster, after)
    message = str(refused.value)
    assert "upgrade refused: " + names in message
    assert "which Kubernetes does not let an upgrade change" in message
    if target.startswith("statefulset "):
        assert ORPHAN.format(name=target.removeprefix("statefulset ")) in message
    elif target.startswith("leaderworkerset "):
        # Its StatefulSets (made by the LWS controller) hold the old templates: orphaning would not help.
        assert f"kubectl -n {NAMESPACE} delete {target} (every group stops" in message
        assert "--cascade=orphan" not in message
        assert "spec.leaderWorkerTemplate.volumeClaimTemplates" in message
    else:
        assert "--cascade=orphan" in message and target in message
    assert "then run the same helm upgrade again" in message
    # The values it names are the user's, and the recovery is documented.
    assert "docs/operations.md#changes-kubernetes-refuses" in message


MUTABLE: dict[str, dict[str, Any]] = {
    "same values": {},
    "the same size spelt in MiB": {"model": {"huggingface": {"storage": {"size": "51200Mi"}}}},
    "replicas, revision and image": {
        "scheduler": {"replicas": 3},
        "model": {"huggingface": {"revision": "0123456789abcdef0123456789abcdef01234567"}},
        "image": {"cuda": {"tag": "0.2.0"}},
    },
    "scheduler resources and drain": {
        "scheduler": {"drainTimeoutSeconds": 400, "terminationGracePeriodSeconds": 430, "shmSize": "16Gi"}
    },
}


@pytest.mark.parametrize("case", sorted(MUTABLE))
def test_upgrade_allows_mutable_changes(case: str, cluster: FakeKubeAPI) -> None:
    cluster.install(render({}), NAMESPACE)
    # The installed objects change nothing in the output: the render is the offline one, byte for byte.
    assert render_installed(cluster, MUTABLE[case]) == render_text(MUTABLE[case])


def test_multinode_upgrade_reads_the_leaderworkerset_and_allows_mutable_changes(cluster: FakeKubeAPI) -> None:
    cluster.install(render(MULTI), NAMESPACE)
    more = merged(
        MULTI, {"scheduler": {"replicas": 3}, "model": {"huggingface": {"storage": {"size": "512000Mi"}}}}
    )
    assert render_installed(cluster, more) == render_text(more)
    gets = {path for method, path in cluster.requests if method == "GET"}
    assert (
        f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{NAMESPACE}/leaderworkersets/{RELEASE}-scheduler"
        in gets
    )


def test_switching_roles_on_checks_only_the_statefulsets_it_keeps(cluster: FakeKubeAPI) -> None:
    """<release>-scheduler goes when scheduler.roles turns on (Helm deletes it): a claim change there is no
    immutable-field update, so the upgrade renders; the role StatefulSets it keeps are read and checked."""
    cluster.install(render({}), NAMESPACE)
    on = merged(ROLES, HF_SIZE)
    assert render_installed(cluster, on) == render_text(on)
    gets = {path for method, path in cluster.requests if method == "GET"}
    for pd in ("prefill", "decode"):
        assert f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/{RELEASE}-scheduler-{pd}" in gets


def test_lookup_reads_the_installed_objects(cluster: FakeKubeAPI) -> None:
    """The checks go through Helm's real lookup: discovery, then a GET of each object they compare."""
    cluster.install(render({}), NAMESPACE)
    render_installed(cluster, {})
    gets = {path for method, path in cluster.requests if method == "GET"}
    assert f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/{RELEASE}-scheduler" in gets
    assert f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/{RELEASE}-nats" in gets
    assert f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{RELEASE}-gateway" in gets


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_renders_are_byte_identical(value_set: str, cluster: FakeKubeAPI) -> None:
    values = VALUE_SETS[value_set]
    first, second = render_text(values), render_text(values)
    assert first.keys() == second.keys()
    for template, text in first.items():
        assert second[template] == text, f"{template} differs between two renders"
    # An upgrade against the installed release renders the same bytes too (nothing is read back into them).
    cluster.install(render(values), NAMESPACE)
    assert render_installed(cluster, values) == first


def test_no_render_holds_a_secret() -> None:
    for value_set, values in VALUE_SETS.items():
        assert not [o for o in render(values) if o["kind"] == "Secret"], value_set


# -- the NATS credentials hook Job ---------------------------------------------------------------------
def credentials_job(values: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    objects = render(values)
    return objects, one(objects, "Job", "nats-credentials")


def run_job(job: dict[str, Any], api: FakeKubeAPI) -> subprocess.CompletedProcess[str]:
    """The Job's container command, run here against `api` (plain HTTP: no token or CA to mount)."""
    spec = job["spec"]["template"]["spec"]["containers"][0]
    variables = {e["name"]: e["value"] for e in spec["env"] if "value" in e}
    variables |= {"KUBE_API": api.url, "KUBE_CREDENTIALS": "", "NAMESPACE": NAMESPACE}
    return subprocess.run(
        [sys.executable, *spec["command"][1:]],
        env={**os.environ, **variables},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_credentials_job_creates_the_secret_once_and_keeps_it(cluster: FakeKubeAPI) -> None:
    objects, job = credentials_job({})
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    created = run_job(job, cluster)
    assert created.returncode == 0, created.stderr
    assert "created" in created.stdout
    secret = cluster.get("v1", "Secret", NAMESPACE, f"{RELEASE}-nats-auth")
    assert secret is not None
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(data) == {"token", "user", "password"}
    assert len(data["token"]) == 48 and data["token"].isalnum() and data["user"] == "kubesgl"
    # The servers and every client read that Secret's keys.
    server = one(objects, "StatefulSet", "nats")["spec"]["template"]["spec"]["containers"][0]
    assert {
        "name": "NATS_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": secret["metadata"]["name"], "key": "token"}},
    } in server["env"]
    # Every later upgrade (or GitOps sync) runs it again: the Secret is kept, byte for byte.
    kept = run_job(job, cluster)
    assert kept.returncode == 0, kept.stderr
    assert "exists: kept" in kept.stdout
    assert cluster.get("v1", "Secret", NAMESPACE, f"{RELEASE}-nats-auth") == secret
    assert [m for m, _ in cluster.requests].count("POST") == 1


def test_credentials_job_keeps_a_secret_of_an_earlier_release(cluster: FakeKubeAPI) -> None:
    """Releases of the chart before the Job rendered the Secret themselves (resource-policy keep): upgrading
    keeps their credentials, so running pods stay connected."""
    earlier = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{RELEASE}-nats-auth"},
        "data": {"token": base64.b64encode(b"earlier-token").decode()},
    }
    cluster.add(earlier, NAMESPACE)
    done = run_job(credentials_job({})[1], cluster)
    assert done.returncode == 0, done.stderr
    assert cluster.get("v1", "Secret", NAMESPACE, f"{RELEASE}-nats-auth")["data"] == earlier["data"]


def test_credentials_job_asks_only_what_its_role_grants(cluster: FakeKubeAPI) -> None:
    objects, job = credentials_job({"nats": {"auth": {"mode": "userPassword"}}})
    role = one(objects, "Role", "nats-credentials")
    binding = one(objects, "RoleBinding", "nats-credentials")
    account = one(objects, "ServiceAccount", "nats-credentials")
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"] == binding["subjects"][0]["name"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    run_job(job, cluster)
    run_job(job, cluster)
    secrets_path = f"/api/v1/namespaces/{NAMESPACE}/secrets"
    for method, path in cluster.requests:
        verb = {"GET": "get", "POST": "create"}[method]
        name = path.removeprefix(secrets_path + "/") if path != secrets_path else None
        assert any(
            rule["resources"] == ["secrets"]
            and verb in rule["verbs"]
            and (name is None or "resourceNames" not in rule or name in rule["resourceNames"])
            and (name is not None or "resourceNames" not in rule)
            for rule in role["rules"]
        ), (method, path)
    # The hook objects run before the servers start and go away once it succeeded.
    weights = {
        o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"])
        for o in (role, binding, account, job)
    }
    assert weights["Job"] > max(weights["Role"], weights["RoleBinding"], weights["ServiceAccount"])


def test_credentials_job_lost_race_counts_as_kept(cluster: FakeKubeAPI) -> None:
    """Two runs at once (a retried hook): the one whose create meets 409 AlreadyExists succeeds too."""
    path = f"/api/v1/namespaces/{NAMESPACE}/secrets/{RELEASE}-nats-auth"
    other = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{RELEASE}-nats-auth"}, "data": {}}
    cluster.add(other, NAMESPACE)
    cluster.stale_once.add(path)  # this run's GET misses the Secret the other run just created
    done = run_job(credentials_job({})[1], cluster)
    assert done.returncode == 0, done.stderr
    assert "created meanwhile by another run: kept" in done.stdout
    assert cluster.get("v1", "Secret", NAMESPACE, f"{RELEASE}-nats-auth")["data"] == {}


def test_existing_secret_renders_no_job() -> None:
    for values in (
        {"nats": {"auth": {"existingSecret": "mine"}}},
        {"nats": {"auth": {"mode": "none"}}},
        VALUE_SETS["external-nats"],
    ):
        objects = render(values)
        assert not [o for o in objects if o["kind"] in ("Job", "Role", "RoleBinding", "Secret")], values
    pod = one(render({"nats": {"auth": {"existingSecret": "mine"}}}), "Deployment", "gateway")["spec"][
        "template"
    ]["spec"]
    assert credential_files(pod, pod["containers"][0]) == {"KUBESGL_NATS_TOKEN_FILE": ("mine", "token")}


def test_the_refusal_points_at_a_documented_section() -> None:
    from test_alerts import _anchors

    assert "changes-kubernetes-refuses" in _anchors((ROOT / "docs" / "operations.md").read_text())


# -- the recovery from a selector change, against the StatefulSet controller's naming rule --------------------
def _replace_steps(text: str) -> list[tuple[str, int]]:
    """The pod steps of a recovery text's `for n in $(seq 0 ...)` loop, for ordinals 0..2: ("delete" | "ready", n)."""
    start = text.find("for n in $(seq 0 ")
    if start < 0:
        return []
    body = re.findall(r"delete pod \S+-\$n|wait --for=condition=Ready pod/\S+-\$n", text[start:])
    return [("delete" if "delete" in step else "ready", n) for n in range(3) for step in body]


def _statefulset_recovers(steps: list[tuple[str, int]], policy: str, replicas: int = 3) -> bool:
    """Runs `steps` after the orphaning and the upgrade: every ordinal is still an orphaned old pod. The new
    StatefulSet creates pod <name>-<N> only while no pod has that name (and, OrderedReady, once every lower
    ordinal of its own is Ready); a "ready" step waits for the new pod N, forever if it cannot start."""
    pods = dict.fromkeys(range(replicas), "orphan")

    def reconcile() -> None:
        for n in range(replicas):
            if n not in pods:
                pods[n] = "new"  # created and (in this model) Ready at once
            if policy == "OrderedReady" and pods[n] != "new":
                return

    reconcile()
    for action, n in steps:
        if action == "delete":
            pods.pop(n, None)
        elif pods.get(n) != "new":
            return False  # waits for a pod that cannot start
        reconcile()
    return all(state == "new" for state in pods.values())


def _statefulset_recovery_texts(cluster: FakeKubeAPI) -> dict[str, str]:
    cluster.install(render({"fullnameOverride": "kubesgl"}), NAMESPACE)
    with pytest.raises(helm_python.HelmError) as refused:
        render_installed(cluster, {"fullnameOverride": "kubesgl", "nameOverride": "llm"})
    section = (ROOT / "docs" / "operations.md").read_text().split("#### A selector change", 1)[1]
    return {"the refusal": str(refused.value), "docs/operations.md": section.split("\n#", 1)[0]}


@pytest.mark.parametrize("policy", ["Parallel", "OrderedReady"])
def test_selector_change_recovery_replaces_statefulset_pods_in_an_order_that_finishes(
    policy: str, cluster: FakeKubeAPI
) -> None:
    """A StatefulSet's new pods have the orphans' names, so "delete the orphans once the new ones are Ready"
    never finishes; the texts must delete each orphan before waiting for its replacement."""
    waiting_first = [("ready", 0), ("delete", 0)]
    assert not _statefulset_recovers(waiting_first, policy)
    for where, text in _statefulset_recovery_texts(cluster).items():
        steps = _replace_steps(text)
        assert steps, f"{where}: no per-ordinal replacement steps"
        assert _statefulset_recovers(steps, policy), (where, steps)


# -- the LeaderWorkerSet version the chart needs ----------------------------------------------------------------
def _lws_crd(with_claim_templates: bool) -> dict[str, Any]:
    """The vendored LWS CRD (tests/data/crds, after v0.8.0), or that CRD as v0.7.0 published it in the fields
    that matter here: v0.7.0's spec.leaderWorkerTemplate has neither volumeClaimTemplates nor
    persistentVolumeClaimRetentionPolicy (both came in v0.8.0; `git show v0.7.0:config/crd/bases/...` in
    kubernetes-sigs/lws)."""
    path = ROOT / "tests" / "data" / "crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
    [crd] = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if not with_claim_templates:
        for version in crd["spec"]["versions"]:
            template = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
            template["leaderWorkerTemplate"]["properties"].pop("volumeClaimTemplates")
            template["leaderWorkerTemplate"]["properties"].pop("persistentVolumeClaimRetentionPolicy")
    return crd


def test_multinode_install_needs_lws_with_claim_templates(cluster: FakeKubeAPI) -> None:
    cluster.add(_lws_crd(with_claim_templates=True), NAMESPACE)
    render_installed(cluster, MULTI)  # v0.8.0 or later: fine
    cluster.add(_lws_crd(with_claim_templates=False), NAMESPACE)
    with pytest.raises(
        helm_python.HelmError, match=r"needs LeaderWorkerSet \(kubernetes-sigs/lws\) v0.8.0 or later"
    ):
        render_installed(cluster, MULTI)
    # Without a cluster (helm template, Argo CD) lookup reads nothing and the render goes on.
    render_text(MULTI)
    # A single-node release never asks.
    cluster.requests.clear()
    render_installed(cluster, {})
    assert not [p for _, p in cluster.requests if "customresourcedefinitions" in p]
