"""The engine worker's proto boundary (engine.proto, common.proto) <-> engine types, both directions:
the gateway encodes its requests (``RequestSpec``) here and the worker decodes them, the worker encodes
outputs, the router decodes KV layouts. Nothing else converts these messages."""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.engine.grammar import Guided
from tokenfleet.engine.kv_transfer import (
    Handoff,
    KVChunkData,
    KVLayoutError,
    KVSource,
    KVTransferError,
    PrefillDone,
    PrefillEvent,
    PrefillStarted,
)
from tokenfleet.engine.output import RequestOutput, Resume, TokenLogprobs
from tokenfleet.engine.request import FinishReason, Priority
from tokenfleet.engine.request_spec import RequestSpec
from tokenfleet.engine.runner import KernelCheck
from tokenfleet.engine.sampling_params import SamplingParams
from tokenfleet.kvcache.layout import DTYPE_SIZES, KVLayout
from tokenfleet.kvcache.salt import SCOPE_CHARS
from tokenfleet.v1 import common_pb2, engine_pb2

_FINISH = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
_PRIORITY = {
    common_pb2.PRIORITY_UNSPECIFIED: Priority.INTERACTIVE,
    common_pb2.PRIORITY_INTERACTIVE: Priority.INTERACTIVE,
    common_pb2.PRIORITY_BATCH: Priority.BATCH,
}


_PRIORITY_TO_PROTO = {Priority.INTERACTIVE: common_pb2.PRIORITY_INTERACTIVE, Priority.BATCH: common_pb2.PRIORITY_BATCH}


def request_to_proto(spec: RequestSpec) -> engine_pb2.GenerateRequest:
    """A request for a worker's Generate (what placement adds, the prefill replica and a prefix source, the
    dispatcher sets on the message). The caller's own id travels in the call's metadata."""
    msg = engine_pb2.GenerateRequest(request_id=spec.id, prompt_token_ids=spec.prompt_token_ids,
                                     sampling=sampling_to_proto(spec.sampling_params),
                                     priority=_PRIORITY_TO_PROTO[Priority(spec.priority)], tenant=spec.tenant,
                                     cache_scope=spec.cache_scope, adapter=spec.adapter,
                                     conversation=spec.conversation, retention_ms=round(spec.retention_s * 1000))
    if spec.resume is not None:
        msg.resume.output_token_ids.extend(spec.resume.output_token_ids)
        msg.resume.text = spec.resume.text
    return msg


def request_from_proto(msg: engine_pb2.GenerateRequest | engine_pb2.PrefillRequest, request_id: str,
                       kv_source: KVSource | None = None, client_request_id: str = "") -> RequestSpec:
    """A worker's Generate or Prefill request as the engine takes it (ValueError -> INVALID_ARGUMENT)."""
    resumed = resume(msg.resume) if isinstance(msg, engine_pb2.GenerateRequest) else None
    generate = isinstance(msg, engine_pb2.GenerateRequest)
    adapter = msg.adapter if generate else ""
    return RequestSpec(list(msg.prompt_token_ids), sampling_params(msg.sampling), request_id, priority(msg.priority),
                       resume=resumed, tenant=msg.tenant, cache_scope=cache_scope(msg.cache_scope), adapter=adapter,
                       kv_source=kv_source, client_request_id=client_request_id,
                       conversation=msg.conversation if generate else "",
                       retention_s=msg.retention_ms / 1000 if generate else 0.0)


def prefill_request(msg: engine_pb2.GenerateRequest, held_block_hashes: Sequence[bytes], layout: KVLayout
                    ) -> engine_pb2.PrefillRequest:
    """The decode side's Prefill call for a Generate that names a prefill replica."""
    return engine_pb2.PrefillRequest(
        request_id=msg.request_id, prompt_token_ids=msg.prompt_token_ids, sampling=msg.sampling,
        priority=msg.priority, held_block_hashes=list(held_block_hashes), layout=layout_to_proto(layout),
        cache_scope=msg.cache_scope, prefix_source=msg.prefix_source if msg.HasField("prefix_source") else None)


def sampling_params(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (-> INVALID_ARGUMENT) for invalid values."""
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        skip_special_tokens=not msg.keep_special_tokens,
        n=msg.n or 1,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        logit_bias=dict(msg.logit_bias),
        guided=guided(msg.guided) if msg.HasField("guided") else None,
        speculative=not msg.no_speculation,
    )


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    """The inverse of ``sampling_params`` (the gateway's request to a worker)."""
    msg = common_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=max(p.top_k, 0), min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, stop=list(p.stop), ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
    )
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.n != 1:
        msg.n = p.n
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    msg.logit_bias.update(dict(p.logit_bias))
    msg.no_speculation = not p.speculative
    if p.guided is not None:
        if p.guided.kind == "json_object":
            msg.guided.json_object = True
        else:
            setattr(msg.guided, p.guided.kind, p.guided.spec)
    return msg


def guided(msg: common_pb2.GuidedDecoding) -> Guided:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("guided decoding names no grammar")
    return Guided(kind, "" if kind == "json_object" else getattr(msg, kind))


def priority(value: int) -> int:
    if value not in _PRIORITY:
        raise ValueError(f"unknown priority {value}")
    return _PRIORITY[value]


def _logprob(lp: TokenLogprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def responses(out: RequestOutput) -> list[engine_pb2.GenerateResponse]:
    """A chunk for new tokens/text, then a final message when the request is done."""
    messages = []
    if out.new_token_ids or out.text:
        chunk = engine_pb2.TokenChunk(
            token_ids=out.new_token_ids, text=out.text, logprobs=[_logprob(lp) for lp in out.logprobs],
            index=out.index, prompt_logprobs=[_logprob(lp) for lp in out.prompt_logprobs],
        )
        messages.append(engine_pb2.GenerateResponse(chunk=chunk))
    if out.finished:
        final = engine_pb2.GenerateFinal(
            finish_reason=_FINISH.get(out.finish_reason, common_pb2.FINISH_REASON_UNSPECIFIED) if out.finish_reason
            else common_pb2.FINISH_REASON_UNSPECIFIED,
            usage=common_pb2.Usage(
                prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                cached_prompt_tokens=out.num_cached_tokens, retained_bytes=out.retained_bytes,
            ),
            request_id=out.request_id,
            index=out.index,
        )
        if isinstance(out.stop_reason, str):
            final.stop_string = out.stop_reason
        elif isinstance(out.stop_reason, int):
            final.stop_token_id = out.stop_reason
        messages.append(engine_pb2.GenerateResponse(final=final))
    return messages


def resume(msg: engine_pb2.ResumeState) -> Resume | None:
    return Resume(tuple(msg.output_token_ids), msg.text) if msg.output_token_ids else None


def kernel_check_to_proto(check: KernelCheck) -> engine_pb2.KernelCheck:
    return engine_pb2.KernelCheck(kernel=check.kernel, implementation=check.implementation, passed=check.passed,
                                  max_error=check.max_error, tolerance=check.tolerance, seconds=check.seconds,
                                  detail=check.detail, serving=check.serving)


def layout_to_proto(layout: KVLayout) -> engine_pb2.KVLayout:
    return engine_pb2.KVLayout(hash_salt=layout.hash_salt, dtype=layout.dtype, block_size=layout.block_size,
                               num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim, layer_windows=layout.layer_windows)


def layout_from_proto(msg: engine_pb2.KVLayout) -> KVLayout:
    opaque = msg.num_layers == 0  # a backend whose blocks never travel raw (TensorRT-LLM): any dtype tag
    if not (msg.dtype in DTYPE_SIZES or opaque and msg.dtype) or msg.block_size == 0:
        raise KVLayoutError(f"invalid KV layout: dtype {msg.dtype!r}, block size {msg.block_size}")
    return KVLayout(msg.hash_salt, msg.dtype, msg.block_size, msg.num_layers, msg.num_kv_heads, msg.head_dim,
                    tuple(msg.layer_windows))


def _logprob_from(msg: common_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, msg.rank, tuple((t.token_id, t.logprob) for t in msg.top))


def prefill_response(event: PrefillEvent) -> engine_pb2.PrefillResponse:
    if isinstance(event, PrefillStarted):
        started = engine_pb2.PrefillStarted(token_id=event.token_id, num_cached_tokens=event.num_cached_tokens,
                                            first_block=event.first_block, num_blocks=event.num_blocks,
                                            num_chunks=event.num_chunks)
        if event.logprobs is not None:
            started.logprob.CopyFrom(_logprob(event.logprobs))
        return engine_pb2.PrefillResponse(started=started)
    if isinstance(event, KVChunkData):
        return engine_pb2.PrefillResponse(kv=engine_pb2.KVChunk(
            seq=event.seq, layer=event.layer, first_block=event.first_block, num_blocks=event.num_blocks,
            k=event.k, v=event.v))
    if isinstance(event, Handoff):
        return engine_pb2.PrefillResponse(handoff=event.payload)
    return engine_pb2.PrefillResponse(done=engine_pb2.PrefillDone(num_bytes=event.num_bytes))


def prefill_event(msg: engine_pb2.PrefillResponse) -> PrefillEvent:
    kind = msg.WhichOneof("kind")
    if kind == "started":
        s = msg.started
        return PrefillStarted(s.token_id, _logprob_from(s.logprob) if s.HasField("logprob") else None,
                              s.num_cached_tokens, s.first_block, s.num_blocks, s.num_chunks)
    if kind == "kv":
        c = msg.kv
        return KVChunkData(c.seq, c.layer, c.first_block, c.num_blocks, c.k, c.v)
    if kind == "handoff":
        return Handoff(msg.handoff)
    if kind == "done":
        return PrefillDone(msg.done.num_bytes)
    raise KVTransferError("empty PrefillResponse")


def cache_scope(value: str) -> str:
    """A request's cache scope as sent (a digest, tokenfleet.kvcache.salt); ValueError when it cannot be one."""
    if len(value) > 2 * SCOPE_CHARS or not value.isascii():
        raise ValueError(f"cache_scope must be at most {2 * SCOPE_CHARS} ASCII characters")
    return value
