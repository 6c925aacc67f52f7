"""NATS credentials and TLS reach every service through the environment (KUBESGL_NATS_*, credentials also as
files named by KUBESGL_NATS_*_FILE), against a real nats-server with auth / TLS / mutual TLS on; wrong or missing
credentials never connect."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import trustme
from kubesgl.runtime.nats_conn import NatsSettings, close, connect
from kubesgl.runtime.nats_server import NatsServer


async def _round_trip(settings: NatsSettings) -> None:
    nc = await asyncio.wait_for(connect(settings, "security-test"), 10)
    try:
        sub = await nc.subscribe("kubesgl.test.echo")
        await nc.publish("kubesgl.test.echo", b"hi")
        assert (await sub.next_msg(timeout=5)).data == b"hi"
    finally:
        await close(nc)


async def _never_connects(settings: NatsSettings) -> None:
    # connect() retries forever by design (a service waits for NATS); refused credentials keep it waiting.
    # Quiet window: a connect that is let in succeeds on loopback well inside 1.5 s.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(connect(settings, "security-test"), 1.5)


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> NatsServer:
    s = NatsServer(tmp_path / "nats", args=request.param)
    s.start()
    yield s
    s.stop()


@pytest.mark.parametrize("server", [("--user", "kube", "--pass", "s3cret")], indirect=True)
async def test_user_and_password_come_from_the_environment(server: NatsServer) -> None:
    env = {"KUBESGL_NATS_USER": "kube", "KUBESGL_NATS_PASSWORD": "s3cret"}
    await _round_trip(NatsSettings.from_env(server.url, env))
    await asyncio.gather(  # two quiet windows at once
        _never_connects(NatsSettings.from_env(server.url, {**env, "KUBESGL_NATS_PASSWORD": "wrong"})),
        _never_connects(NatsSettings.from_env(server.url, {})),
    )


@pytest.mark.parametrize("server", [("--auth", "t0ken")], indirect=True)
async def test_token_comes_from_the_environment(server: NatsServer) -> None:
    await _round_trip(NatsSettings.from_env(server.url, {"KUBESGL_NATS_TOKEN": "t0ken"}))
    await _never_connects(NatsSettings.from_env(server.url, {"KUBESGL_NATS_TOKEN": "nope"}))


@pytest.mark.parametrize("server", [("--auth", "t0ken")], indirect=True)
async def test_token_comes_from_a_mounted_file(server: NatsServer, tmp_path: Path) -> None:
    """The chart mounts the Secret and names the file (KUBESGL_NATS_TOKEN_FILE): no credential in the
    environment. A Secret written with a trailing newline still matches."""
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    await _round_trip(NatsSettings.from_env(server.url, {"KUBESGL_NATS_TOKEN_FILE": str(token)}))
    token.write_text("nope")
    await _never_connects(NatsSettings.from_env(server.url, {"KUBESGL_NATS_TOKEN_FILE": str(token)}))


def test_credential_files_for_user_and_password_and_never_two_sources(tmp_path: Path) -> None:
    (tmp_path / "user").write_text("kube")
    (tmp_path / "password").write_text("s3cret")
    files = {
        "KUBESGL_NATS_USER_FILE": str(tmp_path / "user"),
        "KUBESGL_NATS_PASSWORD_FILE": str(tmp_path / "password"),
    }
    settings = NatsSettings.from_env(None, files)
    assert (settings.user, settings.password, settings.token) == ("kube", "s3cret", None)
    with pytest.raises(ValueError, match="KUBESGL_NATS_PASSWORD and KUBESGL_NATS_PASSWORD_FILE are both set"):
        NatsSettings.from_env(None, {**files, "KUBESGL_NATS_PASSWORD": "other"})


def _pki(tmp_path: Path) -> dict[str, str]:
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    client_cert = ca.issue_cert("kubesgl-service")
    files = {
        "ca": tmp_path / "ca.pem",
        "server": tmp_path / "server.pem",
        "server_key": tmp_path / "server.key",
        "client": tmp_path / "client.pem",
        "client_key": tmp_path / "client.key",
    }
    ca.cert_pem.write_to_path(str(files["ca"]))
    server_cert.cert_chain_pems[0].write_to_path(str(files["server"]))
    server_cert.private_key_pem.write_to_path(str(files["server_key"]))
    client_cert.cert_chain_pems[0].write_to_path(str(files["client"]))
    client_cert.private_key_pem.write_to_path(str(files["client_key"]))
    return {k: str(v) for k, v in files.items()}


async def test_tls_and_mutual_tls_come_from_the_environment(tmp_path: Path) -> None:
    pki = _pki(tmp_path)
    tls = ("--tls", "--tlscert", pki["server"], "--tlskey", pki["server_key"])
    mutual = (*tls, "--tlsverify", "--tlscacert", pki["ca"])
    client_env = {
        "KUBESGL_NATS_TLS_CA": pki["ca"],
        "KUBESGL_NATS_TLS_CERT": pki["client"],
        "KUBESGL_NATS_TLS_KEY": pki["client_key"],
    }
    server = NatsServer(tmp_path / "tls", args=tls)
    server.start()
    try:
        assert server.url.startswith("tls://")
        await _round_trip(NatsSettings.from_env(server.url, {"KUBESGL_NATS_TLS_CA": pki["ca"]}))
        await _never_connects(NatsSettings.from_env(server.url, {}))  # the server's CA is not trusted
    finally:
        server.stop()
    server = NatsServer(tmp_path / "mtls", args=mutual)
    server.start()
    try:
        await _round_trip(NatsSettings.from_env(server.url, client_env))
        await _never_connects(NatsSettings.from_env(server.url, {"KUBESGL_NATS_TLS_CA": pki["ca"]}))
    finally:
        server.stop()


def test_settings_read_comma_separated_urls_and_default() -> None:
    assert NatsSettings.from_env(None, {}).urls == ("nats://127.0.0.1:4222",)
    env = {"KUBESGL_NATS_URL": "nats://a:4222, nats://b:4222"}
    assert NatsSettings.from_env(None, env).urls == ("nats://a:4222", "nats://b:4222")
    assert NatsSettings.from_env("nats://c:1", env).urls == ("nats://c:1",)
