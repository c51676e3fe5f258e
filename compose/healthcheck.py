"""Container healthcheck for the compose cluster: exits 0 when the service answers, 1 otherwise.

    python healthcheck.py grpcs ROLE HOST:PORT   the same over mutual TLS (the internal plane's default): the
                                                  operator certificate from $TOKENFLEET_CERTS, the server must be ROLE's
    python healthcheck.py grpc HOST:PORT         the gRPC health service reports the server ("") SERVING (plaintext)
    python healthcheck.py http URL               the URL answers with a 2xx status
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

TIMEOUT_S = 3.0


def grpc_serving(address: str, role: str | None = None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if role is None:
        channel = grpc.insecure_channel(address)
    else:
        folder = Path(os.environ.get("TOKENFLEET_CERTS", "/certs"))
        credentials = grpc.ssl_channel_credentials((folder / "ca.pem").read_bytes(), (folder / "operator.key").read_bytes(),
                                                   (folder / "operator.pem").read_bytes())
        channel = grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override",
                                                                      f"{role}.tokenfleet")])
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # 4xx/5xx raise HTTPError
        return 200 <= response.status < 300


def main(argv: list[str]) -> int:
    arity = {"grpc": 2, "grpcs": 3, "http": 2}
    if not argv or arity.get(argv[0]) != len(argv):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        if argv[0] == "grpcs":
            healthy = grpc_serving(argv[2], role=argv[1])
        else:
            healthy = grpc_serving(argv[1]) if argv[0] == "grpc" else http_ok(argv[1])
    except Exception as e:  # unreachable, refused, timed out, not serving: all mean unhealthy
        print(f"unhealthy: {argv[1]}: {e}", file=sys.stderr)
        return 1
    return 0 if healthy else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
