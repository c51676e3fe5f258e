"""The GPU step benchmark's measurements (benchmarks/gpu_step.py): the card (HBM bandwidth, bf16 matmul peak), a
step's roofline, and the runs that time one built engine: decode steps, steps beside an arriving prompt's prefill
chunk, a long prefill. gpu_step.py chooses what to build and in what order, and reports."""

from __future__ import annotations

import random
import statistics
import time

import torch

from tokenfleet.engine.request_spec import RequestSpec


def measure_card() -> dict:
    dev = torch.device("cuda")
    n = 1 << 30  # 2 GiB of bf16 per buffer
    src = torch.randn(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    bw = 2 * src.numel() * 2 / statistics.median(times[2:])
    del src, dst
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    times = []
    for _ in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.mm(x, y)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    peak = 2 * m**3 / statistics.median(times[3:])
    del x, y
    torch.cuda.empty_cache()
    return {"hbm_bytes_per_s": bw, "bf16_matmul_flops": peak, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__}


def linear_params(c) -> int:
    per_layer = ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size + c.hidden_size * c.num_heads * c.head_dim
                 + 3 * c.hidden_size * c.intermediate_size)
    return c.num_layers * per_layer


def step_roofline(c, batch: int, context: float, fp8: bool, card: dict, kv8: bool = False) -> dict:
    weight_bytes = linear_params(c) * (1 if fp8 else 2) + c.vocab_size * c.hidden_size * 2  # + the bf16 LM head
    row = c.head_dim + 16 if kv8 else c.head_dim * 2  # an FP8 row: e4m3 values, an fp32 scale, padding (kv_fp8)
    kv_bytes = batch * context * c.num_layers * 2 * c.num_kv_heads * row
    flops = (2 * (linear_params(c) + c.vocab_size * c.hidden_size) * batch
             + 4 * batch * context * c.num_layers * c.num_heads * c.head_dim)
    floor = max((weight_bytes + kv_bytes) / card["hbm_bytes_per_s"], flops / card["bf16_matmul_flops"])
    return {"bytes": weight_bytes + kv_bytes, "flops": flops, "floor_ms": 1000 * floor}


def timed_forward(runner):
    """Wrap the runner's forward (``compute_logits``; overlapped steps: ``launch``) with CUDA events: each call's GPU
    time lands in the returned list. ``untime(runner)`` unwraps."""
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    for name in ("compute_logits", "launch"):
        inner = getattr(runner, name)

        def timed(*args, _inner=inner, **kwargs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = _inner(*args, **kwargs)
            b.record()
            spans.append((a, b))
            return out

        setattr(runner, name, timed)
    return spans


def untime(runner) -> None:
    for name in ("compute_logits", "launch"):
        delattr(runner, name)  # back to the class's methods


def replay_ms(runner, batch: int) -> float:
    """GPU time of one replay of the batch's graph, back to back (no host work between); 0 without graphs."""
    graphs = runner.graphs
    if graphs is None or not graphs.captured:
        return 0.0
    graph = graphs._graphs[next(size for size in graphs.buckets if size >= batch)]
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        graph.replay()  # the last step's inputs again: the same K/V written to the same slots
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 20


def decode_run(core, runner, config, batch: int, context: int, steps: int, seed: int) -> dict:
    from tokenfleet.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 4096, temperature=0.0, ignore_eos=True)  # aborted after the run
    ids = []
    for i in range(batch):
        prompt = [rng.randrange(100, config.vocab_size) for _ in range(context)]
        ids.append(core.add_request(RequestSpec(prompt, params, request_id=f"s{seed}-{i}")))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()  # prefill, not timed
    spans = timed_forward(runner)
    replays = runner.graphs.replays if runner.graphs is not None else 0
    overlapped = core.stats.num_overlapped_steps
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    gpu = [a.elapsed_time(b) / 1000 for a, b in spans]
    untime(runner)
    replay = replay_ms(runner, batch)
    for rid in ids:
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    step = statistics.median(times)
    return {"batch": batch, "steps": steps, "step_ms": 1000 * step, "p90_step_ms": 1000 * sorted(times)[int(0.9 * len(times))],
            "forward_gpu_ms": 1000 * statistics.median(gpu), "tok_s": batch / step, "replay_ms": replay,
            "host_gap_ms": 1000 * step - replay if replay else None,
            "overlapped_steps": core.stats.num_overlapped_steps - overlapped,
            "graph_replays": (runner.graphs.replays - replays) if runner.graphs is not None else 0,
            "context_mid": context + steps / 2}


def mixed_run(core, runner, config, batch: int, context: int, steps: int, prompt_len: int, every: int, seed: int
              ) -> dict:
    """Decode steps of ``batch`` requests while a fresh ``prompt_len``-token request arrives every ``every`` steps
    and stops after its first token (the batch stays the same): the steps holding its prefill chunk ("mixed" steps,
    eager unless TOKENFLEET_CUDA_GRAPHS_MIXED=1 graphs them) timed apart from the others. Without overlap: a queued
    step would move the chunk one step later."""
    from tokenfleet.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=steps + 4096, temperature=0.0, ignore_eos=True)
    ids = [core.add_request(RequestSpec([rng.randrange(100, config.vocab_size) for _ in range(context)], params,
                                        request_id=f"x{seed}-{i}")) for i in range(batch)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    mixed = getattr(runner, "mixed", None)
    replays = mixed.replays if mixed is not None else 0
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with_chunk, without = [], []
    for s in range(steps):
        arrived = s % every == 0
        if arrived:
            core.add_request(RequestSpec([rng.randrange(100, config.vocab_size) for _ in range(prompt_len)], one,
                                         request_id=f"x{seed}-a{s}"))
        t = time.perf_counter()
        core.step()
        (with_chunk if arrived else without).append(time.perf_counter() - t)
    for rid in ids:
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    return {"prompt_len": prompt_len, "every": every, "mixed_steps": len(with_chunk),
            "mixed_step_ms": 1000 * statistics.median(with_chunk), "decode_step_ms": 1000 * statistics.median(without),
            "mixed_replays": (mixed.replays - replays) if mixed is not None else 0}


def prefill_run(core, config, tokens: int, seed: int) -> dict:
    from tokenfleet.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    times = []
    for k in range(3):
        prompt = [rng.randrange(100, config.vocab_size) for _ in range(tokens)]
        torch.cuda.synchronize()
        t = time.perf_counter()
        core.add_request(RequestSpec(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                     request_id=f"p{seed}-{k}"))
        while core.has_unfinished():
            core.step()
        times.append(time.perf_counter() - t)
    c = config
    flops = 2 * linear_params(c) * tokens + 2 * tokens**2 * c.num_layers * c.num_heads * c.head_dim  # causal attention
    t = statistics.median(times)
    return {"tokens": tokens, "seconds": t, "runs_s": times, "tok_s": tokens / t, "flops_per_s": flops / t}
