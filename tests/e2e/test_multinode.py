"""Multi-node tensor parallelism on CPU: the LeaderWorkerSet's leader and worker pods, run as separate OS
processes with exactly the command lines and environment the chart renders (LWS's variables filled in as
its controller would, the leader's address being 127.0.0.1), meet over gloo on loopback and produce the same
tokens as the same TP size in one process; the worker outlives a SIGTERM until rank 0 ends the group."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import StackFactory
from kubesgl.launcher import Stack, free_port, http_ok
from kubesgl.values.sampling import SamplingParams
from support.bus_client import BusClient
from support.chart import VALUE_SETS, merged, render

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Kubernetes schedules pods", "1, 2, 3, 5, 8,"]
START_TIMEOUT_S = 240


def expand(value: str, variables: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container args: a defined variable is replaced, $$ is a literal $,
    anything else stays as written."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else variables.get(m.group(1), m.group(0)),
        value,
    )


def pod_process(container: dict[str, Any], lws_env: dict[str, str], nats_url: str) -> tuple[list[str], dict]:
    """The container as a local process: its args (the image's entrypoint is `kubesgl`) and environment.
    Values from Secrets and the downward API are what this machine lacks: NATS is the local server (no
    auth: the NATS credential files, mounted from a Secret in a pod, are left out), the pod's name is the
    process's."""
    variables = {
        e["name"]: e["value"]
        for e in container.get("env", [])
        if "value" in e and not (e["name"].startswith("KUBESGL_NATS_") and e["name"].endswith("_FILE"))
    } | lws_env
    if "KUBESGL_NATS_URL" in variables:
        variables["KUBESGL_NATS_URL"] = nats_url
    args = [expand(a, variables) for a in container["args"]]
    return [sys.executable, "-m", "kubesgl.cli", *args], {**os.environ, **variables, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def mesh(stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """NATS, a tokenizer and a detokenizer (the real services); the schedulers are started by the test."""
    stack = stack_factory(tmp_path_factory.mktemp("stack"), schedulers=0, gateways=0)
    try:
        yield stack
    finally:
        stack.stop(timeout_s=10)


def lws_containers(demo_model_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    values = merged(
        VALUE_SETS["cpu-demo"],
        {
            # The demo model's parent as the model mount: the init container builds it there in a pod.
            "model": {"mountPath": str(Path(demo_model_dir).parent)},
            "scheduler": {
                "nodes": 2,
                "tp": 2,
                "adminPort": free_port(),
                "distInitPort": free_port(),
                "numPages": 4096,
                "extraArgs": ["--instance-id", "lws-group-0"],
            },
        },
    )
    [lws] = [o for o in render(values) if o["kind"] == "LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    return template["leaderTemplate"]["spec"]["containers"][0], template["workerTemplate"]["spec"][
        "containers"
    ][0]


async def generate(nats_url: str) -> list[list[int]]:
    client = await BusClient.connect(nats_url)
    try:
        out = []
        for i, prompt in enumerate(PROMPTS):
            # Sampled with a seed: every rank draws the same numbers, so the tokens are reproducible.
            params = SamplingParams(
                max_tokens=12, temperature=0.9, top_p=0.95, seed=1000 + i, ignore_eos=True
            )
            stream = await client.generate(prompt=prompt, params=params, timeout_s=120)
            out.append(stream.token_ids)
        greedy = await client.generate(
            prompt=PROMPTS[0], params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
        return [*out, greedy.token_ids]
    finally:
        await client.close()


def wait_ready(admin_port: int, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not http_ok(f"http://127.0.0.1:{admin_port}/ready"):
        for proc, log in zip(procs, logs, strict=True):
            assert proc.poll() is None, f"exited {proc.returncode} while starting:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "not ready in time:\n" + "\n".join(
            log.read_text()[-2000:] for log in logs
        )
        time.sleep(0.2)


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def on_device(command: list[str], env: dict[str, str], device: str, gpus: str) -> tuple[list[str], dict]:
    """The command on `device`; on CUDA the process sees only `gpus`, as a pod sees only its node's GPUs."""
    if device == "cpu":
        return command, env
    command = list(command)
    command[command.index("--device") + 1] = "cuda"
    return command, {**env, "CUDA_VISIBLE_DEVICES": gpus}


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        # NCCL between two processes that each see one GPU: the GPU path of two nodes, on one host.
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
                ),
            ],
        ),
    ],
)
def test_leader_and_worker_pods_match_single_process_tp(
    mesh: Stack, demo_model_dir: str, tmp_path: Path, device: str
) -> None:
    leader, worker = lws_containers(demo_model_dir)
    admin_port = int(leader["args"][leader["args"].index("--admin-port") + 1])
    # What the LWS controller gives every container of group 0 (the leader's DNS name resolves here).
    group = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2"}
    leader_cmd, leader_env = on_device(
        *pod_process(leader, group | {"LWS_WORKER_INDEX": "0"}, mesh.nats_url), device, "0"
    )
    worker_cmd, worker_env = on_device(
        *pod_process(worker, group | {"LWS_WORKER_INDEX": "1"}, mesh.nats_url), device, "1"
    )
    assert worker_cmd[worker_cmd.index("--node-rank") + 1] == "1"
    # Only the leader talks to NATS.
    assert not [e for e in worker.get("env", []) if e["name"].startswith("KUBESGL_NATS")]
    logs = [tmp_path / "leader.log", tmp_path / "worker.log"]
    procs = [start(leader_cmd, leader_env, logs[0]), start(worker_cmd, worker_env, logs[1])]
    try:
        wait_ready(admin_port, procs, logs)
        multinode = asyncio.run(generate(mesh.nats_url))
        # A group's pods are stopped together: the worker keeps its rank through SIGTERM (rank 0 may
        # still be draining) and leaves when rank 0 ends the group.
        procs[1].send_signal(signal.SIGTERM)
        time.sleep(1.0)  # quiet window: a worker that left on SIGTERM would have exited within it
        assert procs[1].poll() is None, "the worker left its group on SIGTERM"
        assert asyncio.run(generate(mesh.nats_url)) == multinode
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(60) == 0, logs[0].read_text()[-3000:]
        assert procs[1].wait(60) == 0, logs[1].read_text()[-3000:]
        assert "ranks [1] of 2" in logs[1].read_text()
    finally:
        stop(procs)

    # The same engine flags in one process (`--tp 2`, rank 1 spawned by the engine), as a one-node chart runs.
    single = list(leader_cmd)
    for flag in ("--nnodes", "--node-rank", "--dist-init-addr"):
        i = single.index(flag)
        del single[i : i + 2]
    single[single.index("--instance-id") + 1] = "tp2-one-process"
    log = tmp_path / "single.log"
    proc = start(
        single, {**leader_env, "CUDA_VISIBLE_DEVICES": "0,1"} if device == "cuda" else leader_env, log
    )
    try:
        wait_ready(admin_port, [proc], [log])
        one_process = asyncio.run(generate(mesh.nats_url))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        stop([proc])
    assert multinode == one_process
    assert len({tuple(t) for t in multinode}) > 1, "the prompts should not all give the same tokens"
