from kimiserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BatchStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BATCH_STATUS_UNSPECIFIED: _ClassVar[BatchStatus]
    BATCH_STATUS_VALIDATING: _ClassVar[BatchStatus]
    BATCH_STATUS_IN_PROGRESS: _ClassVar[BatchStatus]
    BATCH_STATUS_FINALIZING: _ClassVar[BatchStatus]
    BATCH_STATUS_COMPLETED: _ClassVar[BatchStatus]
    BATCH_STATUS_FAILED: _ClassVar[BatchStatus]
    BATCH_STATUS_EXPIRED: _ClassVar[BatchStatus]
    BATCH_STATUS_CANCELLING: _ClassVar[BatchStatus]
    BATCH_STATUS_CANCELLED: _ClassVar[BatchStatus]
BATCH_STATUS_UNSPECIFIED: BatchStatus
BATCH_STATUS_VALIDATING: BatchStatus
BATCH_STATUS_IN_PROGRESS: BatchStatus
BATCH_STATUS_FINALIZING: BatchStatus
BATCH_STATUS_COMPLETED: BatchStatus
BATCH_STATUS_FAILED: BatchStatus
BATCH_STATUS_EXPIRED: BatchStatus
BATCH_STATUS_CANCELLING: BatchStatus
BATCH_STATUS_CANCELLED: BatchStatus

class GenerateRequest(_message.Message):
    __slots__ = ("model", "text", "prompt_token_ids", "sampling", "request_id", "n", "cache_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    prompt_token_ids: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    request_id: str
    n: int
    cache_salt: str
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., n: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "error_message", "token_logprobs", "top_logprobs", "choice_index", "total_usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    error_message: str
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    choice_index: int
    total_usage: _common_pb2.Usage
    prompt_logprobs: _common_pb2.PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error_message: _Optional[str] = ..., token_logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., choice_index: _Optional[int] = ..., total_usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("model", "messages", "tools", "sampling", "request_id", "tool_choice", "n", "cache_salt", "parallel_tool_calls", "add_generation_prompt", "continue_final_message")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tool]
    sampling: _common_pb2.SamplingParams
    request_id: str
    tool_choice: ToolChoice
    n: int
    cache_salt: str
    parallel_tool_calls: bool
    add_generation_prompt: bool
    continue_final_message: bool
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[_common_pb2.Tool, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., n: _Optional[int] = ..., cache_salt: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function_name")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[ToolChoice.Mode]
        MODE_AUTO: _ClassVar[ToolChoice.Mode]
        MODE_NONE: _ClassVar[ToolChoice.Mode]
        MODE_REQUIRED: _ClassVar[ToolChoice.Mode]
        MODE_FUNCTION: _ClassVar[ToolChoice.Mode]
    MODE_UNSPECIFIED: ToolChoice.Mode
    MODE_AUTO: ToolChoice.Mode
    MODE_NONE: ToolChoice.Mode
    MODE_REQUIRED: ToolChoice.Mode
    MODE_FUNCTION: ToolChoice.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_NAME_FIELD_NUMBER: _ClassVar[int]
    mode: ToolChoice.Mode
    function_name: str
    def __init__(self, mode: _Optional[_Union[ToolChoice.Mode, str]] = ..., function_name: _Optional[str] = ...) -> None: ...

class ChatResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "tool_calls", "finish_reason", "usage", "error_message", "token_logprobs", "reasoning_text", "top_logprobs", "choice_index", "total_usage", "prompt_logprobs", "tool_call_deltas")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_DELTAS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    error_message: str
    token_logprobs: _containers.RepeatedScalarFieldContainer[float]
    reasoning_text: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    choice_index: int
    total_usage: _common_pb2.Usage
    prompt_logprobs: _common_pb2.PromptLogprobs
    tool_call_deltas: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error_message: _Optional[str] = ..., token_logprobs: _Optional[_Iterable[float]] = ..., reasoning_text: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., choice_index: _Optional[int] = ..., total_usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ..., tool_call_deltas: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("name", "model_type", "max_context_tokens", "vocab_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_type: str
    max_context_tokens: int
    vocab_size: int
    def __init__(self, name: _Optional[str] = ..., model_type: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class BatchRequestItem(_message.Message):
    __slots__ = ("custom_id", "generate", "chat")
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    custom_id: str
    generate: GenerateRequest
    chat: ChatRequest
    def __init__(self, custom_id: _Optional[str] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., chat: _Optional[_Union[ChatRequest, _Mapping]] = ...) -> None: ...

class BatchInlineRequests(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[BatchRequestItem]
    def __init__(self, requests: _Optional[_Iterable[_Union[BatchRequestItem, _Mapping]]] = ...) -> None: ...

class CreateBatchRequest(_message.Message):
    __slots__ = ("inline", "jsonl", "metadata", "completion_window_s", "max_concurrency")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INLINE_FIELD_NUMBER: _ClassVar[int]
    JSONL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    inline: BatchInlineRequests
    jsonl: str
    metadata: _containers.ScalarMap[str, str]
    completion_window_s: int
    max_concurrency: int
    def __init__(self, inline: _Optional[_Union[BatchInlineRequests, _Mapping]] = ..., jsonl: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., completion_window_s: _Optional[int] = ..., max_concurrency: _Optional[int] = ...) -> None: ...

class BatchRequestCounts(_message.Message):
    __slots__ = ("total", "completed", "failed")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    total: int
    completed: int
    failed: int
    def __init__(self, total: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class BatchUsage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class BatchError(_message.Message):
    __slots__ = ("code", "message", "line")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    line: int
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., line: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("id", "status", "request_counts", "usage", "metadata", "errors", "completion_window_s", "max_concurrency", "created_at_ms", "expires_at_ms", "in_progress_at_ms", "finalizing_at_ms", "completed_at_ms", "failed_at_ms", "expired_at_ms", "cancelling_at_ms", "cancelled_at_ms")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COUNTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    IN_PROGRESS_AT_MS_FIELD_NUMBER: _ClassVar[int]
    FINALIZING_AT_MS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    FAILED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    CANCELLING_AT_MS_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    id: str
    status: BatchStatus
    request_counts: BatchRequestCounts
    usage: BatchUsage
    metadata: _containers.ScalarMap[str, str]
    errors: _containers.RepeatedCompositeFieldContainer[BatchError]
    completion_window_s: int
    max_concurrency: int
    created_at_ms: int
    expires_at_ms: int
    in_progress_at_ms: int
    finalizing_at_ms: int
    completed_at_ms: int
    failed_at_ms: int
    expired_at_ms: int
    cancelling_at_ms: int
    cancelled_at_ms: int
    def __init__(self, id: _Optional[str] = ..., status: _Optional[_Union[BatchStatus, str]] = ..., request_counts: _Optional[_Union[BatchRequestCounts, _Mapping]] = ..., usage: _Optional[_Union[BatchUsage, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., errors: _Optional[_Iterable[_Union[BatchError, _Mapping]]] = ..., completion_window_s: _Optional[int] = ..., max_concurrency: _Optional[int] = ..., created_at_ms: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., in_progress_at_ms: _Optional[int] = ..., finalizing_at_ms: _Optional[int] = ..., completed_at_ms: _Optional[int] = ..., failed_at_ms: _Optional[int] = ..., expired_at_ms: _Optional[int] = ..., cancelling_at_ms: _Optional[int] = ..., cancelled_at_ms: _Optional[int] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class ListBatchesRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListBatchesResponse(_message.Message):
    __slots__ = ("batches", "next_page_token")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    batches: _containers.RepeatedCompositeFieldContainer[Batch]
    next_page_token: str
    def __init__(self, batches: _Optional[_Iterable[_Union[Batch, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelBatchRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class GetBatchResultsRequest(_message.Message):
    __slots__ = ("batch_id", "after_seq", "follow")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    after_seq: int
    follow: bool
    def __init__(self, batch_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class BatchResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "tool_calls", "reasoning_text")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    reasoning_text: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., reasoning_text: _Optional[str] = ...) -> None: ...

class BatchRequestError(_message.Message):
    __slots__ = ("code", "message", "param")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    param: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., param: _Optional[str] = ...) -> None: ...

class BatchResult(_message.Message):
    __slots__ = ("custom_id", "seq", "response", "error", "request_id")
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    custom_id: str
    seq: int
    response: BatchResponse
    error: BatchRequestError
    request_id: str
    def __init__(self, custom_id: _Optional[str] = ..., seq: _Optional[int] = ..., response: _Optional[_Union[BatchResponse, _Mapping]] = ..., error: _Optional[_Union[BatchRequestError, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...
