"""scheduler.roles, prefill/decode disaggregation in the chart: a StatefulSet per role with its mode, replicas,
overrides, headless Service, PDB and KEDA trigger; UCX's listeners held to the transfer ports, which the
NetworkPolicy opens to decode pods on prefill pods and to nothing else; with roles off, nothing changes.
(Every value set, ci/disaggregation-values.yaml included, is linted and validated strictly in test_chart.py.)"""

from __future__ import annotations

import re
from typing import Any

import helm_python
import pytest
import yaml
from kubesgl.cli import build_parser
from support.chart import CHART, NAMESPACE, RELEASE, merged, render
from support.dashboard_queries import exported_names, metric_names
from test_chart import VALUE_SETS, _admits, _matches, arg, env

ROLES = VALUE_SETS["disaggregation"]
PDS = ("prefill", "decode")
# Every values key scheduler.roles has, set to something other than its default.
ROLE_VALUES_OFF = {
    "scheduler": {
        "roles": {
            "enabled": False,
            "timeoutSeconds": 5,
            "transfer": {"ports": {"from": 30000, "to": 30010}, "ucxTls": "tcp", "ucxNetDevices": "eth1"},
            "prefill": {
                "replicas": 3,
                "resources": {"requests": {"cpu": "1"}},
                "nodeSelector": {"a": "b"},
                "extraArgs": ["--x"],
                "autoscaling": {"minReplicas": 2, "maxReplicas": 3, "pendingPrefillTokensPerReplica": 7},
            },
            "decode": {
                "replicas": 4,
                "resources": {"requests": {"cpu": "2"}},
                "nodeSelector": {"c": "d"},
                "extraArgs": ["--y"],
                "autoscaling": {
                    "minReplicas": 2,
                    "maxReplicas": 3,
                    "runningRequestsPerReplica": None,
                    "kvUsagePerReplica": 0.5,
                },
            },
        }
    }
}


def by_name(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def role_sets(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The scheduler StatefulSets by the role their pods carry (kubesgl.io/pd-role)."""
    found = {}
    for sts in by_name(objects, "StatefulSet").values():
        labels = sts["spec"]["template"]["metadata"]["labels"]
        if labels["app.kubernetes.io/component"] == "scheduler":
            found[labels.get("kubesgl.io/pd-role", "")] = sts
    return found


def scheduler_args(sts: dict[str, Any]) -> Any:
    """The scheduler container's arguments, parsed by `kubesgl scheduler` itself (an unknown flag fails)."""
    return build_parser("scheduler").parse_args(sts["spec"]["template"]["spec"]["containers"][0]["args"])


def test_roles_render_a_statefulset_per_role_with_its_mode() -> None:
    without_keda = merged(ROLES, {"scheduler": {"autoscaling": {"enabled": False}}})
    sets = role_sets(render(without_keda))
    assert set(sets) == set(PDS)  # and no <release>-scheduler of whole-request instances
    roles = ROLES["scheduler"]["roles"]
    for pd, sts in sets.items():
        assert sts["metadata"]["name"] == f"{RELEASE}-scheduler-{pd}"
        args = scheduler_args(sts)
        assert args.disaggregation_mode == pd
        assert args.disaggregation_timeout == roles["timeoutSeconds"]
        assert sts["spec"]["replicas"] == roles[pd]["replicas"]
        # Each StatefulSet owns its role's pods only, and names them through its own headless Service.
        selector = sts["spec"]["selector"]["matchLabels"]
        assert selector["kubesgl.io/pd-role"] == pd
        assert _matches(selector, sts["spec"]["template"]["metadata"]["labels"])
        other = sets["decode" if pd == "prefill" else "prefill"]
        assert not _matches(selector, other["spec"]["template"]["metadata"]["labels"])
        assert sts["spec"]["serviceName"] == sts["metadata"]["name"]
    # KEDA owns the replica counts when autoscaling is on.
    assert all("replicas" not in s["spec"] for s in role_sets(render(ROLES)).values())


def test_each_role_pod_gets_a_distinct_stable_instance_id() -> None:
    """A scheduler's instance id is its hostname, the pod name (no --instance-id): <statefulset>-<ordinal>, the same
    across restarts and different between the roles (heartbeats, handoff subjects and NIXL agents use it)."""
    sets = role_sets(render(ROLES))
    pods = []
    for sts in sets.values():
        assert scheduler_args(sts).instance_id is None
        assert "hostname" not in sts["spec"]["template"]["spec"]
        pods += [f"{sts['metadata']['name']}-{i}" for i in range(8)]
    assert len(set(pods)) == len(pods)


def test_each_role_has_its_headless_service_and_pdb() -> None:
    objects = render(ROLES)
    services, pdbs = by_name(objects, "Service"), by_name(objects, "PodDisruptionBudget")
    assert f"{RELEASE}-scheduler" not in services and f"{RELEASE}-scheduler" not in pdbs
    for pd, sts in role_sets(objects).items():
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        service = services[sts["spec"]["serviceName"]]["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
        assert service["selector"] == sts["spec"]["selector"]["matchLabels"]
        pdb = pdbs[f"{RELEASE}-scheduler-{pd}"]["spec"]
        assert pdb["maxUnavailable"] == 1 and _matches(pdb["selector"]["matchLabels"], pod_labels)


def test_role_overrides_resources_node_selector_and_arguments() -> None:
    sets = role_sets(render(ROLES))
    roles, scheduler = ROLES["scheduler"]["roles"], ROLES["scheduler"]
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["scheduler"]
    decode = sets["decode"]["spec"]["template"]["spec"]
    prefill = sets["prefill"]["spec"]["template"]["spec"]
    # decode sets its own resources; prefill, none, gets scheduler.resources; both get a GPU from tp.
    want = merged(
        roles["decode"]["resources"], {"limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 1}}
    )
    assert decode["containers"][0]["resources"] == want
    assert prefill["containers"][0]["resources"] == merged(
        defaults["resources"], {"limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 1}}
    )
    for pd, pod in (("prefill", prefill), ("decode", decode)):
        assert pod["nodeSelector"] == roles[pd]["nodeSelector"]
        args = pod["containers"][0]["args"]
        assert args[-len(roles[pd]["extraArgs"]) :] == roles[pd]["extraArgs"]
        assert arg(pod["containers"][0], "--dtype") == scheduler["dtype"]  # the engine flags both share
    plain = role_sets(render({"scheduler": {"roles": {"enabled": True}, "nodeSelector": {"pool": "gpu"}}}))
    assert plain["decode"]["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "gpu"}


def test_ucx_env_holds_the_listeners_to_the_transfer_ports() -> None:
    transfer = ROLES["scheduler"]["roles"]["transfer"]
    for sts in role_sets(render(ROLES)).values():
        variables = env(sts["spec"]["template"]["spec"]["containers"][0])
        assert variables["UCX_TCP_PORT_RANGE"] == "20000-20099"
        assert variables["UCX_TLS"] == transfer["ucxTls"]
        assert variables["UCX_NET_DEVICES"] == transfer["ucxNetDevices"]
    # Unset, UCX picks its transports and interfaces itself: no empty variable overrides it.
    plain = role_sets(render({"scheduler": {"roles": {"enabled": True}}}))["prefill"]
    assert {k for k in env(plain["spec"]["template"]["spec"]["containers"][0]) if k.startswith("UCX_")} == {
        "UCX_TCP_PORT_RANGE"
    }


def _transfer_rules(objects: list[dict[str, Any]], template: dict[str, Any]) -> list[dict[str, Any]]:
    """The ingress rules selecting this pod that open a port range (the KV transfer's), or every port."""
    labels = template["metadata"]["labels"]
    return [
        rule
        for policy in by_name(objects, "NetworkPolicy").values()
        if _matches(policy["spec"]["podSelector"]["matchLabels"], labels)
        for rule in policy["spec"]["ingress"]
        if "ports" not in rule or any("endPort" in p or isinstance(p["port"], int) for p in rule["ports"])
    ]


def test_networkpolicy_lets_decode_pull_from_prefill_and_opens_nothing_else() -> None:
    """Decode pods reach the prefill pods' UCX listeners (the transfer port range); prefill pods reach no decode
    pod's ports (UCX answers on the decode side's connection), and no other pod reaches either role's."""
    objects = render(ROLES)
    sets = role_sets(objects)
    prefill, decode = sets["prefill"]["spec"]["template"], sets["decode"]["spec"]["template"]
    [rule] = _transfer_rules(objects, prefill)
    assert rule["ports"] == [{"port": 20000, "endPort": 20099, "protocol": "TCP"}]
    assert _admits(rule, decode) and not _admits(rule, prefill)
    others = [o["spec"]["template"] for o in objects if o["kind"] == "Deployment"]
    assert others and not any(_admits(rule, pod) for pod in others)
    assert _transfer_rules(objects, decode) == []
    # Both roles keep the scheduler policy: admin port from metricsFrom only.
    scheduler = by_name(objects, "NetworkPolicy")[f"{RELEASE}-scheduler"]["spec"]
    assert _matches(scheduler["podSelector"]["matchLabels"], prefill["metadata"]["labels"])
    assert _matches(scheduler["podSelector"]["matchLabels"], decode["metadata"]["labels"])
    assert [r["ports"] for r in scheduler["ingress"]] == [[{"port": "admin", "protocol": "TCP"}]]


def scaled_objects(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["spec"]["scaleTargetRef"]["name"]: o["spec"] for o in objects if o["kind"] == "ScaledObject"}


def test_every_role_scaledobject_queries_an_exported_series() -> None:
    """Prefill scales on the tokens it has still to prefill, decode on running streams and KV usage: series the
    scheduler exports, summed over that role's pods only (never the other role's)."""
    objects = render(ROLES)
    sets, scaled = role_sets(objects), scaled_objects(objects)
    assert set(scaled) == {s["metadata"]["name"] for s in sets.values()}
    want = {
        "prefill": {"kubesgl_scheduler_pending_prefill_tokens": "16384"},
        "decode": {"sglang:num_running_reqs": "128", "sglang:token_usage": "0.8"},
    }
    bounds = {"prefill": (1, 6), "decode": (2, 8)}
    for pd, sts in sets.items():
        spec = scaled[sts["metadata"]["name"]]
        assert spec["scaleTargetRef"]["kind"] == "StatefulSet"
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == bounds[pd]
        series = {}
        for trigger in spec["triggers"]:
            query = trigger["metadata"]["query"]
            [name] = metric_names(query)
            assert name in exported_names(), query
            series[name] = trigger["metadata"]["threshold"]
            [pattern] = re.findall(r'pod=~"([^"]+)"', query)
            assert re.fullmatch(pattern, f"{sts['metadata']['name']}-11")
            other = "decode" if pd == "prefill" else "prefill"
            assert not re.fullmatch(pattern, f"{RELEASE}-scheduler-{other}-0")
            assert f'namespace="{NAMESPACE}"' in query and trigger["metadata"]["ignoreNullValues"] == "false"
        assert series == want[pd]
    # A decode trigger switched off leaves the other.
    kv_only = merged(
        ROLES, {"scheduler": {"roles": {"decode": {"autoscaling": {"runningRequestsPerReplica": None}}}}}
    )
    decode = scaled_objects(render(kv_only))[f"{RELEASE}-scheduler-decode"]
    assert [t["name"] for t in decode["triggers"]] == ["kv-usage"]


def test_roles_off_renders_what_it_did() -> None:
    """Role values do nothing while scheduler.roles is off: the render is the one without them, byte for byte,
    with the one <release>-scheduler StatefulSet of whole-request instances."""
    for value_set in ("defaults", "full-features", "gpu-tp4"):
        values = VALUE_SETS[value_set]
        with helm_python.Chart.load(CHART) as chart:
            plain = chart.render(values, name=RELEASE, namespace=NAMESPACE)
            with_roles = chart.render(merged(values, ROLE_VALUES_OFF), name=RELEASE, namespace=NAMESPACE)
        assert with_roles == plain, value_set
    objects = render({})
    [sts] = [o for o in objects if o["kind"] == "StatefulSet" and "scheduler" in o["metadata"]["name"]]
    assert sts["metadata"]["name"] == f"{RELEASE}-scheduler" and "kubesgl.io/pd-role" not in str(objects)
    assert scheduler_args(sts).disaggregation_mode == "both"
    assert not [
        e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"] if e["name"].startswith("UCX")
    ]


def test_role_dashboard_loads_only_with_roles() -> None:
    def boards(values: dict[str, Any]) -> set[str]:
        [configmap] = [o for o in render(values) if o["metadata"]["name"].endswith("-dashboards")]
        return set(configmap["data"])

    assert "kubesgl-disaggregation.json" in boards(ROLES)
    assert boards(ROLES) - boards({}) == {"kubesgl-disaggregation.json"}


ROLE_REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "tensor parallel": ({"scheduler": {"tp": 2}}, "tp"),
    "transfer ports reversed": (
        {"scheduler": {"roles": {"transfer": {"ports": {"from": 20100, "to": 20000}}}}},
        "scheduler.roles.transfer.ports.from",
    ),
    "no decode trigger": (
        {
            "scheduler": {
                "autoscaling": {"enabled": True, "prometheusAddress": "http://p:9090"},
                "roles": {
                    "decode": {"autoscaling": {"runningRequestsPerReplica": None, "kvUsagePerReplica": None}}
                },
            }
        },
        "both null",
    ),
    "role bounds reversed": (
        {
            "scheduler": {
                "autoscaling": {"enabled": True, "prometheusAddress": "http://p:9090"},
                "roles": {"prefill": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
            }
        },
        "scheduler.roles.prefill.autoscaling.minReplicas",
    ),
}


@pytest.mark.parametrize("case", sorted(ROLE_REFUSALS))
def test_roles_refuse_what_the_transfer_cannot_serve(case: str) -> None:
    values, named = ROLE_REFUSALS[case]
    with pytest.raises(helm_python.HelmError, match=re.escape(named)):
        render(merged({"scheduler": {"roles": {"enabled": True}}}, values))
    # The same values render with roles off: only the roles refuse them.
    render(values)
