from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATUS_UNSPECIFIED: _ClassVar[ModelStatus]
    MODEL_STATUS_READY: _ClassVar[ModelStatus]
    MODEL_STATUS_DISABLED: _ClassVar[ModelStatus]
MODEL_STATUS_UNSPECIFIED: ModelStatus
MODEL_STATUS_READY: ModelStatus
MODEL_STATUS_DISABLED: ModelStatus

class ModelRecord(_message.Message):
    __slots__ = ("name", "version", "path", "architecture", "dtype", "quantization", "backend", "tensor_parallel_size", "tokenizer", "max_model_len", "default_sampling", "status", "created_at", "description", "tool_format", "speculative_config", "base", "kv_cache_dtype", "numerics")
    class DefaultSamplingEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    path: str
    architecture: str
    dtype: str
    quantization: str
    backend: str
    tensor_parallel_size: int
    tokenizer: str
    max_model_len: int
    default_sampling: _containers.ScalarMap[str, float]
    status: ModelStatus
    created_at: float
    description: str
    tool_format: str
    speculative_config: str
    base: str
    kv_cache_dtype: str
    numerics: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., path: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., backend: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., tokenizer: _Optional[str] = ..., max_model_len: _Optional[int] = ..., default_sampling: _Optional[_Mapping[str, float]] = ..., status: _Optional[_Union[ModelStatus, str]] = ..., created_at: _Optional[float] = ..., description: _Optional[str] = ..., tool_format: _Optional[str] = ..., speculative_config: _Optional[str] = ..., base: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., numerics: _Optional[str] = ...) -> None: ...

class Alias(_message.Message):
    __slots__ = ("alias", "target", "canary", "canary_weight", "route")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    CANARY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    alias: str
    target: str
    canary: str
    canary_weight: float
    route: str
    def __init__(self, alias: _Optional[str] = ..., target: _Optional[str] = ..., canary: _Optional[str] = ..., canary_weight: _Optional[float] = ..., route: _Optional[str] = ...) -> None: ...

class RegisterModelRequest(_message.Message):
    __slots__ = ("record",)
    RECORD_FIELD_NUMBER: _ClassVar[int]
    record: ModelRecord
    def __init__(self, record: _Optional[_Union[ModelRecord, _Mapping]] = ...) -> None: ...

class RegisterModelResponse(_message.Message):
    __slots__ = ("record", "created")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    record: ModelRecord
    created: bool
    def __init__(self, record: _Optional[_Union[ModelRecord, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: str
    def __init__(self, ref: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegistrySnapshot(_message.Message):
    __slots__ = ("models", "aliases")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelRecord]
    aliases: _containers.RepeatedCompositeFieldContainer[Alias]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelRecord, _Mapping]]] = ..., aliases: _Optional[_Iterable[_Union[Alias, _Mapping]]] = ...) -> None: ...

class SetAliasRequest(_message.Message):
    __slots__ = ("alias", "target", "canary", "canary_weight", "route")
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    CANARY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    alias: str
    target: str
    canary: str
    canary_weight: float
    route: str
    def __init__(self, alias: _Optional[str] = ..., target: _Optional[str] = ..., canary: _Optional[str] = ..., canary_weight: _Optional[float] = ..., route: _Optional[str] = ...) -> None: ...

class SetAliasResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteAliasRequest(_message.Message):
    __slots__ = ("alias",)
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    alias: str
    def __init__(self, alias: _Optional[str] = ...) -> None: ...

class DeleteAliasResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetModelStatusRequest(_message.Message):
    __slots__ = ("ref", "status")
    REF_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ref: str
    status: ModelStatus
    def __init__(self, ref: _Optional[str] = ..., status: _Optional[_Union[ModelStatus, str]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PinNumericsRequest(_message.Message):
    __slots__ = ("ref", "numerics")
    REF_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    ref: str
    numerics: str
    def __init__(self, ref: _Optional[str] = ..., numerics: _Optional[str] = ...) -> None: ...
