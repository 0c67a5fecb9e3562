#!/usr/bin/env python3
"""Exit 0 when ADDRESS reports SERVICE as SERVING over grpc.health.v1, else 1 (compose healthcheck)."""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    if len(sys.argv) != 3:
        sys.stderr.write("usage: grpc-health-check ADDRESS SERVICE\n")
        return 2
    address, service = sys.argv[1:]
    try:
        with grpc.insecure_channel(address) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=3)
    except grpc.RpcError as exc:
        sys.stderr.write(f"{address}: {exc.code().name}\n")
        return 1
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
