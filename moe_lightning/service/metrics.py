"""Prometheus series that several services export under the same name, defined once.

Each service runs in its own process, so its /metrics shows only what it touches; defining the
shared names here keeps them identical and lets one process import every service (tests).
"""

from prometheus_client import Counter, Gauge

STAGE_BUSY = Counter("moe_lightning_stage_busy_seconds_total", "Seconds spent computing, per stage", ["stage"])
SHM_WAIT = Counter("moe_lightning_shm_wait_seconds_total", "Seconds spent waiting on shared-memory channels")
HANDOFFS = Counter("moe_lightning_handoffs_total", "Shared-memory messages handled", ["direction"])
KV_USAGE = Gauge("moe_lightning_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (or reserved)")
HANDOFF_LATENCY = Counter(
    "moe_lightning_handoff_latency_seconds_total",
    "Sum of send-to-receive times of shared-memory messages received (divide by moe_lightning_handoffs_total)",
    ["direction"],
)
HANDOFF_WORK = Counter(
    "moe_lightning_handoff_work_seconds_total",
    "Time spent inside send()/recv() of shared-memory messages, waiting excluded (copies, header, post)",
    ["direction"],
)
# What the process's own gRPC health says of its service: 1 SERVING, 0 NOT_SERVING (starting, a peer
# down, shutting down). Prometheus' `up` only says the metrics port answers.
SERVING = Gauge("moe_lightning_serving", "1 while the service's gRPC health is SERVING, else 0")
# grpc-prometheus's grpc_server_handled_total, ours: every call but health and reflection, as answered
RPC_HANDLED = Counter(
    "moe_lightning_rpc_handled_total", "gRPC calls answered, by method and status code", ["method", "code"]
)


def count_rpc(method: str, code: str) -> None:
    """One answered call of `method` (the full gRPC path; health and reflection probes are not counted)."""
    if not method.startswith(("/grpc.health.v1.", "/grpc.reflection.")):
        RPC_HANDLED.labels(method.rsplit("/", 1)[-1], code).inc()
