from tokenfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_SERVING: WorkerState
WORKER_STATE_DRAINING: WorkerState

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "prefill", "resume", "tenant", "ttft_objective_ms", "cache_scope", "prefix_source", "adapter", "heartbeat_ms", "conversation", "retention_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TTFT_OBJECTIVE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    RETENTION_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: _common_pb2.Priority
    prefill: PrefillSource
    resume: ResumeState
    tenant: str
    ttft_objective_ms: int
    cache_scope: str
    prefix_source: PrefixSource
    adapter: str
    heartbeat_ms: int
    conversation: str
    retention_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., prefill: _Optional[_Union[PrefillSource, _Mapping]] = ..., resume: _Optional[_Union[ResumeState, _Mapping]] = ..., tenant: _Optional[str] = ..., ttft_objective_ms: _Optional[int] = ..., cache_scope: _Optional[str] = ..., prefix_source: _Optional[_Union[PrefixSource, _Mapping]] = ..., adapter: _Optional[str] = ..., heartbeat_ms: _Optional[int] = ..., conversation: _Optional[str] = ..., retention_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("conversation",)
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    conversation: str
    def __init__(self, conversation: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class PrefixSource(_message.Message):
    __slots__ = ("replica_id", "address", "num_blocks")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    num_blocks: int
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "layout", "request_id")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layout: KVLayout
    request_id: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class FetchBlocksResponse(_message.Message):
    __slots__ = ("block_hash", "data")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    data: bytes
    def __init__(self, block_hash: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PrefillSource(_message.Message):
    __slots__ = ("replica_id", "address")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ResumeState(_message.Message):
    __slots__ = ("output_token_ids", "text")
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("hash_salt", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "layer_windows")
    HASH_SALT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYER_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    hash_salt: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_windows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hash_salt: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layer_windows: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "held_block_hashes", "layout", "tenant", "cache_scope", "prefix_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: _common_pb2.Priority
    held_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layout: KVLayout
    tenant: str
    cache_scope: str
    prefix_source: PrefixSource
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., held_block_hashes: _Optional[_Iterable[bytes]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., tenant: _Optional[str] = ..., cache_scope: _Optional[str] = ..., prefix_source: _Optional[_Union[PrefixSource, _Mapping]] = ...) -> None: ...

class PrefillStarted(_message.Message):
    __slots__ = ("token_id", "logprob", "num_cached_tokens", "first_block", "num_blocks", "num_chunks")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _common_pb2.TokenLogprob
    num_cached_tokens: int
    first_block: int
    num_blocks: int
    num_chunks: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("seq", "layer", "first_block", "num_blocks", "k", "v")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    seq: int
    layer: int
    first_block: int
    num_blocks: int
    k: bytes
    v: bytes
    def __init__(self, seq: _Optional[int] = ..., layer: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("started", "kv", "handoff", "done")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    started: PrefillStarted
    kv: KVChunk
    handoff: bytes
    done: PrefillDone
    def __init__(self, started: _Optional[_Union[PrefillStarted, _Mapping]] = ..., kv: _Optional[_Union[KVChunk, _Mapping]] = ..., handoff: _Optional[bytes] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "index", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "stop_string", "stop_token_id", "usage", "request_id", "index")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    stop_string: str
    stop_token_id: int
    usage: _common_pb2.Usage
    request_id: str
    index: int
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "final", "error", "alive")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    final: GenerateFinal
    error: _common_pb2.ErrorDetail
    alive: Alive
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.ErrorDetail, _Mapping]] = ..., alive: _Optional[_Union[Alive, _Mapping]] = ...) -> None: ...

class Alive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("state", "num_waiting", "num_running", "num_blocks_used", "num_blocks_free", "num_in_flight", "num_prefix_hit_tokens", "num_preemptions", "num_aborted", "num_steps", "ttft_ms_recent", "tpot_ms_recent", "step_ms_mean", "num_queued_prompt_tokens", "prefill_tokens_per_s", "hashes_reset", "added_block_hashes", "removed_block_hashes", "added_tier_block_hashes", "removed_tier_block_hashes", "layout", "num_prompt_tokens_computed", "num_kv_blocks_sent", "num_kv_blocks_received", "num_remote_prefills", "num_kv_bytes_received", "num_forks", "num_fork_shared_blocks", "num_block_copies", "num_tier_hit_blocks", "num_tier_stored_blocks", "num_tier_dropped_blocks", "num_tier_corrupt_blocks", "tier_bytes_used", "tier_bytes_written", "tier_bytes_read", "tier_restore_seconds", "num_peer_blocks_received", "num_peer_blocks_served", "num_peer_fetch_failures", "num_spec_proposed_tokens", "num_spec_accepted_tokens", "num_spec_verifications", "num_spec_steps", "spec_step_seconds", "num_plain_decode_steps", "plain_decode_step_seconds", "adapters", "busy_seconds", "model_flops", "model_bytes", "peak_flops", "peak_bytes_per_s", "kernel_checks", "num_retention_releases", "num_retention_expiries", "num_retained_evicted_blocks", "num_retained_demoted_blocks", "num_prefetched_blocks", "num_prefetch_hit_blocks", "num_retained_blocks", "retained_bytes_per_tenant")
    class RetainedBytesPerTenantEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_RECENT_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_RECENT_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_MEAN_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    HASHES_RESET_FIELD_NUMBER: _ClassVar[int]
    ADDED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    ADDED_TIER_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_TIER_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_FORKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FORK_SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TIER_CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    TIER_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    TIER_RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PEER_BLOCKS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_PEER_BLOCKS_SERVED_FIELD_NUMBER: _ClassVar[int]
    NUM_PEER_FETCH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_VERIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PLAIN_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_DECODE_STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FLOPS_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_FIELD_NUMBER: _ClassVar[int]
    PEAK_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    KERNEL_CHECKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RETENTION_RELEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_RETENTION_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_RETAINED_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RETAINED_DEMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFETCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFETCH_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RETAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RETAINED_BYTES_PER_TENANT_FIELD_NUMBER: _ClassVar[int]
    state: WorkerState
    num_waiting: int
    num_running: int
    num_blocks_used: int
    num_blocks_free: int
    num_in_flight: int
    num_prefix_hit_tokens: int
    num_preemptions: int
    num_aborted: int
    num_steps: int
    ttft_ms_recent: float
    tpot_ms_recent: float
    step_ms_mean: float
    num_queued_prompt_tokens: int
    prefill_tokens_per_s: float
    hashes_reset: bool
    added_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    removed_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    added_tier_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    removed_tier_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layout: KVLayout
    num_prompt_tokens_computed: int
    num_kv_blocks_sent: int
    num_kv_blocks_received: int
    num_remote_prefills: int
    num_kv_bytes_received: int
    num_forks: int
    num_fork_shared_blocks: int
    num_block_copies: int
    num_tier_hit_blocks: int
    num_tier_stored_blocks: int
    num_tier_dropped_blocks: int
    num_tier_corrupt_blocks: int
    tier_bytes_used: int
    tier_bytes_written: int
    tier_bytes_read: int
    tier_restore_seconds: float
    num_peer_blocks_received: int
    num_peer_blocks_served: int
    num_peer_fetch_failures: int
    num_spec_proposed_tokens: int
    num_spec_accepted_tokens: int
    num_spec_verifications: int
    num_spec_steps: int
    spec_step_seconds: float
    num_plain_decode_steps: int
    plain_decode_step_seconds: float
    adapters: _containers.RepeatedScalarFieldContainer[str]
    busy_seconds: float
    model_flops: float
    model_bytes: float
    peak_flops: float
    peak_bytes_per_s: float
    kernel_checks: _containers.RepeatedCompositeFieldContainer[KernelCheck]
    num_retention_releases: int
    num_retention_expiries: int
    num_retained_evicted_blocks: int
    num_retained_demoted_blocks: int
    num_prefetched_blocks: int
    num_prefetch_hit_blocks: int
    num_retained_blocks: int
    retained_bytes_per_tenant: _containers.ScalarMap[str, int]
    def __init__(self, state: _Optional[_Union[WorkerState, str]] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., num_blocks_free: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., num_prefix_hit_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_aborted: _Optional[int] = ..., num_steps: _Optional[int] = ..., ttft_ms_recent: _Optional[float] = ..., tpot_ms_recent: _Optional[float] = ..., step_ms_mean: _Optional[float] = ..., num_queued_prompt_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., hashes_reset: _Optional[bool] = ..., added_block_hashes: _Optional[_Iterable[bytes]] = ..., removed_block_hashes: _Optional[_Iterable[bytes]] = ..., added_tier_block_hashes: _Optional[_Iterable[bytes]] = ..., removed_tier_block_hashes: _Optional[_Iterable[bytes]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_prompt_tokens_computed: _Optional[int] = ..., num_kv_blocks_sent: _Optional[int] = ..., num_kv_blocks_received: _Optional[int] = ..., num_remote_prefills: _Optional[int] = ..., num_kv_bytes_received: _Optional[int] = ..., num_forks: _Optional[int] = ..., num_fork_shared_blocks: _Optional[int] = ..., num_block_copies: _Optional[int] = ..., num_tier_hit_blocks: _Optional[int] = ..., num_tier_stored_blocks: _Optional[int] = ..., num_tier_dropped_blocks: _Optional[int] = ..., num_tier_corrupt_blocks: _Optional[int] = ..., tier_bytes_used: _Optional[int] = ..., tier_bytes_written: _Optional[int] = ..., tier_bytes_read: _Optional[int] = ..., tier_restore_seconds: _Optional[float] = ..., num_peer_blocks_received: _Optional[int] = ..., num_peer_blocks_served: _Optional[int] = ..., num_peer_fetch_failures: _Optional[int] = ..., num_spec_proposed_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ..., num_spec_verifications: _Optional[int] = ..., num_spec_steps: _Optional[int] = ..., spec_step_seconds: _Optional[float] = ..., num_plain_decode_steps: _Optional[int] = ..., plain_decode_step_seconds: _Optional[float] = ..., adapters: _Optional[_Iterable[str]] = ..., busy_seconds: _Optional[float] = ..., model_flops: _Optional[float] = ..., model_bytes: _Optional[float] = ..., peak_flops: _Optional[float] = ..., peak_bytes_per_s: _Optional[float] = ..., kernel_checks: _Optional[_Iterable[_Union[KernelCheck, _Mapping]]] = ..., num_retention_releases: _Optional[int] = ..., num_retention_expiries: _Optional[int] = ..., num_retained_evicted_blocks: _Optional[int] = ..., num_retained_demoted_blocks: _Optional[int] = ..., num_prefetched_blocks: _Optional[int] = ..., num_prefetch_hit_blocks: _Optional[int] = ..., num_retained_blocks: _Optional[int] = ..., retained_bytes_per_tenant: _Optional[_Mapping[str, int]] = ...) -> None: ...

class KernelCheck(_message.Message):
    __slots__ = ("kernel", "implementation", "passed", "max_error", "tolerance", "seconds", "detail", "serving")
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    IMPLEMENTATION_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    MAX_ERROR_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    kernel: str
    implementation: str
    passed: bool
    max_error: float
    tolerance: str
    seconds: float
    detail: str
    serving: str
    def __init__(self, kernel: _Optional[str] = ..., implementation: _Optional[str] = ..., passed: _Optional[bool] = ..., max_error: _Optional[float] = ..., tolerance: _Optional[str] = ..., seconds: _Optional[float] = ..., detail: _Optional[str] = ..., serving: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("num_drained",)
    NUM_DRAINED_FIELD_NUMBER: _ClassVar[int]
    num_drained: int
    def __init__(self, num_drained: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapters: _Optional[_Iterable[str]] = ...) -> None: ...
