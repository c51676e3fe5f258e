"""Our servers accept the keepalive pings our clients send on idle connections (no GOAWAY "too_many_pings")."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenfleet.services.common import server
from tokenfleet.services.gateway.dispatch import WORKER_CHANNEL_OPTIONS

SCALE = 10  # the ping intervals a tenth of the real ones: 1 s client pings, 0.5 s server minimum
INTERVALS = ("grpc.keepalive_time_ms", "grpc.http2.min_ping_interval_without_data_ms")


def scaled(options):  # type: ignore[no-untyped-def]
    """The ack timeout stays as it is: a loaded machine must not fail the test by answering a ping late."""
    return [(key, value // SCALE if key in INTERVALS else value) for key, value in options]


def test_the_server_accepts_pings_as_often_as_clients_send_them():
    [client_ms] = [v for k, v in WORKER_CHANNEL_OPTIONS if k == "grpc.keepalive_time_ms"]
    [server_ms] = [v for k, v in server.SERVER_KEEPALIVE_OPTIONS
                   if k == "grpc.http2.min_ping_interval_without_data_ms"]
    assert server_ms < client_ms


def test_an_idle_connection_with_keepalive_pings_stays_up(monkeypatch):
    """gRPC's default server policy answers the third ping on a connection without calls with GOAWAY and drops
    it (the client then pings half as often). Seen on the H100 run's logs before the servers allowed them."""
    monkeypatch.setattr(server, "SERVER_KEEPALIVE_OPTIONS", scaled(server.SERVER_KEEPALIVE_OPTIONS))

    async def states() -> list[str]:
        srv = server.GrpcServer(["test"])
        await srv.start()
        channel = grpc.aio.insecure_channel(srv.address, options=scaled(WORKER_CHANNEL_OPTIONS))
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            seen = []
            for _ in range(10):  # 5 s idle: five pings; the default policy drops the connection at the third
                await asyncio.sleep(0.5)
                seen.append(channel.get_state(try_to_connect=False).name)
            return seen
        finally:
            await channel.close()
            await srv.server.stop(0)

    assert asyncio.run(states()) == ["READY"] * 10
