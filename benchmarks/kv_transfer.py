"""KV transfer on loopback, and where disaggregation starts to pay: a prefill worker pinned to
core 0 and a decode worker pinned to core 1 (one torch thread each, no other load).

For each prompt length (fresh random token ids, so no prefix cache helps):
- transfer: a client calls the prefill worker's Prefill directly and times the stream from the
  first message (first token; the compute is done) to the trailer: ms per prompt and MB/s of K+V;
- local: Generate on the decode worker with no prefill replica (it prefills itself), max_tokens 2;
- remote: the same Generate naming the prefill worker (decode pulls first token + KV, installs,
  decodes one more token).
Local vs remote "time to the second token" shows the fixed cost of the remote path; the decode
worker's own compute per prompt (local prefill time) is what disaggregation takes off it.

    .venv/bin/python benchmarks/kv_transfer.py [--lengths 32 64 128 256 512 1000 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from serving.procs import Children

REPO = Path(__file__).resolve().parent.parent


def start(children: Children, name: str, role: str, core: int, model_dir: str, dtype: str):
    """A worker registered in etcd as ``name`` (a decode worker takes KV only from registered prefill replicas)."""
    return children.spawn_service(
        name, "tokenfleet.services.decode", "--role", role, "--model", model_dir, "--threads", "1", "--dtype", dtype,
        "--num-blocks", "1024", "--etcd", children.etcd.endpoint, "--replica-id", name, threads=1, cores=str(core))


def generate(stub, prompt: list[int], request_id: str, prefill: str = "") -> tuple[float, float]:
    """(time to first token, time to second token) in ms, as the caller of the decode worker sees them."""
    from tokenfleet.v1 import common_pb2, engine_pb2

    msg = engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(
        temperature=0.0, max_tokens=2, ignore_eos=True))
    if prefill:
        msg.prefill.address = prefill
        msg.prefill.replica_id = "prefill"
    start = time.perf_counter()
    times = []
    for response in stub.Generate(msg):
        if response.HasField("chunk") and response.chunk.token_ids:
            times += [time.perf_counter()] * len(response.chunk.token_ids)
    return 1000 * (times[0] - start), 1000 * (times[1] - start)


def transfer(stub, prompt: list[int], request_id: str, layout) -> tuple[float, int]:
    """(ms from the first token to the trailer, K+V bytes)."""
    from tokenfleet.v1 import common_pb2, engine_pb2

    first = None
    nbytes = 0
    for response in stub.Prefill(engine_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, layout=layout,
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=1))):
        if response.HasField("started"):
            first = time.perf_counter()
        elif response.HasField("done"):
            nbytes = response.done.num_bytes
    assert first is not None
    return 1000 * (time.perf_counter() - first), nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1000, 2000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "reports" / "kv-transfer.json"))
    args = parser.parse_args()

    from tokenfleet.models.gguf_import import ensure_default_model
    from tokenfleet.v1 import engine_pb2, engine_pb2_grpc

    model_dir = str(Path(ensure_default_model()).resolve())
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rng = random.Random(11)
    children = Children()
    rows = []
    try:
        children.start_etcd()
        prefill = start(children, "prefill", "prefill", 0, model_dir, args.dtype)
        decode = start(children, "decode", "decode", min(1, (os.cpu_count() or 1) - 1), model_dir, args.dtype)
        options = [("grpc.max_receive_message_length", 16 << 20)]
        # The prefill replica is read as another worker pulling KV (Prefill), and as the router (Load).
        p_stub = engine_pb2_grpc.EngineServiceStub(children.plane("worker").sync_channel(prefill.address, "worker",
                                                                                           options))
        d_stub = engine_pb2_grpc.EngineServiceStub(children.plane("gateway").sync_channel(decode.address, "worker",
                                                                                            options))
        router = engine_pb2_grpc.EngineServiceStub(children.plane("router").sync_channel(prefill.address, "worker"))
        report = next(iter(router.Load(engine_pb2.LoadRequest(interval_ms=50))))
        layout = report.layout
        n = 0

        def fresh(length: int) -> list[int]:
            return [rng.randrange(200, vocab) for _ in range(length)]

        for _ in range(2):  # warm-up both paths
            generate(d_stub, fresh(64), f"warm-{(n := n + 1)}")
            generate(d_stub, fresh(64), f"warm-{(n := n + 1)}", prefill.address)
        for length in args.lengths:
            xfer, mbps, local1, local2, remote1, remote2 = [], [], [], [], [], []
            for _ in range(args.repeats):
                ms, nbytes = transfer(p_stub, fresh(length), f"x-{(n := n + 1)}", layout)
                xfer.append(ms)
                mbps.append(nbytes / 1e6 / (ms / 1000))
                a, b = generate(d_stub, fresh(length), f"l-{(n := n + 1)}")
                local1.append(a)
                local2.append(b)
                a, b = generate(d_stub, fresh(length), f"r-{(n := n + 1)}", prefill.address)
                remote1.append(a)
                remote2.append(b)
            row = {"prompt_tokens": length, "kv_mb": nbytes / 1e6,
                   "transfer_ms": statistics.median(xfer), "transfer_mb_s": statistics.median(mbps),
                   "local_ttft_ms": statistics.median(local1), "local_t2_ms": statistics.median(local2),
                   "remote_ttft_ms": statistics.median(remote1), "remote_t2_ms": statistics.median(remote2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        children.stop_all()
        children.remove_logs()
    result = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "rows": rows,
              "setup": "prefill worker on core 0, decode worker on core 1 (taskset), 1 torch thread each, loopback"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    lines = ["| prompt tokens | KV MB | transfer ms | MB/s | local TTFT | local 2nd token | remote TTFT | remote 2nd token |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt_tokens']} | {r['kv_mb']:.1f} | {r['transfer_ms']:.1f} | {r['transfer_mb_s']:.0f} | "
                     f"{r['local_ttft_ms']:.0f} | {r['local_t2_ms']:.0f} | {r['remote_ttft_ms']:.0f} | "
                     f"{r['remote_t2_ms']:.0f} |")
    table = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(f"# KV transfer on loopback\n\n{result['started']}; {result['setup']}; "
                                      f"medians of {args.repeats}.\n\n{table}")
    print(table)


if __name__ == "__main__":
    main()
