"""The autoscaler's drivers and its service loop.

The Kubernetes driver runs the official `kubernetes` client against a test double: a local HTTP server that
implements a Deployment's and a StatefulSet's `/scale` subresource the way the API documents it (GET returns an
autoscaling/v1 Scale, PATCH merges `spec.replicas`). It has not run against a real cluster."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tokenfleet.cluster.autoscale import Autoscaler, ScalePolicy
from tokenfleet.cluster.autoscale_service import (
    AutoscaleService,
    ComposeDriver,
    KubernetesDriver,
    LocalDriver,
    PoolReplica,
    pool_of,
)
from tokenfleet.routing.policies import ReplicaLoad


class ScaleDouble(BaseHTTPRequestHandler):
    """/apis/apps/v1/namespaces/{ns}/{deployments|statefulsets}/{name}/scale"""

    state: dict = {}
    seen: list = []

    def _target(self):
        parts = self.path.split("?")[0].strip("/").split("/")
        if len(parts) != 8 or parts[:3] != ["apis", "apps", "v1"] or parts[3] != "namespaces" or parts[7] != "scale" \
                or parts[5] not in ("deployments", "statefulsets"):
            return None
        return parts[4], parts[5], parts[6]

    def _reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _scale(self, target):
        ns, _, name = target
        n = self.state[target]
        return {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name, "namespace": ns},
                "spec": {"replicas": n}, "status": {"replicas": n}}

    def do_GET(self):  # noqa: N802
        target = self._target()
        if target not in self.state:
            return self._reply(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
        self._reply(200, self._scale(target))

    def do_PATCH(self):  # noqa: N802
        target = self._target()
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.seen.append((self.command, self.path, self.headers["content-type"], body))
        if target not in self.state:
            return self._reply(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
        if isinstance(body, list):  # a JSON patch
            for op in body:
                if op.get("path") == "/spec/replicas" and op.get("op") in ("replace", "add"):
                    self.state[target] = int(op["value"])
        else:  # merge or strategic merge patch
            self.state[target] = int(body["spec"]["replicas"])
        self._reply(200, self._scale(target))

    def log_message(self, *args):
        pass


@pytest.fixture
def k8s_api():
    from kubernetes import client

    ScaleDouble.state = {("tf", "deployments", "decode"): 1, ("tf", "statefulsets", "prefill"): 2}
    ScaleDouble.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScaleDouble)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = client.Configuration(host=f"http://127.0.0.1:{server.server_port}")
    yield client.AppsV1Api(client.ApiClient(config))
    server.shutdown()


def test_the_kubernetes_driver_patches_the_scale_subresource(k8s_api):
    driver = KubernetesDriver({"m/decode": ("Deployment", "decode"), "m/prefill": ("StatefulSet", "prefill")}, "tf",
                              api=k8s_api)
    assert driver.replicas("m/decode") == 1 and driver.replicas("m/prefill") == 2
    asyncio.run(driver.scale("m/decode", 3, []))
    asyncio.run(driver.scale("m/prefill", 1, []))
    asyncio.run(driver.scale("m/unknown", 5, []))  # no workload: logged, nothing sent
    assert ScaleDouble.state == {("tf", "deployments", "decode"): 3, ("tf", "statefulsets", "prefill"): 1}
    assert driver.replicas("m/decode") == 3
    assert [(m, p.split("?")[0]) for m, p, _, _ in ScaleDouble.seen] == [
        ("PATCH", "/apis/apps/v1/namespaces/tf/deployments/decode/scale"),
        ("PATCH", "/apis/apps/v1/namespaces/tf/statefulsets/prefill/scale")]
    assert all("patch" in ctype for _, _, ctype, _ in ScaleDouble.seen)


def test_the_compose_driver_scales_one_service():
    driver = ComposeDriver("compose/docker-compose.yml", {"m/decode": "decode"}, project="tf")
    assert driver.command("m/decode", 3) == ["docker", "compose", "-f", "compose/docker-compose.yml", "-p", "tf", "up",
                                             "-d", "--no-recreate", "--scale", "decode=3", "decode"]


class FakeEtcd:
    def __init__(self):
        self.data: dict[str, bytes] = {}

    async def get(self, key):
        return self.data.get(key)

    async def put(self, key, value, lease_id=None):
        self.data[key] = value


class Replica:
    def __init__(self, rid, running, waiting=0, state="serving"):
        self.model = "m"
        self.load = ReplicaLoad(rid, f"h:{rid}", ("decode", "prefill"), state, waiting, running, 10, 90)


class FakeFleet:
    def __init__(self, replicas):
        self.replicas = {r.load.replica_id: r for r in replicas}


class RecordingDriver:
    def __init__(self):
        self.calls = []

    def starting(self, pool):
        return 0

    async def scale(self, pool, desired, serving):
        self.calls.append((pool, desired, sorted(r.replica_id for r in serving)))


def test_the_service_decides_per_pool_records_and_obeys_operator_controls():
    assert pool_of("m", ("decode", "prefill")) == "m/both" and pool_of("m", ("prefill",)) == "m/prefill"
    etcd, driver = FakeEtcd(), RecordingDriver()
    fleet = FakeFleet([Replica("w0", running=7, waiting=2), Replica("w1", running=0, state="draining")])
    service = AutoscaleService(etcd, fleet, Autoscaler(default=ScalePolicy(target_concurrency=4, max_replicas=3)),
                               driver, pools=("m/both",))

    async def tick():
        decisions = await service.tick()
        await asyncio.sleep(0)  # let the driver's task run
        return decisions

    (d,) = asyncio.run(tick())
    assert (d.current, d.desired) == (1, 2)  # the draining replica does not count
    assert driver.calls == [("m/both", 2, ["w0"])]
    recorded = json.loads(etcd.data["autoscale/decisions/m/both"])
    assert recorded["desired"] == 2 and recorded["reasons"]
    etcd.data["autoscale/control/m/both"] = json.dumps({"paused": True}).encode()
    (d,) = asyncio.run(tick())
    assert d.desired == d.current and d.reasons == ("paused by an operator",)
    etcd.data["autoscale/control/m/both"] = json.dumps({"replicas": 3}).encode()
    (d,) = asyncio.run(tick())
    assert d.desired == 2 and any("override" in r for r in d.reasons)  # one step toward 3
    assert [PoolReplica("w0", "h:w0", 7, 2, kv_usage=0.1)] == service.pool_replicas()["m/both"]


class SpawningCluster:
    """The launcher's Cluster as LocalDriver uses it; each spawn runs a real ``sleep`` (SIGUSR1 ends it, which
    shows which process the driver signalled)."""

    def __init__(self):
        self.processes = [("worker-0", subprocess.Popen(["sleep", "60"]))]
        self.specs = {"worker-0": (("tokenfleet.services.decode", "--replica-id", "worker-0", "--port", "7000"), 1)}

    def spawn(self, name, *args, threads=1):
        self.specs[name] = (args, threads)
        self.processes.append((name, subprocess.Popen(["sleep", "60"])))
        return f"127.0.0.1:{7000 + len(self.processes)}"

    def retire(self, name):
        proc = next((p for n, p in self.processes if n == name), None)
        self.processes = [(n, p) for n, p in self.processes if n != name]
        return proc

    def close(self):
        for _, p in self.processes:
            p.kill()
            p.wait()


def test_the_local_driver_keeps_a_warm_pool_and_activates_it_on_scale_up():
    cluster = SpawningCluster()
    seen: set[str] = set()
    drained: list[str] = []

    async def drain(address):
        drained.append(address)

    driver = LocalDriver(cluster, "worker-0", drain, warm_pool=1, max_replicas=2, visible=seen.__contains__)

    async def scenario():
        await driver.fill()
        assert driver.standby == ["worker-1"]
        args = cluster.specs["worker-1"][0]
        assert "--standby" in args and args[args.index("--replica-id") + 1] == "worker-1" and "--port" not in args
        await driver.fill()  # full: nothing more
        assert [n for n, _ in cluster.processes] == ["worker-0", "worker-1"]
        standby = cluster.processes[1][1]
        seen.add("worker-1")  # the fleet sees it once it registers
        await driver.scale("m/both", 2, [PoolReplica("worker-0", "a0", 3, 2)])
        assert standby.wait(timeout=10) == -signal.SIGUSR1  # activated by signal, not a cold start
        assert driver.standby == [] and "--standby" not in cluster.specs["worker-1"][0]  # a restart serves at once
        await asyncio.sleep(0.05)  # the refill after a change: no room at max_replicas 2
        assert [n for n, _ in cluster.processes] == ["worker-0", "worker-1"]
        # scale down: the least loaded worker other than the template is drained and stopped; the pool refills
        await driver.scale("m/both", 1, [PoolReplica("worker-0", "a0", 3, 0), PoolReplica("worker-1", "a1", 0, 0)])
        assert drained == ["a1"]
        for _ in range(100):
            await asyncio.sleep(0.01)
            if driver.standby:
                break
        assert driver.standby == ["worker-2"] and [n for n, _ in cluster.processes] == ["worker-0", "worker-2"]
        # no standby left: a scale-up starts a worker cold
        driver.warm_pool = 0
        driver.standby.clear()
        await driver.scale("m/both", 2, [PoolReplica("worker-0", "a0", 3, 2)])
        assert cluster.processes[-1][0] == "worker-3" and "--standby" not in cluster.specs["worker-3"][0]

    try:
        asyncio.run(scenario())
    finally:
        cluster.close()
