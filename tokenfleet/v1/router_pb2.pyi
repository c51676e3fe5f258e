from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Policy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_UNSPECIFIED: _ClassVar[Policy]
    POLICY_LEAST_LOADED: _ClassVar[Policy]
    POLICY_ROUND_ROBIN: _ClassVar[Policy]
    POLICY_PREFIX_AWARE: _ClassVar[Policy]
POLICY_UNSPECIFIED: Policy
POLICY_LEAST_LOADED: Policy
POLICY_ROUND_ROBIN: Policy
POLICY_PREFIX_AWARE: Policy

class PickRequest(_message.Message):
    __slots__ = ("model", "request_id", "num_prompt_tokens", "policy", "exclude_replica_ids", "prompt_token_ids", "colocated", "cache_scope", "adapter", "spare_only", "conversation")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SPARE_ONLY_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    model: str
    request_id: str
    num_prompt_tokens: int
    policy: Policy
    exclude_replica_ids: _containers.RepeatedScalarFieldContainer[str]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    colocated: bool
    cache_scope: str
    adapter: str
    spare_only: bool
    conversation: str
    def __init__(self, model: _Optional[str] = ..., request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., policy: _Optional[_Union[Policy, str]] = ..., exclude_replica_ids: _Optional[_Iterable[str]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., colocated: _Optional[bool] = ..., cache_scope: _Optional[str] = ..., adapter: _Optional[str] = ..., spare_only: _Optional[bool] = ..., conversation: _Optional[str] = ...) -> None: ...

class PickResponse(_message.Message):
    __slots__ = ("replica_id", "address", "model", "model_version", "prefill_replica_id", "prefill_address", "cached_prompt_tokens", "prefix_replica_id", "prefix_address", "prefix_blocks")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    model: str
    model_version: str
    prefill_replica_id: str
    prefill_address: str
    cached_prompt_tokens: int
    prefix_replica_id: str
    prefix_address: str
    prefix_blocks: int
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., model_version: _Optional[str] = ..., prefill_replica_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., cached_prompt_tokens: _Optional[int] = ..., prefix_replica_id: _Optional[str] = ..., prefix_address: _Optional[str] = ..., prefix_blocks: _Optional[int] = ...) -> None: ...
