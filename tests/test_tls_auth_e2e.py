"""The public API behind TLS (a self-signed cert) and a bearer token; the internal services stay on
unix sockets. Health needs no token (probes carry no secrets); everything else does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from moe_lightning.client import GenerationClient, Prompt
from moe_lightning.launcher import Stack
from moe_lightning.service.names import GENERATION
from moe_lightning.service.upstream import health_status, open_channel

from reference import E2E_PROMPTS as PROMPTS

TOKEN = "s3cret-token"


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    req = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
    san = ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
    subprocess.run([*req, *san, "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate")
def test_tls_and_bearer_token(tmp_path: Path, reference: dict, make_stack: Callable[..., Stack]) -> None:
    cert, key = _self_signed(tmp_path)
    # no batch size: the launcher's default
    s = make_stack(kv_cache_memory="16MiB", max_batch_size=None, tls_cert=cert, tls_key=key, auth_token=TOKEN)
    addr = s.api_address
    assert all(a.startswith("unix://") for n, a in s.addresses.items() if n != "orchestrator")
    assert addr.startswith("127.0.0.1:")
    prompt = Prompt(token_ids=PROMPTS[0], max_new_tokens=14)
    with GenerationClient(addr, timeout=60, tls_ca=cert, token=TOKEN) as c:
        assert c.generate(prompt).token_ids == reference[0]
    for kwargs, code in [
        ({"tls_ca": cert}, grpc.StatusCode.UNAUTHENTICATED),  # no token
        ({"tls_ca": cert, "token": "wrong"}, grpc.StatusCode.UNAUTHENTICATED),
        ({"token": TOKEN}, grpc.StatusCode.UNAVAILABLE),  # plaintext to a TLS port: no handshake
    ]:
        with GenerationClient(addr, timeout=10, **kwargs) as c, pytest.raises(grpc.RpcError) as info:
            c.generate(prompt)
        assert info.value.code() == code, (kwargs, info.value)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            assert "authorization: Bearer" in info.value.details()
    # every kind of call is guarded, a server-streaming one too (issue 14)
    with GenerationClient(addr, timeout=10, tls_ca=cert) as c, pytest.raises(grpc.RpcError) as info:
        list(c.stream(prompt))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    with GenerationClient(addr, timeout=60, tls_ca=cert, token=TOKEN) as c:
        assert [t for m in c.stream(prompt) if hasattr(m, "finish_reason") for t in m.token_ids] == reference[0]
    ch = open_channel(addr, tls_ca=cert)
    assert health_status(ch, GENERATION) == 1  # no token needed
    ch.close()
    # the CLI takes the same two flags
    cli = [sys.executable, "-m", "moe_lightning.cli", "generate", "--addr", addr, "--tls-ca", str(cert)]
    r = subprocess.run(
        [*cli, "--prompt-ids", "1,5,9", "--max-new-tokens", "3", "--json"],
        env={**os.environ, "MOE_LIGHTNING_AUTH_TOKEN": TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    s.stop()
    assert s.leaked_segments() == []
