"""Role-aware routing for prefill/decode disaggregation: which instance a request goes to and which prefill
instance it names, from the roles the heartbeats advertise (--disaggregation-mode)."""

from __future__ import annotations

import pytest
from kubesgl.cli import build_parser
from kubesgl.protocol import GenerateRequest, Heartbeat
from kubesgl.routing import Candidate, make_router
from kubesgl.runtime.telemetry.metrics import RouterMetrics, new_registry
from kubesgl.services.tokenizer.request_router import RequestRouter
from kubesgl.values.sampling import SamplingParams


def _c(instance: str, role: str, running: int = 0) -> Candidate:
    hb = Heartbeat(
        instance_id=instance, model="m", context_len=4096, page_size=1, num_pages=100, running=running,
        queued=0, free_pages=100, available_pages=100, max_running_requests=8, draining=False, ts=0.0, role=role,
    )  # fmt: skip
    return Candidate(hb)


def _router() -> RequestRouter:
    return RequestRouter("least-load", make_router("least-load"), RouterMetrics(new_registry()))


def test_request_goes_to_least_loaded_decode_and_names_a_prefill_instance() -> None:
    cands = [_c("d0", "decode", 3), _c("d1", "decode", 1), _c("p0", "prefill", 2), _c("p1", "prefill", 0)]
    assert _router().pick_pair([1, 2, 3], None, cands) == ("d1", "p1")


@pytest.mark.parametrize(
    "roles",
    [("both", "both"), ("decode", "both"), ("prefill", "both"), ("prefill", "prefill"), ("decode", "decode")],
)
def test_without_both_roles_live_every_instance_serves_whole_requests(roles: tuple[str, str]) -> None:
    cands = [_c("a", roles[0], 2), _c("b", roles[1], 0)]
    assert _router().pick_pair([1], None, cands) == ("b", "")


def test_role_flag_defaults_to_both_and_rides_the_wire() -> None:
    parse = build_parser("scheduler").parse_args
    assert parse(["scheduler", "--model", "/m"]).disaggregation_mode == "both"
    assert (
        parse(["scheduler", "--model", "/m", "--disaggregation-mode", "decode"]).disaggregation_mode
        == "decode"
    )
    with pytest.raises(SystemExit):
        parse(["scheduler", "--model", "/m", "--disaggregation-mode", "colocated"])
    hb = _c("p", "prefill").heartbeat
    assert Heartbeat.from_bytes(hb.to_bytes()).role == "prefill"
    gen = GenerateRequest("r", "g", [1], SamplingParams(), 0.0, prefill_instance="p")
    assert GenerateRequest.from_bytes(gen.to_bytes()).prefill_instance == "p"
