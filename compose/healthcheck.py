"""Container healthcheck for the compose cluster: exits 0 when the service answers, 1 otherwise.

    python healthcheck.py grpc HOST:PORT   the gRPC health service reports the server ("") SERVING
    python healthcheck.py http URL         the URL answers with a 2xx status
"""

from __future__ import annotations

import sys
import urllib.request

TIMEOUT_S = 3.0


def grpc_serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # 4xx/5xx raise HTTPError
        return 200 <= response.status < 300


def main(argv: list[str]) -> int:
    checks = {"grpc": grpc_serving, "http": http_ok}
    if len(argv) != 2 or argv[0] not in checks:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        healthy = checks[argv[0]](argv[1])
    except Exception as e:  # unreachable, refused, timed out, not serving: all mean unhealthy
        print(f"unhealthy: {argv[1]}: {e}", file=sys.stderr)
        return 1
    return 0 if healthy else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
