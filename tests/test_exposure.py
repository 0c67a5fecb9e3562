"""Issue 14, items 9 and 14: `up` takes TLS and token flags and refuses to serve beyond loopback
without a token; its readiness check speaks TLS; the client refuses to send a token in plaintext
beyond this machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from moe_lightning.cli import build_parser
from moe_lightning.client import GenerationClient, InsecureTokenError
from moe_lightning.commands.up import exposure_check
from moe_lightning.config.stack import StackConfig
from moe_lightning.launcher import free_port
from moe_lightning.service.upstream import health_status, readiness_channel


def _up_args(*argv: str) -> object:
    return build_parser().parse_args(["up", "--model", "/nonexistent", *argv])


def test_up_refuses_a_public_bind_without_a_token() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MOE_LIGHTNING_AUTH_TOKEN"}
    r = subprocess.run(
        [sys.executable, "-m", "moe_lightning.cli", "up", "--model", "/nonexistent", "--host", "0.0.0.0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "--auth-token" in r.stderr and "--insecure" in r.stderr and "MOE_LIGHTNING_AUTH_TOKEN" in r.stderr


def test_up_exposure_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_LIGHTNING_AUTH_TOKEN", raising=False)
    assert exposure_check(_up_args()) == (None, [])  # loopback: nothing to say
    error, _ = exposure_check(_up_args("--host", "0.0.0.0"))
    assert error is not None and "--insecure" in error
    error, warnings = exposure_check(_up_args("--host", "0.0.0.0", "--insecure"))
    assert error is None and any("without a token" in w for w in warnings)
    error, warnings = exposure_check(_up_args("--host", "0.0.0.0", "--auth-token", "t"))
    assert error is None and any("plaintext" in w for w in warnings)
    error, warnings = exposure_check(
        _up_args("--host", "0.0.0.0", "--auth-token", "t", "--tls-cert", "c", "--tls-key", "k")
    )
    assert (error, warnings) == (None, [])
    error, _ = exposure_check(_up_args("--tls-cert", "c"))
    assert error is not None and "go together" in error


def test_up_takes_tls_and_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set by environment, the orchestrator got TLS while `up` did not know (its readiness check
    then spoke plaintext to a TLS port); now `up` reads the same variables and passes them on."""
    monkeypatch.setenv("MOE_LIGHTNING_TLS_CERT", "/certs/api.pem")
    monkeypatch.setenv("MOE_LIGHTNING_TLS_KEY", "/certs/api.key")
    monkeypatch.setenv("MOE_LIGHTNING_AUTH_TOKEN", "tok")
    args = _up_args("--host", "0.0.0.0")
    config = StackConfig.for_command(args)
    assert (config.tls_cert, config.tls_key, config.auth_token) == (
        Path("/certs/api.pem"),
        Path("/certs/api.key"),
        "tok",
    )
    assert config.tls_ca is None  # the readiness check verifies against the cert itself
    assert exposure_check(args) == (None, [])


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate")
def test_readiness_check_over_tls_on_a_wildcard_bind(tmp_path: Path) -> None:
    """A cert for the public name (not 0.0.0.0, not 127.0.0.1): the launcher's own health check still
    verifies it."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    req = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=api.example.com"]
    san = ["-addext", "subjectAltName=DNS:api.example.com"]
    subprocess.run([*req, *san, "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    hs = health.HealthServicer()
    hs.set("svc", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_secure_port(
        f"0.0.0.0:{free_port()}", grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    )
    server.start()
    try:
        ch = readiness_channel(f"0.0.0.0:{port}", cert)
        assert health_status(ch, "svc", timeout=10) == health_pb2.HealthCheckResponse.SERVING
        ch.close()
        # compose's health check, in the orchestrator's container, with its TLS environment
        check = [sys.executable, "deploy/grpc_health_check.py", f"127.0.0.1:{port}", "svc"]
        env = {**os.environ, "MOE_LIGHTNING_TLS_CERT": str(cert)}
        assert subprocess.run(check, env=env, capture_output=True, timeout=30).returncode == 0
        plain = subprocess.run(check, capture_output=True, timeout=30, text=True)  # no TLS: no handshake
        assert plain.returncode == 1
    finally:
        server.stop(0)


def test_client_refuses_a_plaintext_token_beyond_this_machine() -> None:
    for address in ("10.1.2.3:50051", "api.example.com:443", "dns:///api.example.com:443"):
        with pytest.raises(InsecureTokenError, match="--tls-ca"):
            GenerationClient(address, token="tok")
        GenerationClient(address, token="tok", allow_insecure_token=True).close()  # said on purpose
        GenerationClient(address).close()  # no token: nothing to leak
    for address in ("127.0.0.1:50051", "localhost:50051", "[::1]:50051", "0.0.0.0:50051", "unix:///tmp/x.sock"):
        GenerationClient(address, token="tok").close()


def test_generate_cli_refuses_a_plaintext_token() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "moe_lightning.cli", "generate", "--addr", "10.1.2.3:50051", "--prompt-ids", "1"],
        env={**os.environ, "MOE_LIGHTNING_AUTH_TOKEN": "tok"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--allow-insecure-token" in r.stderr, r.stderr
