from kimiserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_ERROR_CODE_UNSPECIFIED: _ClassVar[ShardErrorCode]
    SHARD_ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ShardErrorCode]
    SHARD_ERROR_CODE_ALREADY_EXISTS: _ClassVar[ShardErrorCode]
    SHARD_ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ShardErrorCode]
    SHARD_ERROR_CODE_INTERNAL: _ClassVar[ShardErrorCode]
    SHARD_ERROR_CODE_UNAVAILABLE: _ClassVar[ShardErrorCode]
SHARD_ERROR_CODE_UNSPECIFIED: ShardErrorCode
SHARD_ERROR_CODE_INVALID_ARGUMENT: ShardErrorCode
SHARD_ERROR_CODE_ALREADY_EXISTS: ShardErrorCode
SHARD_ERROR_CODE_RESOURCE_EXHAUSTED: ShardErrorCode
SHARD_ERROR_CODE_INTERNAL: ShardErrorCode
SHARD_ERROR_CODE_UNAVAILABLE: ShardErrorCode

class ShardRequest(_message.Message):
    __slots__ = ("submit", "cancel")
    class Submit(_message.Message):
        __slots__ = ("request_id", "prompt_token_ids", "sampling", "max_tokens", "trace_context", "cache_salt", "message_boundaries", "prior_output_tokens", "movable", "imported_state")
        class TraceContextEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: str
            def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
        REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
        PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        SAMPLING_FIELD_NUMBER: _ClassVar[int]
        MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
        TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
        CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
        MESSAGE_BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
        PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
        MOVABLE_FIELD_NUMBER: _ClassVar[int]
        IMPORTED_STATE_FIELD_NUMBER: _ClassVar[int]
        request_id: str
        prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
        sampling: _common_pb2.SamplingParams
        max_tokens: int
        trace_context: _containers.ScalarMap[str, str]
        cache_salt: str
        message_boundaries: _containers.RepeatedScalarFieldContainer[int]
        prior_output_tokens: int
        movable: bool
        imported_state: bool
        def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., cache_salt: _Optional[str] = ..., message_boundaries: _Optional[_Iterable[int]] = ..., prior_output_tokens: _Optional[int] = ..., movable: _Optional[bool] = ..., imported_state: _Optional[bool] = ...) -> None: ...
    class Cancel(_message.Message):
        __slots__ = ("request_id",)
        REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
        request_id: str
        def __init__(self, request_id: _Optional[str] = ...) -> None: ...
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    submit: ShardRequest.Submit
    cancel: ShardRequest.Cancel
    def __init__(self, submit: _Optional[_Union[ShardRequest.Submit, _Mapping]] = ..., cancel: _Optional[_Union[ShardRequest.Cancel, _Mapping]] = ...) -> None: ...

class ShardEvent(_message.Message):
    __slots__ = ("request_id", "token", "finished", "error", "moved")
    class Token(_message.Message):
        __slots__ = ("token_id", "index", "logprob", "cached_prompt_tokens", "top_logprobs", "prompt_logprobs")
        TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
        INDEX_FIELD_NUMBER: _ClassVar[int]
        LOGPROB_FIELD_NUMBER: _ClassVar[int]
        CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
        TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
        PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
        token_id: int
        index: int
        logprob: float
        cached_prompt_tokens: int
        top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprob]
        prompt_logprobs: _common_pb2.PromptLogprobs
        def __init__(self, token_id: _Optional[int] = ..., index: _Optional[int] = ..., logprob: _Optional[float] = ..., cached_prompt_tokens: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...
    class Timing(_message.Message):
        __slots__ = ("queue_seconds", "prefill_seconds", "time_to_first_token_seconds", "decode_seconds", "duration_seconds", "prefill_passes")
        QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
        PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
        TIME_TO_FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
        DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
        DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
        PREFILL_PASSES_FIELD_NUMBER: _ClassVar[int]
        queue_seconds: float
        prefill_seconds: float
        time_to_first_token_seconds: float
        decode_seconds: float
        duration_seconds: float
        prefill_passes: int
        def __init__(self, queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., time_to_first_token_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., duration_seconds: _Optional[float] = ..., prefill_passes: _Optional[int] = ...) -> None: ...
    class Finished(_message.Message):
        __slots__ = ("finish_reason", "usage", "error_message", "timing")
        FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
        USAGE_FIELD_NUMBER: _ClassVar[int]
        ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
        TIMING_FIELD_NUMBER: _ClassVar[int]
        finish_reason: _common_pb2.FinishReason
        usage: _common_pb2.Usage
        error_message: str
        timing: ShardEvent.Timing
        def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error_message: _Optional[str] = ..., timing: _Optional[_Union[ShardEvent.Timing, _Mapping]] = ...) -> None: ...
    class Error(_message.Message):
        __slots__ = ("code", "message", "param")
        CODE_FIELD_NUMBER: _ClassVar[int]
        MESSAGE_FIELD_NUMBER: _ClassVar[int]
        PARAM_FIELD_NUMBER: _ClassVar[int]
        code: ShardErrorCode
        message: str
        param: str
        def __init__(self, code: _Optional[_Union[ShardErrorCode, str]] = ..., message: _Optional[str] = ..., param: _Optional[str] = ...) -> None: ...
    class Moved(_message.Message):
        __slots__ = ("computed_tokens", "state_bytes")
        COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
        STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
        computed_tokens: int
        state_bytes: int
        def __init__(self, computed_tokens: _Optional[int] = ..., state_bytes: _Optional[int] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: ShardEvent.Token
    finished: ShardEvent.Finished
    error: ShardEvent.Error
    moved: ShardEvent.Moved
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[_Union[ShardEvent.Token, _Mapping]] = ..., finished: _Optional[_Union[ShardEvent.Finished, _Mapping]] = ..., error: _Optional[_Union[ShardEvent.Error, _Mapping]] = ..., moved: _Optional[_Union[ShardEvent.Moved, _Mapping]] = ...) -> None: ...

class ShardInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardCapacity(_message.Message):
    __slots__ = ("state_slots", "kv_blocks", "kv_block_size", "max_context_tokens", "max_step_tokens")
    STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    state_slots: int
    kv_blocks: int
    kv_block_size: int
    max_context_tokens: int
    max_step_tokens: int
    def __init__(self, state_slots: _Optional[int] = ..., kv_blocks: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., max_step_tokens: _Optional[int] = ...) -> None: ...

class ShardInfoResponse(_message.Message):
    __slots__ = ("model_name", "model_type", "vocab_size", "eos_token_ids", "capacity", "shard_id", "device")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_type: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    capacity: ShardCapacity
    shard_id: str
    device: str
    def __init__(self, model_name: _Optional[str] = ..., model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., capacity: _Optional[_Union[ShardCapacity, _Mapping]] = ..., shard_id: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class ShardLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardLoadResponse(_message.Message):
    __slots__ = ("queued_tokens", "running_seqs", "queued_seqs", "free_state_slots", "free_kv_blocks")
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SEQS_FIELD_NUMBER: _ClassVar[int]
    FREE_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    queued_tokens: int
    running_seqs: int
    queued_seqs: int
    free_state_slots: int
    free_kv_blocks: int
    def __init__(self, queued_tokens: _Optional[int] = ..., running_seqs: _Optional[int] = ..., queued_seqs: _Optional[int] = ..., free_state_slots: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ...) -> None: ...

class ShardHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardHealthResponse(_message.Message):
    __slots__ = ("device_op_ms",)
    DEVICE_OP_MS_FIELD_NUMBER: _ClassVar[int]
    device_op_ms: float
    def __init__(self, device_op_ms: _Optional[float] = ...) -> None: ...

class ExportStateRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SequenceStateHeader(_message.Message):
    __slots__ = ("request_id", "tokens", "model_type", "total_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    model_type: str
    total_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., model_type: _Optional[str] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class SequenceStateChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: SequenceStateHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[SequenceStateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImportStateResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    def __init__(self, tokens: _Optional[int] = ...) -> None: ...
