"""``tokenfleet simulate calibrate``: measure our engine as it serves on this machine, and fit a cost profile.

A private local cluster (etcd, registry, one worker with the serving defaults and ``--threads``,
router, gateway: what ``tokenfleet up`` and ``benchmarks/serve.py`` run) is driven through the
gateway's streaming ``/v1/completions`` with probes whose steps the scheduler makes predictable:

- prefill probes: one prompt of L tokens with ``max_tokens=1`` on an idle cluster is one step of
  shape (L tokens, one sample, L(L+1)/2 attention pairs); its time to first token minus the request's
  fixed overhead (gateway, router, RPCs; fitted as its own intercept) is that step's time;
- decode probes: B prompts of C tokens sent together, 48 tokens each; past the first tokens every
  step decodes the B requests at a context near C + 32, so the median gap between a request's
  tokens is that step's time.

``costs.fit_profile`` fits the linear cost model to the medians over ``repeats``. Measuring through
the serving path rather than the bare engine core matters on a 2-core machine: the worker's own
threads, the gateway, etcd and the client take CPU from the model's OpenMP threads (the bare core
runs ~30 % faster). The simulator run with the profile and a ``ClosedLoop`` source
(``planning.predict.predict_serve``) predicts ``benchmarks/serve.py`` (``benchmarks/sim_calibration.py``
checks it against a real run).
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tokenfleet.planning.costs import Profile, StepShape, fit_profile

PREFILL_LENGTHS = (32, 128, 256, 512, 1024, 2000)
DECODE_SHAPES = ((1, 128), (2, 128), (4, 128), (8, 256), (16, 256), (32, 256), (8, 1024), (32, 512), (64, 256))
DECODE_TOKENS = 48


def _stream(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(send time, arrival time of each streamed chunk) of one completion."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    sent, times = time.perf_counter(), []
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]" and json.loads(line[5:]).get("choices"):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("a probe streamed no tokens")
    return sent, times


def probe(url: str, model: str, vocab: int, repeats: int, log: Callable[[str], None]) -> tuple[list, list, list]:
    """Shapes, seconds (the median over ``repeats``) and whether each is a time to first token (it then
    includes the request's fixed overhead)."""
    rng = random.Random(20261123)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(200, vocab) for _ in range(n)]

    def prefill(length: int) -> float:
        sent, times = _stream(url, model, prompt(length), 1)
        return times[0] - sent

    def decode(batch: int, context: int) -> float:
        prompts = [prompt(context) for _ in range(batch)]
        with ThreadPoolExecutor(batch) as pool:
            runs = list(pool.map(lambda p: _stream(url, model, p, DECODE_TOKENS), prompts))
        return statistics.median(b - a for _, times in runs for a, b in zip(times[8:], times[9:], strict=False))

    for length in PREFILL_LENGTHS:  # warm-up: first calls at each size allocate
        prefill(length)
    decode(8, 128)
    measured: dict[tuple[str, int, int], list[float]] = {}
    for r in range(repeats):
        for length in PREFILL_LENGTHS:
            measured.setdefault(("prefill", 1, length), []).append(prefill(length))
        for batch, context in DECODE_SHAPES:
            measured.setdefault(("decode", batch, context), []).append(decode(batch, context))
        log(f"round {r + 1}/{repeats}: {len(measured)} probes")
    shapes, seconds, is_ttft = [], [], []
    for (kind, batch, length), values in measured.items():
        if kind == "prefill":
            shapes.append(StepShape(length, 1, 1, length * (length + 1) // 2, length))
        else:
            kv = batch * (length + DECODE_TOKENS // 2 + 8)  # the context at the middle of the measured gaps
            shapes.append(StepShape(batch, batch, batch, kv, kv))
        seconds.append(statistics.median(values))
        is_ttft.append(kind == "prefill")
    return shapes, seconds, is_ttft


def calibrate(model: str | None = None, threads: int = 2, repeats: int = 3,
              log: Callable[[str], None] = print) -> Profile:
    from pathlib import Path

    from tokenfleet.cli.launcher import up
    from tokenfleet.engine.config import EngineConfig
    from tokenfleet.models.config import ModelConfig
    from tokenfleet.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model

    folder = str(model or ensure_default_model())
    name = DEFAULT_MODEL_NAME if model is None else Path(folder).name
    vocab = int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])
    cluster = up(1, folder, name, threads, 0, record=False)
    try:
        shapes, seconds, is_ttft = probe(cluster.gateway_url, name, vocab, repeats, log)
    finally:
        cluster.stop()
    import torch

    from tokenfleet.models.loader import parse_dtype, resolve_dtype

    config = EngineConfig(model=folder)  # the worker's defaults (services/decode)
    dtype = resolve_dtype(config.dtype, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    model_config = ModelConfig.from_dir(folder)
    kv_bytes = model_config.kv_bytes_per_token * parse_dtype(dtype).itemsize  # what the worker's cache holds a token in
    engine = {"block_size": config.block_size, "max_num_batched_tokens": config.max_num_batched_tokens,
              "max_num_running": config.max_num_running, "num_blocks": config.num_kv_blocks(kv_bytes),
              "kv_bytes_per_token": kv_bytes, "threads": threads, "model": folder, "dtype": dtype}
    return fit_profile(shapes, seconds, engine, extra=[float(t) for t in is_ttft])
