"""A real Prometheus server for tests (Debian package `prometheus`): scrapes the given /metrics targets (or
whole scrape jobs, e.g. support.operator_scrape's) every second on loopback, evaluates the given alerting rules
every second, and answers PromQL through its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kubesgl.launcher import free_port

INSTALL_HINT = "install it with: apt-get update && apt-get install -y prometheus"


class PrometheusServer:
    """`targets` maps a job name to host:port addresses serving /metrics; `scrape_configs` are further jobs as
    Prometheus's configuration spells them; `rule_groups` a PrometheusRule's `spec.groups`."""

    def __init__(
        self,
        workdir: Path,
        targets: dict[str, list[str]],
        scrape_configs: Sequence[dict[str, Any]] = (),
        rule_groups: Sequence[dict[str, Any]] = (),
    ) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError(f"the prometheus binary is not on PATH; {INSTALL_HINT}")
        self._binary = binary
        self._workdir = workdir
        self._config_file = workdir / "prometheus.yml"
        config = _config(targets)
        config["scrape_configs"] += list(scrape_configs)
        if rule_groups:
            rules_file = workdir / "rules.yml"
            rules_file.write_text(json.dumps({"groups": list(rule_groups)}))
            config["rule_files"] = [str(rules_file)]
        self._config_file.write_text(json.dumps(config))  # JSON is YAML
        self._logfile = workdir / "prometheus.log"
        self._log = self._logfile.open("w")
        self._start()

    def _start(self) -> None:
        # Prometheus binds its port itself, so the number is chosen here and may be taken by another process
        # before it binds: wait_ready then starts it again on another port.
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log.flush()
        self._log_from = self._logfile.stat().st_size  # this start's output begins here
        self._proc = subprocess.Popen(
            [
                self._binary,
                f"--config.file={self._config_file}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                f"--storage.tsdb.path={self._workdir / 'data'}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        retries = 3
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = self._logfile.read_bytes()[self._log_from :].decode(errors="replace")
                if "address already in use" in log and retries > 0:
                    retries -= 1
                    self._log.write(f"--- port {self.port} was taken; starting again on another\n")
                    self._log.flush()
                    self._start()
                    continue
                raise RuntimeError(f"prometheus exited {self._proc.returncode}: {log[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # refused, reset, timed out (URLError is one)
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready within {timeout_s}s: {self._logfile.read_text()[-2000:]}")

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path>; returns `data`, raises with Prometheus's error for a bad query."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise ValueError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        return self.api("query", query=expr)["result"]

    def wait_for(self, expr: str, ok: Callable[[list[dict[str, Any]]], bool], timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if ok(result):
                return result
            time.sleep(0.5)
        raise AssertionError(f"{expr} never satisfied the condition in {timeout_s}s; last result {result}")

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        self._log.close()


def _config(targets: dict[str, list[str]]) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": addrs}]}
            for job, addrs in targets.items()
            if addrs
        ],
    }
