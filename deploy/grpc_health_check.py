#!/usr/bin/env python3
"""Exit 0 when ADDRESS reports SERVICE as SERVING over grpc.health.v1, else 1 (compose healthcheck).

With MOE_LIGHTNING_TLS_CERT set (the orchestrator's TLS, from its environment) a TCP address is
checked over TLS, verified against MOE_LIGHTNING_TLS_CA or else the certificate itself, as `up`'s
own readiness check does.
"""

import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    if len(sys.argv) != 3:
        sys.stderr.write("usage: grpc-health-check ADDRESS SERVICE\n")
        return 2
    address, service = sys.argv[1:]
    cert = os.environ.get("MOE_LIGHTNING_TLS_CERT")
    try:
        if cert and not address.startswith("unix:"):
            from moe_lightning.service.upstream import readiness_channel

            ca = os.environ.get("MOE_LIGHTNING_TLS_CA")
            channel = readiness_channel(address, Path(cert), Path(ca) if ca else None)
        else:
            channel = grpc.insecure_channel(address)
        with channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
    except grpc.RpcError as exc:
        sys.stderr.write(f"{address}: {exc.code().name}\n")
        return 1
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
