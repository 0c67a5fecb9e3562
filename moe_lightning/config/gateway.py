"""The HTTP gateway's config: where it listens, the API it fronts, and what one request may cost
(docs/reliability.md, "What one request may cost")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moe_lightning.config import flags
from moe_lightning.config.flag import CliConfig, Flag, option
from moe_lightning.config.orchestrator import DEFAULT_ADDRESS as API_ADDRESS
from moe_lightning.config.units import positive

DEFAULT_ADDRESS = "127.0.0.1:8000"
OPEN_PER_SERVED = 4  # open connections per request --max-connections serves

API = Flag("--api", "the orchestrator's gRPC API address")
API_TLS_CA = Flag("--api-tls-ca", "verify the API's TLS certificate against this CA", type=Path)
SERVED_MODEL_NAME = Flag("--served-model-name", "the model id clients name (default: the model's directory name)")
MAX_BODY_BYTES = Flag("--max-body-bytes", "larger request bodies get 413 (chunked ones too)", type=positive(int))
BODY_TIMEOUT = Flag("--body-timeout", "seconds for a request's whole body to arrive; then 408", type=positive(float))
HEADER_TIMEOUT = Flag(
    "--header-timeout",
    "seconds for a request's line and headers to arrive (from the connection's start or the request's first "
    "byte); then 408 and the connection closed",
    type=positive(float),
)
MAX_HEADER_BYTES = Flag("--max-header-bytes", "a longer request line + headers gets 431", type=positive(int))
MAX_CONNECTIONS = Flag(
    "--max-connections",
    "requests served at once (a request beyond them gets 503); connections open, idle or sending their headers, "
    f"at most {OPEN_PER_SERVED} times as many (a new one beyond is closed at once)",
    type=positive(int),
)
START_TIMEOUT = Flag("--start-timeout", "seconds to wait for the API at start", type=float)


@dataclass(kw_only=True)
class GatewayConfig(CliConfig):
    address: str = option(flags.ADDRESS, DEFAULT_ADDRESS)
    api: str = option(API, API_ADDRESS)
    api_tls_ca: Path | None = option(API_TLS_CA)
    tls_cert: Path | None = option(flags.TLS_CERT)
    tls_key: Path | None = option(flags.TLS_KEY)
    auth_token: str | None = option(flags.AUTH_TOKEN)
    insecure: bool = option(flags.INSECURE, False)
    served_model_name: str | None = option(SERVED_MODEL_NAME)
    max_body_bytes: int = option(MAX_BODY_BYTES, 8 << 20)
    body_timeout: float = option(BODY_TIMEOUT, 60.0)
    header_timeout: float = option(HEADER_TIMEOUT, 10.0)
    max_header_bytes: int = option(MAX_HEADER_BYTES, 64 << 10)
    max_connections: int = option(MAX_CONNECTIONS, 1024)
    start_timeout: float = option(START_TIMEOUT, 600.0)
    log_level: str = option(flags.LOG_LEVEL, "info")
    log_json: bool = option(flags.LOG_JSON, False)
