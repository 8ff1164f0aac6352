from kimiserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("model", "token_ids", "keep_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    keep_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., keep_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class TokenBytesRequest(_message.Message):
    __slots__ = ("model", "token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenBytesResponse(_message.Message):
    __slots__ = ("token_bytes",)
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_bytes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, token_bytes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RenderChatRequest(_message.Message):
    __slots__ = ("model", "messages", "tools", "add_generation_prompt", "continue_final_message", "cache_salt")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[_common_pb2.Tool]
    add_generation_prompt: bool
    continue_final_message: bool
    cache_salt: str
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[_common_pb2.Tool, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class RenderChatResponse(_message.Message):
    __slots__ = ("prompt", "token_ids", "message_ends")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ENDS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    message_ends: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., message_ends: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeStreamRequest(_message.Message):
    __slots__ = ("model", "keep_special_tokens", "token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    keep_special_tokens: bool
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., keep_special_tokens: _Optional[bool] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeStreamResponse(_message.Message):
    __slots__ = ("text", "final")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    text: str
    final: bool
    def __init__(self, text: _Optional[str] = ..., final: _Optional[bool] = ...) -> None: ...

class TokenizerInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class SpecialToken(_message.Message):
    __slots__ = ("id", "content")
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    id: int
    content: str
    def __init__(self, id: _Optional[int] = ..., content: _Optional[str] = ...) -> None: ...

class TokenizerInfoResponse(_message.Message):
    __slots__ = ("model", "model_type", "vocab_size", "special_tokens", "eos_token_ids", "bos_token_id", "chat_template_source", "chat_template_sha256", "tokenizer_source")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_SHA256_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SOURCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_type: str
    vocab_size: int
    special_tokens: _containers.RepeatedCompositeFieldContainer[SpecialToken]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    chat_template_source: str
    chat_template_sha256: str
    tokenizer_source: str
    def __init__(self, model: _Optional[str] = ..., model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., special_tokens: _Optional[_Iterable[_Union[SpecialToken, _Mapping]]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., chat_template_source: _Optional[str] = ..., chat_template_sha256: _Optional[str] = ..., tokenizer_source: _Optional[str] = ...) -> None: ...
