"""gateway: the OpenAI-compatible HTTP API (FastAPI on uvicorn) in front of the orchestrator's gRPC
API. It keeps no state of its own: each HTTP request becomes gRPC calls (docs/openai.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog
import uvicorn

from gateway.app import Settings, create_app
from gateway.upstream import Upstream
from moe_lightning.flags import EnvDefaultsParser
from moe_lightning.service.auth import is_loopback
from moe_lightning.service.logs import configure_logging


def build_parser() -> EnvDefaultsParser:
    p = EnvDefaultsParser(prog="moe-lightning-gateway", description=__doc__)
    p.add_argument("--address", default="127.0.0.1:8000", help="HTTP listen address, host:port (port 0: any free)")
    p.add_argument("--api", default="127.0.0.1:50051", help="the orchestrator's gRPC API address")
    p.add_argument("--api-tls-ca", type=Path, default=None, help="verify the API's TLS certificate against this CA")
    p.add_argument("--tls-cert", type=Path, default=None, help="serve HTTPS with this PEM certificate")
    p.add_argument("--tls-key", type=Path, default=None, help="the PEM private key of --tls-cert")
    p.add_argument(
        "--auth-token",
        default=None,
        help="require 'Authorization: Bearer <token>' on /v1/ (and send it to the API); set it by environment "
        "(MOE_LIGHTNING_AUTH_TOKEN), not on the command line, where ps shows it",
    )
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback --address without --auth-token")
    p.add_argument(
        "--served-model-name", default=None, help="the model id clients name (default: the model's directory name)"
    )
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for the API at start")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    p.add_argument("--log-json", action="store_true", help="JSON logs even on a terminal")
    return p


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"--address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


async def _serve(args: argparse.Namespace, host: str, port: int) -> None:
    log = structlog.get_logger()
    upstream = Upstream(args.api, args.api_tls_ca, args.auth_token)
    try:
        info = await upstream.model_info(args.start_timeout)
        name = args.served_model_name or Path(info.model_path).name or info.architecture
        settings = Settings(name, info.max_position_embeddings, args.auth_token, args.max_body_bytes)
        config = uvicorn.Config(
            create_app(settings, upstream),
            host=host,
            port=port,
            ssl_certfile=str(args.tls_cert) if args.tls_cert else None,
            ssl_keyfile=str(args.tls_key) if args.tls_key else None,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=10,
        )
        server = uvicorn.Server(config)
        log.info("serving", address=f"{host}:{port}", api=args.api, model=name, tls=bool(args.tls_cert))
        await server.serve()
    finally:
        await upstream.close()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when it is installed (as uvicorn itself picks it, and vLLM serves on it): the event
    loop's own cost is paid per streamed event (docs/openai.md "Overhead")."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = configure_logging("gateway", args.log_level, args.log_json or None)
    host, port = split_address(args.address)
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    if not is_loopback(host) and not args.auth_token and not args.insecure:
        log.error("startup_failed", error=f"{host} is beyond this machine and there is no --auth-token")
        return 1
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_serve(args, host, port))
    except Exception as exc:  # the API never answered, a port in use, a bad certificate
        log.error("startup_failed", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
