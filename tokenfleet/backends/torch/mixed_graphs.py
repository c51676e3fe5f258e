"""CUDA graphs of steps with prefill chunks: one captured forward per bucket of the step's token count.

Decode-only steps replay ``DecodeGraphs``; a step with a prefill chunk ran eagerly, which on a GPU costs the eager
forward's launches (SmolLM2's geometry on an H100: 11 ms at batch 1 against 1.7 ms replayed). Under load such
steps are frequent: at 64 concurrent streams of 128 tokens a new request arrives about every other step, and
`tokenfleet up` on an H200 streamed at a TPOT of 10.5 ms while its batch-64 decode graph took 4.4-5.4 ms
(benchmarks/reports/2026-11-26-h200-gpu-data-plane.md).

Here every row of the step, decode and prefill alike, goes through one paged-attention call over the block tables
(``ForwardBatch.queries``: the Triton kernel takes any number of query rows per request, causal among them), so the
forward's shapes depend only on the step's token count and the request count, both padded:

    token ids, positions, KV slots             [max_tokens]     padding tokens: token 0 into the scratch block
    query starts                               [max_requests + 1]
    context lengths, logits rows, exact flags  [max_requests]   padding requests: no rows, one key (scratch)
    block tables                               [max_requests, max_blocks]

A step of T tokens replays the graph of the smallest bucket >= T (64, 128, ... up to the engine's token budget),
which holds min(T, max_requests) requests (a step has at most one per token). The attention runs a work list of
(request, tile of rows) programs, T / tile rows + requests long for a bucket, so a step's grid does not cover a
bucket's rows for every request (most of which have one). Logits rows are the sampling entries'
last rows, in order. Models of one full-attention KV group (Llamas) only; steps with speculative verification rows,
prompt logprobs, LoRA adapters, more requests than the buckets hold, or a decode row over MAX_DECODE_CONTEXT keys
run eagerly.

Padding tokens belong to no request: their attention output is whatever the buffer held, and every later op on
their rows is row-wise (norms, per-row FP8 activation scales, GEMMs, RoPE and the K/V write into the scratch
block, which the decode graphs' padding rows overwrite before reading), and no logits row reads them. An op that
mixed rows (a per-tensor activation scale) would have to mask them first.
Off unless TOKENFLEET_CUDA_GRAPHS_MIXED=1 (envs.cuda_graphs_mixed) until a GPU measures it against the eager step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tokenfleet import envs
from tokenfleet.backends.torch.cuda_graphs import capture_buckets
from tokenfleet.engine.request import Request
from tokenfleet.engine.scheduler import ScheduledRequest
from tokenfleet.models.attention import ForwardBatch, PagedQueries

MAX_TOKENS = 2048  # bigger steps amortize the eager forward's launches; their graphs would hold GBs of activations
# A one-row (decode) request in a mixed graph is one program per KV head walking its whole context (the eager step
# splits long contexts over partitions: models.triton_attention); steps with a longer one run eagerly.
MAX_DECODE_CONTEXT = 4096


def token_buckets(max_tokens: int, smallest: int = 64, per_octave: int = 8) -> list[int]:
    """Token counts that get a graph: multiples of ``smallest``, spaced by at most 1/``per_octave`` of the count
    above ``smallest * per_octave`` (64, 128, ..., 512, 576, ..., 1024, 1152, ...), then ``max_tokens``.

    A step replays the smallest bucket that holds it, and every padding token costs a full token's matmuls. Below
    the bf16 ridge (~260 tokens on an H100: 2 FLOPs per weight read) that is nearly free, above it not: with powers
    of two, an 8B step of 8 decode rows and a 512-token chunk replayed the 1,024 bucket in 25.2 ms against 16.6 ms
    eagerly (H100, benchmarks/reports/2026-11-26-h100-gpu-step-mixed-graphs.md). Here padding stays under 1/8."""
    sizes = []
    t = smallest
    while t < max_tokens:
        sizes.append(t)
        octave = 1 << (t.bit_length() - 1)  # the power of two at or below t
        t += max(smallest, octave // per_octave)
    sizes.append(max_tokens)
    return sizes


class MixedGraphs:
    def __init__(self, model: Any, kv: Any, block_size: int, scratch_block: int, max_requests: int, max_tokens: int,
                 max_blocks: int, logits: torch.Tensor):
        """``max_blocks``: the block tables' width (DecodeGraphs'); ``logits``: a [>= max_requests, vocab] float32
        buffer to write into (the decode graphs', shared: a step replays one graph or the other)."""
        self.model = model
        self.kv = kv
        self.device = model.device
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.max_blocks = max_blocks
        if max_tokens <= 4:
            raise ValueError("mixed-step graphs need a token budget over 4 (steps of prefill chunks)")
        self.buckets = token_buckets(max_tokens)
        r, t, w = max_requests, max_tokens, max_blocks
        cuda = self.device.type == "cuda"
        # the attention's programs: a work list of (request, tile of tile_rows rows); a bucket of T tokens and R
        # requests needs at most T / tile_rows + R of them (a request's last tile may be partial)
        self.tile_rows = model.attention.rows_per_program(model.config.num_heads, model.config.num_kv_heads,
                                                          self.buckets[0])
        self.max_work = self._work_len(t)
        # one pinned host buffer and its device twin: tokens, positions, slots [t]; query starts [r + 1]; context
        # lengths, logits rows, exact flags [r]; the work list [2, max_work]; then room to stage a step's [r, used]
        # table columns, spread into the tables on the device (a step uploads only the columns its contexts reach)
        sizes = {"tokens": t, "positions": t, "slots": t, "starts": r + 1, "contexts": r, "rows": r, "exact": r,
                 "work": 2 * self.max_work, "tables": r * w}
        self._layout, at = {}, 0
        for name, n in sizes.items():
            self._layout[name] = (at, at + n)
            at += n
        size = at
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=cuda)
        self._np = self._host.numpy()
        self._dev = torch.zeros(size, dtype=torch.long, device=self.device)
        self._uploaded = torch.cuda.Event() if cuda else None
        self.tokens, self.positions, self.slots, self.starts, self.contexts, self.rows, self.exact = (
            self._dev[a:b] for a, b in (self._layout[k] for k in ("tokens", "positions", "slots", "starts", "contexts",
                                                                   "rows", "exact")))
        self.work = self._dev[slice(*self._layout["work"])].view(2, self.max_work)
        self._staged = self._dev[self._layout["tables"][0]:]
        self.tables = torch.zeros(r, w, dtype=torch.long, device=self.device)
        self.logits = logits
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.captured = False
        self.replays = 0

    def _work_len(self, t: int) -> int:
        return -(-t // self.tile_rows) + min(t, self.max_requests)

    @classmethod
    def beside(cls, graphs: Any, max_tokens: int) -> MixedGraphs | None:
        """Mixed-step graphs sharing a ``DecodeGraphs``' model, cache, scratch block, tables' width and logits buffer,
        for steps of up to ``max_tokens`` (at most MAX_TOKENS): None unless TOKENFLEET_CUDA_GRAPHS_MIXED=1 and the
        model keeps one KV group."""
        if max_tokens <= 4 or not envs.cuda_graphs_mixed() or tuple(graphs.windows) != (0,):
            return None
        return cls(graphs.model, graphs.kv, graphs.block_size, graphs.scratch_block, graphs.max_batch,
                   min(max_tokens, MAX_TOKENS), graphs.max_blocks, graphs.logits)

    def host(self, name: str) -> np.ndarray:
        a, b = self._layout[name]
        return self._np[a:b]

    def supports(self, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request]) -> bool:
        if not 0 < len(scheduled) <= self.max_requests:
            return False
        tokens = 0
        for entry in scheduled:
            if entry.draft:
                return False
            request = requests[entry.request_id]
            if request.sampling_params.prompt_logprobs is not None or request.adapter:
                return False
            end = entry.start + entry.num_new_tokens
            if -(-end // self.block_size) > self.max_blocks or (entry.num_new_tokens == 1 and end > MAX_DECODE_CONTEXT):
                return False
            tokens += entry.num_new_tokens
        return tokens <= self.buckets[-1]  # the largest bucket captured (cuda_graphs.warm_up may drop some)

    def capture(self, pool: Any = None) -> Any:
        """Capture every bucket in ``pool`` (the decode graphs'); returns the pool."""
        self._fill(0, self.max_tokens, 0)
        self.host("work")[:self.max_work] = -1  # no request: every program exits
        self._dev.copy_(self._host)
        self.tables[:, 0] = self.scratch_block
        self._graphs, pool = capture_buckets(self.device, self.buckets, self._forward, pool)
        self.buckets = sorted(self._graphs)
        self.captured = True
        return pool

    def _forward(self, t: int) -> None:
        r = min(t, self.max_requests)  # a step of t tokens has at most t requests
        queries = PagedQueries(block_table=self.tables[:r], context_lens=self.contexts[:r],
                               query_start=self.starts[:r + 1], num_tokens=t, max_query_len=t,
                               work=self.work[:, :self._work_len(t)])
        batch = ForwardBatch(positions=self.positions[:t], slot_mapping=self.slots[:t], logits_indices=self.rows[:r],
                             exact_rows=self.exact[:r].bool(), queries=queries)
        self.logits[:r].copy_(self.model.forward(self.tokens[:t], batch, self.kv))

    def run(self, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request]) -> torch.Tensor:
        """float32 logits [sampling entries, vocab] in ``scheduled`` order (a view of the shared buffer: valid until
        the next replay)."""
        total = sum(entry.num_new_tokens for entry in scheduled)
        t = next(size for size in self.buckets if size >= total)
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's upload has read the host buffer
        bs, n = self.block_size, len(scheduled)
        tokens, positions, slots = self.host("tokens"), self.host("positions"), self.host("slots")
        starts, contexts, rows, exact = self.host("starts"), self.host("contexts"), self.host("rows"), self.host("exact")
        width = max(-(-(e.start + e.num_new_tokens) // bs) for e in scheduled)  # the table columns this step reads
        tables = self.host("tables")[:n * width].reshape(n, width)  # padding requests have no rows: no table read
        row = sampled = 0
        for i, entry in enumerate(scheduled):
            request = requests[entry.request_id]
            count, start = entry.num_new_tokens, entry.start
            end = start + count
            used = -(-end // bs)
            blocks = np.asarray(entry.block_ids[:used], dtype=np.int64)
            tables[i, :used] = blocks
            tokens[row:row + count] = request.token_ids_range(start, end)
            pos = np.arange(start, end, dtype=np.int64)
            positions[row:row + count] = pos
            slots[row:row + count] = blocks[pos // bs] * bs + pos % bs
            starts[i] = row
            contexts[i] = end
            row += count
            if entry.samples:
                params = request.sampling_params
                rows[sampled] = row - 1
                exact[sampled] = params.temperature == 0 or params.logprobs is not None
                sampled += 1
        starts[n] = row
        self._fill(row, t, n, sampled)
        # the work list: each request's tiles of rows, then nothing (request -1) to the bucket's length
        work = self.host("work").reshape(2, self.max_work)
        k = 0
        for i, entry in enumerate(scheduled):
            tiles = -(-entry.num_new_tokens // self.tile_rows)
            work[0, k:k + tiles] = i
            work[1, k:k + tiles] = np.arange(tiles)
            k += tiles
        work[0, k:self._work_len(t)] = -1
        upto = self._layout["tables"][0] + n * width
        self._dev[:upto].copy_(self._host[:upto], non_blocking=True)
        self.tables[:n, :width].copy_(self._staged[:n * width].view(n, width))
        self.replays += 1
        if self._uploaded is None:  # no CUDA (tests of the buffers' bookkeeping): the same forward, eagerly
            self._forward(t)
            return self.logits[:sampled]
        self._uploaded.record()
        self._graphs[t].replay()
        return self.logits[:sampled]

    def _fill(self, first_token: int, last_token: int, first_request: int, first_row: int = 0) -> None:
        """Padding: tokens first_token..last_token-1 are token 0 at position 0 into the scratch block; requests from
        first_request have no rows (their query start is the last real row, so no program reads their one key or
        their table); logits rows from first_row read row 0, not refined."""
        scratch = self.scratch_block * self.block_size
        self.host("tokens")[first_token:last_token] = 0
        self.host("positions")[first_token:last_token] = 0
        self.host("slots")[first_token:last_token] = scratch
        self.host("starts")[first_request + 1:] = first_token if first_request else 0
        self.host("contexts")[first_request:] = 1
        self.host("rows")[first_row:] = 0
        self.host("exact")[first_row:] = 0
