"""CUDA graphs of decode-only steps: one captured forward per batch-size bucket, replayed.

A decode step of a small model is launch-bound in eager mode: ~30 layers x ~15 kernels, each a few
microseconds of Python and driver work, while the GPU needs a fraction of that to read the weights.
A captured graph replays every kernel in one launch. It needs every input at a fixed address, so
the step's inputs live in static buffers the runner fills each step:

    token ids, positions, context lengths, exact-logit flags, KV slots   [max_batch] each
    block tables                                                          [max_batch, groups, max_blocks]

(a model of several KV groups, Gemma 3's sliding-window layers, has a KV slot column and a block table per
group: the same rows over each group's tables, each attended with its group's window). A step uploads the
columns and only the table columns its contexts use, staged as [rows, groups, used] after the columns and
spread into the tables on the device. The tables take at most TABLE_BYTES: past that (many groups, a long
max_model_len) they are narrower, and steps over longer contexts run eagerly.

filled on the host in one pinned buffer and uploaded with one copy. A step of B requests replays
the graph of the smallest bucket >= B; the padding rows decode token 0 at position 0 into a
scratch block that the block manager never hands out (the runner's cache has one more block than
the pool), with a context of one key, and their logits are dropped. Attention must take its loop
bounds from the context-length tensor, not from Python: the Triton kernel (models.triton_attention)
does; the torch reference would gather the whole table width, so graphs are used only with it.

LoRA adapters (models.lora) get a second graph per bucket, captured over the loaded adapters' stacked matrices
when an adapter is loaded (``capture_lora``): a step with adapter rows uploads each row's column range per fused
layer (numbers, like the columns above) and the graph builds the adapters' masks from them on the device; a step
without adapter rows replays the plain graph. Until an adapter set's graphs are captured (or if capturing them
failed), its steps run eagerly.

What falls back to the eager forward: steps with a prefill chunk (unless TOKENFLEET_CUDA_GRAPHS_MIXED=1 replays
them from backends.torch.mixed_graphs) or speculative verification rows, prompt logprobs, and batches over the
largest bucket captured (a bucket whose warm-up forward runs out of device memory is not captured: ``warm_up``).
Greedy rows (and rows reporting logprobs) get their top logits recomputed exactly as in eager mode
(llama.refine_top_logits; models.triton_logits on CUDA), chosen per row by a static flag.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
import torch

from tokenfleet import envs
from tokenfleet.engine.request import Request
from tokenfleet.engine.scheduler import ScheduledRequest
from tokenfleet.models.attention import ForwardBatch, PagedQueries
from tokenfleet.models.lora import FUSED, LoraBatch, LoraSet

log = structlog.get_logger(__name__)

TABLE_BYTES = 64 << 20  # the static block tables' bound (their staging twins take as much again)


def graphs_supported(model: Any) -> bool:
    """CUDA, a Llama-family or Gemma 3 model, attention that reads its loop bounds from device tensors, and graphs
    not turned off (TOKENFLEET_CUDA_GRAPHS=0)."""
    from tokenfleet.models.gemma3 import Gemma3Model
    from tokenfleet.models.llama import LlamaModel
    from tokenfleet.models.triton_attention import TritonPagedAttention

    return (model.device.type == "cuda" and envs.cuda_graphs() and isinstance(model.attention, TritonPagedAttention)
            # a Llama's forward reads one KV group: sliding-window layers only as Gemma 3's
            and (isinstance(model, Gemma3Model) or isinstance(model, LlamaModel) and not any(model.config.layer_windows)))


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 8 to 64, every 16 to 128, every 32 beyond."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    b = 8
    while b < max_batch:
        sizes.append(b)
        b += 8 if b < 64 else 16 if b < 128 else 32
    sizes.append(max_batch)
    return sizes


def warm_up(sizes: Sequence[int], forward: Callable[[int], None]) -> list[int]:
    """Run each size's forward twice, largest first (kernels compile and libraries create their handles outside a
    capture). A size whose forward runs out of device memory is dropped, with the warning, and the smaller ones are
    tried: a worker whose weights and KV cache leave too little for its largest bucket's activations keeps graphs for
    the batches that fit, rather than none. Returns the sizes kept, ascending; raises if none fits, or if a smaller
    size fails after a larger one fit (not a matter of size)."""
    kept: list[int] = []
    for size in reversed(sizes):
        try:
            forward(size)
            forward(size)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:
            # cuBLAS's allocation failures come as RuntimeErrors; any other error is not about size
            if kept or not (isinstance(e, torch.cuda.OutOfMemoryError) or "ALLOC_FAILED" in str(e)):
                raise
            log.warning("cuda_graph_bucket_out_of_memory", size=size, error=(str(e).splitlines() or [""])[0][:200])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            continue
        kept.append(size)
    if not kept:
        raise torch.cuda.OutOfMemoryError(f"no CUDA-graph bucket's forward fits in device memory (sizes {list(sizes)})")
    return sorted(kept)


def capture_buckets(device: torch.device, sizes: Sequence[int], forward: Callable[[int], None], pool: Any = None,
                    mode: str = "global") -> tuple[dict[int, torch.cuda.CUDAGraph], Any]:
    """One graph of ``forward(size)`` per size that fits (``warm_up``, on a side stream), largest first, all in one
    memory pool (``pool``, or a new one: the pool is returned). The warm-ups' memory goes back to the device before
    the captures, which take theirs from the graphs' own pool. ``mode``: CUDA's capture error mode ("thread_local"
    while other threads may use the device)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        sizes = warm_up(sizes, forward)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    graphs = {}
    for size in reversed(sizes):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):  # type: ignore[arg-type]
            forward(size)
        if pool is None:
            pool = graph.pool()
        graphs[size] = graph
    torch.cuda.synchronize(device)
    return graphs, pool


class DecodeGraphs:
    def __init__(self, model: Any, kv: Any, block_size: int, scratch_block: int, max_batch: int, max_model_len: int):
        self.model = model
        self.kv = kv
        self.device = model.device
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_batch = max_batch
        self.buckets = buckets(max_batch)
        self.windows = tuple(group.window for group in model.config.kv_groups)  # one entry per KV group
        g = len(self.windows)
        self.max_blocks = max(1, min(-(-max_model_len // block_size), TABLE_BYTES // (max_batch * g * 8)))
        n, w = max_batch, self.max_blocks
        # One pinned host buffer and its device twin: 5 + g columns of n, then room to stage a step's [b, g, used]
        # tables. Columns: tokens, positions, context lengths, exact flags; the fifth: for a row whose input token
        # is still on the device (overlapped scheduling), its index in those ids, else -1; then each group's slots.
        self._columns = 5 + g
        cuda = self.device.type == "cuda"
        self._host = torch.zeros(self._columns * n + n * g * w, dtype=torch.long, pin_memory=cuda)
        self._host_np = self._host.numpy()
        self._uploaded = torch.cuda.Event() if cuda else None
        self._dev = torch.zeros(self._host.shape, dtype=torch.long, device=self.device)
        self.tokens, self.positions, self.context_lens, self.exact, self.source = (
            self._dev[i * n:(i + 1) * n] for i in range(5))
        self.group_slots = [self._dev[(5 + i) * n:(6 + i) * n] for i in range(g)]
        self._staged = self._dev[self._columns * n:]
        self._tables = torch.zeros(n, g, w, dtype=torch.long, device=self.device)
        self.group_tables = [self._tables[:, i] for i in range(g)]  # [n, w] views with a row stride of g * w
        self.table = self.group_tables[0]
        self.query_start = torch.arange(n + 1, dtype=torch.long, device=self.device)
        self.rows = torch.arange(n, dtype=torch.long, device=self.device)
        vocab = model.config.vocab_size
        self.logits = torch.empty(n, vocab, dtype=torch.float32, device=self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.captured = False
        self._pool: Any = None
        self.replays = 0  # steps served by a graph (tests, metrics)
        # LoRA: each row's [first, end) columns per fused layer (FUSED order), a pinned buffer of its own uploaded
        # only by steps with adapter rows; the graphs of the adapter set at ``lora_version``
        self.lora: LoraSet | None = None
        self.lora_version = -1
        self.lora_replays = 0
        self._lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._lora_host = torch.zeros(2 * len(FUSED) * n, dtype=torch.long, pin_memory=cuda)
        self._lora_host_np = self._lora_host.numpy()
        self._lora_dev = torch.zeros(self._lora_host.shape, dtype=torch.long, device=self.device)

    @property
    def memory_pool(self) -> Any:
        """The captured graphs' memory pool (the mixed-step graphs capture into it too)."""
        return self._pool

    def supports(self, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request]) -> bool:
        if not 0 < len(scheduled) <= self.buckets[-1]:  # the largest bucket captured (warm_up may drop some)
            return False
        lora_ready = self.lora is not None and self.lora.version == self.lora_version
        adapters = False
        for entry in scheduled:
            if entry.num_new_tokens != 1 or entry.draft or not entry.samples:
                return False
            if entry.start + 1 > self.max_blocks * self.block_size:
                return False
            request = requests[entry.request_id]
            if request.sampling_params.prompt_logprobs is not None:
                return False
            if getattr(request, "adapter", ""):
                if not lora_ready:
                    return False
                adapters = True
        # the adapters' graphs may cover fewer buckets (captured later, with less memory free); no CUDA: none at all
        return not adapters or self._uploaded is None or self._bucket(len(scheduled)) in self._lora_graphs

    def _bucket(self, rows: int) -> int:
        return next(size for size in self.buckets if size >= rows)

    def capture(self) -> None:
        """Capture every bucket, largest first (they share one memory pool). Each forward runs once eagerly
        first: kernels compile and libraries create their handles outside the capture."""
        self._fill_padding(0, self.max_batch)
        self._dev.copy_(self._host)
        self._tables[:, :, 0] = self.scratch_block
        self._graphs = self._capture_buckets(lora=False)
        self.buckets = sorted(self._graphs)  # those whose forward fit in memory
        self.captured = True

    def capture_lora(self, lora: LoraSet) -> None:
        """Graphs of ``lora``'s adapters as loaded now (after each load: the stacked matrices are new tensors).
        Until this returns, steps with adapter rows run eagerly; the previous set's graphs are dropped first."""
        self._lora_graphs = {}
        self.lora = lora
        self.lora_version = -1
        if self._uploaded is not None:  # no CUDA (tests): the eager forward stands in for the graphs
            # every row a padding row (the scratch block) while capturing: the warm-up forwards write K/V too. A step
            # queued before this (overlapped scheduling) replays first: these copies follow it on the stream
            self._uploaded.synchronize()
            n = self.max_batch
            self._fill_padding(0, n)
            self._lora_host_np[:] = 0
            self._dev[:self._columns * n].copy_(self._host[:self._columns * n], non_blocking=True)
            self._lora_dev.copy_(self._lora_host, non_blocking=True)
            self._tables[:, :, 0] = self.scratch_block
            self._uploaded.record()
            # thread_local: the worker is serving now, and other threads may read KV blocks off the device (KV
            # transfer) while this thread captures; the startup capture keeps CUDA's stricter global mode
            self._lora_graphs = self._capture_buckets(lora=True, mode="thread_local")
        self.lora_version = lora.version

    def _capture_buckets(self, lora: bool, mode: str = "global") -> dict[int, torch.cuda.CUDAGraph]:
        graphs, self._pool = capture_buckets(self.device, self.buckets, lambda b: self._forward(b, lora), self._pool, mode)
        return graphs

    def _forward(self, b: int, lora: bool = False) -> None:
        exact = self.exact[:b].bool()
        views = []
        for slots, table, window in zip(self.group_slots, self.group_tables, self.windows):
            meta = PagedQueries(block_table=table[:b], context_lens=self.context_lens[:b],
                                query_start=self.query_start[: b + 1], num_tokens=b, max_query_len=1, window=window)
            views.append(ForwardBatch(positions=self.positions[:b], slot_mapping=slots[:b],
                                      logits_indices=self.rows[:b], exact_rows=exact, paged=meta, window=window))
        batch = views[0]
        batch.others = tuple(views[1:])
        if lora:
            assert self.lora is not None
            n = self.max_batch
            first = {f: self._lora_dev[2 * k * n: 2 * k * n + b] for k, f in enumerate(FUSED)}
            end = {f: self._lora_dev[(2 * k + 1) * n: (2 * k + 1) * n + b] for k, f in enumerate(FUSED)}
            batch.lora = LoraBatch.from_ranges(self.lora, first, end)
        self.logits[:b].copy_(self.model.forward(self.tokens[:b], batch, self.kv))

    def run(self, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request],
            source: tuple[torch.Tensor, list[tuple[int, int]]] | None = None) -> torch.Tensor:
        """float32 logits [len(scheduled), vocab] (a view of a static buffer: valid until the next replay).
        ``source``: (device token ids, [(entry index, index in them)]): entries whose input token is still on the
        device (the step before, queued and not read back: overlapped scheduling); gathered there, no host wait."""
        real = len(scheduled)
        b = self._bucket(real)
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's upload has read the host buffer
        n, bs, cols, g = self.max_batch, self.block_size, self._columns, len(self.windows)
        host = self._host_np
        width = max(-(-(entry.start + 1) // bs) for entry in scheduled)  # the table columns this step reads
        tables = host[cols * n:cols * n + b * g * width].reshape(b, g, width)
        carried = dict(source[1]) if source is not None else {}
        for i, entry in enumerate(scheduled):
            request = requests[entry.request_id]
            pos = entry.start
            host[i] = 0 if i in carried else request.token_ids_range(pos, pos + 1)[0]
            host[n + i] = pos
            host[2 * n + i] = pos + 1
            params = request.sampling_params
            host[3 * n + i] = params.temperature == 0 or params.logprobs is not None
            host[4 * n + i] = carried.get(i, -1)
            used = -(-(pos + 1) // bs)
            for k, blocks in enumerate((entry.block_ids, *entry.other_block_ids)):  # a sliding group's table holds
                host[(5 + k) * n + i] = blocks[pos // bs] * bs + pos % bs  # the null block where its window ended
                tables[i, k, :used] = blocks[:used]  # (past used: stale values, never read: the context ends first)
        self._fill_padding(real, b)
        tables[real:, :, 0] = self.scratch_block
        lora = self.lora is not None and self._fill_lora(scheduled, requests, b)
        staged = b * g * width
        self._dev[:cols * n + staged].copy_(self._host[:cols * n + staged], non_blocking=True)
        if lora:
            self._lora_dev.copy_(self._lora_host, non_blocking=True)
        self._tables[:b, :, :width].copy_(self._staged[:staged].view(b, g, width))
        if source is not None and carried:
            src = self.source[:b]
            self.tokens[:b] = torch.where(src >= 0, source[0][src.clamp(min=0)], self.tokens[:b])
        self.replays += 1
        self.lora_replays += lora
        if self._uploaded is None:  # no CUDA (tests of the buffers' bookkeeping): the same forward, eagerly
            self._forward(b, lora)
            return self.logits[:real]
        self._uploaded.record()
        (self._lora_graphs if lora else self._graphs)[b].replay()
        return self.logits[:real]

    def _fill_lora(self, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request], b: int) -> bool:
        """Each row's adapter columns per fused layer into the LoRA host buffer (padding rows and rows without an
        adapter: an empty range); False, with nothing written, when no row has an adapter."""
        assert self.lora is not None
        names = [getattr(requests[entry.request_id], "adapter", "") for entry in scheduled]
        if not any(names):
            return False
        n = self.max_batch
        host = self._lora_host_np
        for k, f in enumerate(FUSED):
            ranges = self.lora.columns.get(f, {})
            for i, name in enumerate(names):
                host[2 * k * n + i], host[(2 * k + 1) * n + i] = ranges.get(name, (0, 0))
            host[2 * k * n + len(names): 2 * k * n + b] = 0
            host[(2 * k + 1) * n + len(names): (2 * k + 1) * n + b] = 0
        return True

    def _fill_padding(self, first: int, last: int) -> None:
        """Rows first..last-1 decode token 0 at position 0 into the scratch block (every group's slot; their tables'
        first column is the scratch block too, set where the tables are staged)."""
        n, bs = self.max_batch, self.block_size
        host = self._host_np
        slots = [(5 + g, self.scratch_block * bs) for g in range(len(self.windows))]
        for column, value in ((0, 0), (1, 0), (2, 1), (3, 0), (4, -1), *slots):
            host[column * n + first: column * n + last] = value

