"""Torch model runner: scheduler output -> one forward over paged KV -> sampled tokens.

Owns every tensor of the engine: the model weights, the KV cache, the inputs it builds each
step, and the sampler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import structlog
import torch

from tokenfleet.backends.torch.cuda_graphs import DecodeGraphs, graphs_supported
from tokenfleet.backends.torch.device import SMALL_STEP_TOKENS, to_device
from tokenfleet.backends.torch.draft import DraftModel
from tokenfleet.backends.torch.kv_io import KVBlockIO
from tokenfleet.backends.torch.mixed_graphs import MixedGraphs
from tokenfleet.backends.torch.sampler import PendingSample, Sampler
from tokenfleet.engine.kv_tier import PendingBlock
from tokenfleet.engine.output import TokenLogprobs
from tokenfleet.engine.request import Request
from tokenfleet.engine.runner import ExecuteResult
from tokenfleet.engine.scheduler import ScheduledRequest, SchedulerOutput
from tokenfleet.models.attention import ForwardBatch, PagedQueries, PrefillSpan
from tokenfleet.models.gemma3 import Gemma3Model
from tokenfleet.models.linear import Fp8Linear
from tokenfleet.models.llama import KVCache, LlamaModel
from tokenfleet.models.lora import LoraBatch, LoraSet, fused_base_weights, load_peft_adapter
from tokenfleet.planning.costs import StepShape
from tokenfleet.telemetry.utilization import StepCost, peaks

log = structlog.get_logger(__name__)


class TorchModelRunner:
    def __init__(self, model: LlamaModel | Gemma3Model, num_blocks: int, block_size: int, cuda_graph_batch: int = 0,
                 max_model_len: int = 0, mixed_graph_tokens: int = 0):
        """``cuda_graph_batch`` > 0 on CUDA: decode-only steps of up to that many requests replay captured graphs
        (backends.torch.cuda_graphs; ``capture_graphs`` captures them) where the model and attention allow it;
        with TOKENFLEET_CUDA_GRAPHS_MIXED=1, steps with prefill chunks of up to ``mixed_graph_tokens`` tokens (at
        most 2,048) too (backends.torch.mixed_graphs; Llamas).
        The KV cache is in the model's dtype, or FP8 where the model was loaded for it (``kv_cache_dtype``)."""
        self.model = model
        self.device = model.device
        self.block_size = block_size
        graphs = cuda_graph_batch > 0 and graphs_supported(model)
        # graphs: one block more than the pool, never handed out, where padding rows write their K/V
        self.kv = KVCache(model.config, num_blocks + graphs, block_size, model.dtype, model.device, model.kv_cache_dtype)
        self.graphs = DecodeGraphs(model, self.kv, block_size, num_blocks, cuda_graph_batch,
                                   max_model_len or model.config.max_position_embeddings) if graphs else None
        self.windows = tuple(group.window for group in model.config.kv_groups)
        self.mixed = MixedGraphs.beside(self.graphs, mixed_graph_tokens) if self.graphs is not None else None
        self.sampler = Sampler(model.device)
        self.kernel_checks = (*model.kernel_checks, *self.sampler.kernel_checks)  # each checked at load
        self._prompt_spans: list[tuple[str, int, int]] = []
        self.kv_io = KVBlockIO(model.device)
        self.drafter: DraftModel | None = None  # speculative decoding with a draft model (backends.torch.draft)
        # LoRA adapters (models.lora), many per batch; None until the first is loaded
        self.adapters: LoraSet | None = None
        self._draft_probs: dict[str, torch.Tensor] = {}  # this step's: sampled requests' draft distributions
        _, kv_heads, _, _, width = self.kv.k.shape  # width: head_dim, or an FP8 row's bytes
        kv_per_token = 2 * len(self.kv.layer_slots) * kv_heads * width * self.kv.k.element_size()
        self.cost = StepCost.of_model(model, kv_per_token)  # MFU/MBU accounting (telemetry.utilization)
        # CPU: (threads of a step of at most SMALL_STEP_TOKENS tokens, of the others); None: leave torch's as set
        self.step_threads: tuple[int, int] | None = None

    def step_cost(self, output: SchedulerOutput) -> tuple[float, float]:
        """The step's model FLOPs and bytes read (weights + KV), estimated from its shape."""
        shape = StepShape.of(output)  # the simulator's count of the same step (planning.costs)
        return self.cost.of(shape.tokens, shape.samples, shape.pairs, shape.kv)

    def peaks(self) -> tuple[float, float, str]:
        """The device's peak FLOP/s (at the weights' dtype) and bytes/s, and where they come from."""
        return peaks(self.device, self.model.dtype)

    def execute(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> ExecuteResult:
        if self.step_threads is not None:
            small, full = self.step_threads
            want = small if output.num_scheduled_tokens <= SMALL_STEP_TOKENS else full
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)
        if self.drafter is not None and any(s.draft for s in output.scheduled):
            output = self._draft(output, requests)
        logits = self.compute_logits(output, requests)
        sampling = [s for s in output.scheduled if s.samples]
        num_rows = len(sampling) + sum(len(s.draft) for s in sampling)
        prompt_logprobs = self._prompt_logprobs(logits[num_rows:], requests)
        logits = logits[:num_rows]
        if not sampling:
            return ExecuteResult({}, {}, prompt_logprobs)
        if num_rows != len(sampling):  # speculative verifications: several rows each
            return self._verify(logits, sampling, requests, prompt_logprobs)
        result = self.execute_plain(logits, sampling, requests)
        return ExecuteResult(result.sampled, result.logprobs, prompt_logprobs)

    def _draft(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> SchedulerOutput:
        """The draft model fills the verification entries' placeholders (after the step's block copies, which
        it needs too); the output to run, its copies done."""
        assert self.drafter is not None
        if output.copies:
            self.kv.copy_blocks(list(output.copies))
            self.drafter.copy_blocks(list(output.copies))
        proposals = self.drafter.propose([s for s in output.scheduled if s.draft], requests)
        self._draft_probs = {rid: q for rid, (_, q) in proposals.items() if q is not None}
        scheduled = tuple(dataclasses.replace(s, draft=tuple(proposals[s.request_id][0])) if s.draft else s
                          for s in output.scheduled)
        return dataclasses.replace(output, scheduled=scheduled, copies=())

    def _verify(self, logits: torch.Tensor, sampling: Sequence[ScheduledRequest], requests: Mapping[str, Request],
                prompt_logprobs: dict[str, list[TokenLogprobs]]) -> ExecuteResult:
        """A step with verification entries: those go through ``Sampler.verify``, the others (one row each)
        through ``sample``."""
        plain_rows: list[int] = []
        verify_rows: list[int] = []
        plain: list[ScheduledRequest] = []
        verify: list[ScheduledRequest] = []
        row = 0
        for s in sampling:
            if s.draft:
                verify_rows += range(row, row + 1 + len(s.draft))
                verify.append(s)
            else:
                plain_rows.append(row)
                plain.append(s)
            row += 1 + len(s.draft)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs] = {}
        more: dict[str, list[int]] = {}
        more_logprobs: dict[str, list[TokenLogprobs]] = {}
        if plain:
            result = self.execute_plain(logits[self._tensor(plain_rows)], plain, requests)
            sampled.update(result.sampled)
            logprobs.update(result.logprobs)
        with torch.inference_mode():
            outs = self.sampler.verify(logits[self._tensor(verify_rows)], [requests[s.request_id] for s in verify],
                                       [s.draft for s in verify], [self._draft_probs.get(s.request_id) for s in verify])
        self._draft_probs = {}
        for s, out in zip(verify, outs):
            if self.drafter is not None:
                self.drafter.accepted(s, requests[s.request_id], len(out.token_ids) - 1)
            sampled[s.request_id] = out.token_ids[0]
            more[s.request_id] = out.token_ids[1:]
            if out.logprobs[0] is not None:
                logprobs[s.request_id] = out.logprobs[0]
                more_logprobs[s.request_id] = [lp for lp in out.logprobs[1:] if lp is not None]
        return ExecuteResult(sampled, logprobs, prompt_logprobs, more, more_logprobs)

    def execute_plain(self, logits: torch.Tensor, sampling: Sequence[ScheduledRequest], requests: Mapping[str, Request]
                      ) -> ExecuteResult:
        """One token for each of ``sampling`` (and its forks) from its logits row."""
        rows, index = [], []
        for k, s in enumerate(sampling):  # a request forking n samples: one logits row each
            for request_id in (s.request_id, *s.forks):
                rows.append(requests[request_id])
                index.append(k)
        if len(index) != len(sampling):
            logits = logits[torch.tensor(index, device=logits.device)]
        with torch.inference_mode():  # the logits are inference tensors: masks and biases edit them in place
            result = self.sampler.sample(logits, rows)
        sampled = {r.request_id: t for r, t in zip(rows, result.token_ids)}
        logprobs = {r.request_id: lp for r, lp in zip(rows, result.logprobs) if lp is not None}
        return ExecuteResult(sampled, logprobs)

    def _prompt_logprobs(self, logits: torch.Tensor, requests: Mapping[str, Request]
                         ) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of prompt tokens (echo with logprobs), from the rows ``build_batch`` appended
        after the sampling ones: row i of a span predicts the token after its position."""
        out: dict[str, list[TokenLogprobs]] = {}
        row = 0
        for request_id, first, count in self._prompt_spans:  # batched per span: a few syncs, not per token
            request = requests[request_id]
            lps = torch.log_softmax(logits[row: row + count].float(), dim=-1)
            targets = request.prompt_token_ids[first + 1: first + 1 + count]
            index = torch.tensor(targets, dtype=torch.long, device=lps.device)[:, None]
            chosen = lps.gather(1, index)
            ranks = ((lps > chosen).sum(dim=1) + 1).tolist()
            num_top = request.sampling_params.prompt_logprobs or 0
            values = chosen.squeeze(1).tolist()
            tops: list = [([], [])] * count
            if num_top:
                top_values, top_ids = lps.topk(num_top, dim=1)
                tops = list(zip(top_ids.tolist(), top_values.tolist()))
            out[request_id] = [TokenLogprobs(t, v, r, tuple(zip(ids, vals)))
                               for t, v, r, (ids, vals) in zip(targets, values, ranks, tops)]
            row += count
        return out

    def launch(self, output: SchedulerOutput, requests: Mapping[str, Request], carry: Launched | None = None
               ) -> Launched:
        """Queue a decode step (each entry samples one token; no drafts, forks, guided rows or prompt logprobs) and
        return without waiting for its tokens (overlapped scheduling, ``CoreParts.overlap``). ``carry``: the
        step queued before it: an entry whose input token is not on the host yet (its position is its request's
        token count) takes that step's sample for it on the device."""
        if output.copies:
            self.kv.copy_blocks(list(output.copies))
        pending: list[tuple[int, int]] = []  # (row of this step, row of carry's samples)
        for i, entry in enumerate(output.scheduled):
            if entry.start >= requests[entry.request_id].num_tokens:
                if carry is None or entry.request_id not in carry.rows:
                    raise ValueError(f"{entry.request_id}: its input token is neither known nor being sampled")
                pending.append((i, carry.rows[entry.request_id]))
        source = (carry.sample.token_ids, pending) if pending and carry is not None else None
        graphs = self.graphs
        if graphs is not None and graphs.captured and graphs.supports(output.scheduled, requests):
            logits = graphs.run(output.scheduled, requests, source)
        else:
            token_ids, batch, spans = self.build_batch(output.scheduled, requests, source)
            if spans:
                raise ValueError("a launched step has no prompt logprobs")
            logits = self.model.forward(token_ids, batch, self.kv)
        with torch.inference_mode():
            sample = self.sampler.sample_async(logits, [requests[s.request_id] for s in output.scheduled])
        return Launched(sample, {s.request_id: i for i, s in enumerate(output.scheduled)})

    def capture_graphs(self) -> None:
        """Capture the decode graphs, then the mixed-step and LoRA ones; a forward that cannot be captured leaves
        those steps eager (slower, with a warning) rather than failing the worker's start."""
        graphs = self.graphs
        if graphs is None:
            return
        if not self._try_capture("cuda_graph_capture_failed", graphs.capture):
            self.graphs = self.mixed = None
            return
        mixed = self.mixed
        if mixed is not None and not self._try_capture("cuda_graph_mixed_capture_failed",
                                                       lambda: mixed.capture(graphs.memory_pool)):
            self.mixed = None
        self._capture_lora_graphs()  # adapters loaded before the graphs (a worker's configured ones) get theirs now

    def _try_capture(self, event: str, capture: Callable[[], object]) -> bool:
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        try:
            capture()
            return True
        except Exception as e:  # noqa: BLE001 - any capture failure: the eager forward still serves
            log.warning(event, model=type(self.model).__name__, error=repr(e))
            if stream is not None:  # a capture that raised can leave its side stream current
                torch.cuda.set_stream(stream)
                torch.cuda.synchronize(self.device)
            return False

    def compute_logits(self, output: SchedulerOutput, requests: Mapping[str, Request]) -> torch.Tensor:
        """float32 logits [num sampling entries, vocab] in ``output.scheduled`` order."""
        if output.copies:
            self.kv.copy_blocks(list(output.copies))
        graphs = self.graphs
        if graphs is not None and graphs.captured and graphs.supports(output.scheduled, requests):
            self._prompt_spans = []
            return graphs.run(output.scheduled, requests)
        mixed = self.mixed
        if mixed is not None and mixed.captured and mixed.supports(output.scheduled, requests):
            self._prompt_spans = []
            return mixed.run(output.scheduled, requests)
        token_ids, batch, self._prompt_spans = self.build_batch(output.scheduled, requests)
        return self.model.forward(token_ids, batch, self.kv)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)
        if self.drafter is not None:
            self.drafter.release(request_id)

    # ---- raw KV out and in (backends.torch.kv_io): KV transfer between replicas, the second KV tier ------------
    def kv_geometry(self) -> tuple[int, int, int, str]:
        return self.kv_io.geometry(self.kv)

    def export_kv(self, layer: int, block_ids: Sequence[int]) -> tuple[bytes, bytes]:
        return self.kv_io.export_layer(self.kv, layer, self._tensor(list(block_ids)))

    def import_kv(self, layer: int, block_ids: Sequence[int], k: bytes, v: bytes) -> None:
        self.kv_io.import_layer(self.kv, layer, self._tensor(list(block_ids)), k, v)

    def export_blocks(self, block_ids: Sequence[int], wait: bool = True) -> list[bytes] | list[PendingBlock]:
        return self.kv_io.export_blocks(self.kv, self._tensor(list(block_ids)), wait)

    def block_bytes(self) -> int:
        return self.kv_io.block_bytes(self.kv)

    def import_blocks(self, pairs: Sequence[tuple[int, bytes]]) -> None:
        if pairs:
            self.kv_io.import_blocks(self.kv, self._tensor([block for block, _ in pairs]), [data for _, data in pairs])

    def build_batch(
        self, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request],
        source: tuple[torch.Tensor, list[tuple[int, int]]] | None = None,
    ) -> tuple[torch.Tensor, ForwardBatch, list[tuple[str, int, int]]]:
        """Token ids and metadata of the step; logits rows are the sampling entries' last
        positions, then (requests that want prompt logprobs) spans of prompt positions, listed
        as (request id, first position, count). Models of several KV groups get one view of the
        step per group (``ForwardBatch.others``): the same rows over that group's tables.
        ``source``: (device token ids, [(entry index, index in them)]): single-token entries whose input token
        is still on the device (``launch``)."""
        tokens: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        decode_entries: list[ScheduledRequest] = []
        chunks: list[tuple[int, ScheduledRequest]] = []  # (first row, entry) of each prefill chunk
        spans: list[tuple[str, int, int]] = []
        span_rows: list[int] = []
        exact: list[int] = []  # positions in logits_indices whose top logits are refined (greedy or logprobs)
        carried = dict(source[1]) if source is not None else {}
        carried_rows: list[tuple[int, int]] = []  # (batch row, index in source's ids)
        for index, entry in enumerate(scheduled):
            start, end = entry.start, entry.start + entry.num_new_tokens
            row = len(tokens)
            if index in carried:  # a placeholder, replaced on the device below
                carried_rows.append((row, carried[index]))
                tokens.append(0)
            else:
                tokens += requests[entry.request_id].token_ids_range(start, end - len(entry.draft))
            tokens += entry.draft
            positions += range(start, end)
            request = requests[entry.request_id]
            params = request.sampling_params
            if entry.samples:
                for r in range(len(tokens) - 1 - len(entry.draft), len(tokens)):  # a verification: every row
                    if params.temperature == 0 or params.logprobs is not None:
                        exact.append(len(logits_indices))
                    logits_indices.append(r)
            if params.prompt_logprobs is not None:
                # Positions whose next token is a prompt token and whose logprob is not known yet
                # (a preempted request recomputes its prompt but reports each logprob once).
                first = max(start, len(request.prompt_logprobs))
                last = min(end, request.num_prompt_tokens - 1)
                if last > first:
                    spans.append((entry.request_id, first, last - first))
                    span_rows += range(row + first - start, row + last - start)
            if entry.num_new_tokens == 1 or entry.draft:
                if chunks:
                    raise ValueError("decode and verification entries must precede prefill chunks")
                decode_entries.append(entry)
            else:
                chunks.append((row, entry))
        shared = dict(
            positions=self._tensor(positions),
            logits_indices=self._tensor(logits_indices + span_rows),
            exact_logits=self._tensor(exact + [len(logits_indices) + i for i in range(len(span_rows))])
            if exact or span_rows else None,
        )
        views = [self._view(g, window, scheduled, decode_entries, chunks, shared) for g, window in enumerate(self.windows)]
        batch = views[0]
        batch.others = tuple(views[1:])
        if self.adapters is not None:
            batch.lora = self._lora_rows(scheduled, requests, len(tokens))
        token_ids = self._tensor(tokens)
        if carried_rows and source is not None:
            rows, at = zip(*carried_rows)
            token_ids[self._tensor(list(rows))] = source[0][self._tensor(list(at))]
        return token_ids, batch, spans

    def adapter_names(self) -> tuple[str, ...]:
        return tuple(sorted(self.adapters.adapters)) if self.adapters is not None else ()

    def load_adapter(self, name: str, folder: str) -> None:
        """Load a PEFT LoRA adapter under ``name`` (ValueError if this model cannot serve it)."""
        if not isinstance(self.model, LlamaModel):
            raise ValueError("LoRA adapters are served for Llama-architecture models only")
        if isinstance(self.model.linear, Fp8Linear):
            raise ValueError("LoRA adapters are not served on fp8-quantized weights")
        adapter = load_peft_adapter(name, folder, self.model.config, self.model.dtype, self.device)
        if self.adapters is None:
            model = self.model
            if not model.source_dir:
                raise ValueError("LoRA needs the model's checkpoint folder (its weights are stacked with the adapters')")
            quantized = getattr(model.linear, "quantized_weights", False)  # gguf / int8: no dense base to stack
            self.adapters = LoraSet(model.config, model.dtype, self.device, model.linear,
                                    None if quantized else lambda: fused_base_weights(model.source_dir, model.config))
        self.adapters.add(adapter)
        self._capture_lora_graphs()

    def _capture_lora_graphs(self) -> None:
        """Decode graphs over the adapters as loaded now; if capturing fails, steps with adapter rows run eagerly."""
        graphs, adapters = self.graphs, self.adapters
        if graphs is not None and graphs.captured and adapters is not None:
            self._try_capture("cuda_graph_lora_capture_failed", lambda: graphs.capture_lora(adapters))

    def _lora_rows(self, scheduled: Sequence[ScheduledRequest], requests: Mapping[str, Request], num_rows: int
                   ) -> LoraBatch | None:
        """The step's rows grouped by their request's adapter (entries' rows are contiguous, in order)."""
        assert self.adapters is not None
        spans = []
        row = 0
        for entry in scheduled:
            name = getattr(requests[entry.request_id], "adapter", "")
            if name:
                spans.append((name, row, row + entry.num_new_tokens))
            row += entry.num_new_tokens
        return self.adapters.batch(spans, num_rows)

    def _view(self, group: int, window: int, scheduled: Sequence[ScheduledRequest],
              decode_entries: Sequence[ScheduledRequest], chunks: Sequence[tuple[int, ScheduledRequest]],
              shared: dict) -> ForwardBatch:
        """The step over KV group ``group``'s tables: slots, paged queries, prefill contexts."""
        bs = self.block_size
        slots: list[int] = []
        for entry in scheduled:
            table = _table(entry, group)
            slots += [table[p // bs] * bs + p % bs for p in range(entry.start, entry.start + entry.num_new_tokens)]
        prefills = []
        for row, entry in chunks:
            end = entry.start + entry.num_new_tokens
            context = self._tensor(list(_table(entry, group)[: -(-end // bs)])) if entry.start > 0 else None
            prefills.append(PrefillSpan(row, entry.num_new_tokens, end, context))
        whole = self.model.attention.handles_prefill  # one call attends every row, else decode rows + SDPA spans
        return ForwardBatch(
            slot_mapping=self._tensor(slots),
            queries=self._paged_queries(scheduled, group, window) if whole else None,
            paged=self._paged_queries(decode_entries, group, window) if decode_entries and not whole else None,
            prefills=prefills,
            window=window,
            **shared,
        )

    def _paged_queries(self, entries: Sequence[ScheduledRequest], group: int = 0, window: int = 0) -> PagedQueries:
        """``entries`` (contiguous rows of the batch, in order) as paged queries over their block tables."""
        bs = self.block_size
        lengths = [e.start + e.num_new_tokens for e in entries]
        max_blocks = -(-max(lengths) // bs)
        table: list[int] = []
        starts = [0]
        for e, length in zip(entries, lengths):
            row = _table(e, group)[: -(-length // bs)]
            table += row
            table += [0] * (max_blocks - len(row))
            starts.append(starts[-1] + e.num_new_tokens)
        return PagedQueries(
            block_table=self._tensor(table).view(len(entries), max_blocks),
            context_lens=self._tensor(lengths),
            query_start=self._tensor(starts),
            num_tokens=starts[-1],
            max_query_len=max(e.num_new_tokens for e in entries),
            window=window,
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.long), self.device)


class Launched:
    """A step queued by ``TorchModelRunner.launch``: its samples (on the device until ``result``) and each request's
    row in them."""

    def __init__(self, sample: PendingSample, rows: dict[str, int]):
        self.sample = sample
        self.rows = rows

    def result(self) -> ExecuteResult:
        """Wait for the step's tokens."""
        out = self.sample.result()
        ids = list(self.rows)
        return ExecuteResult({rid: out.token_ids[i] for i, rid in enumerate(ids)},
                             {rid: lp for rid, lp in zip(ids, out.logprobs) if lp is not None})


def _table(entry: ScheduledRequest, group: int) -> tuple[int, ...]:
    return entry.block_ids if group == 0 else entry.other_block_ids[group - 1]

