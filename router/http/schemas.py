"""Pydantic models of the HTTP API's responses, in OpenAI's shapes (the fields clients read; null where OpenAI sends
null). Requests are parsed by router/openai_body.py, the translation batch lines share."""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, Field

Item = TypeVar("Item")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens restored from the shard's prefix cache instead of prefilled


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # chat: the reply's leading <think> block, markers included (common.proto Usage)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    # On a request's whole usage; None on continuous_usage_stats' running counts, which cannot split them yet.
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class Function(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: Function


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str


class ToolCallDelta(BaseModel):
    """A piece of a streamed call, as OpenAI streams them: id, type and name on the call's first chunk only, then
    arguments text to append (null fields are left out of the chunk)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Message(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: Message
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class CompletionHead(BaseModel):
    """What every completion object and chunk opens with; each kind fixes its `object`."""

    id: str
    object: str
    created: int
    model: str


class ChatCompletion(CompletionHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(CompletionHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = None


class LegacyLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # an echoed prompt's first token: None (nothing before it to score it by)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: LegacyLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's extension, asked with prompt_logprobs: None first, then {token id: {logprob, rank, decoded_token}}
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class Completion(CompletionHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kimiserve"
    model_type: str
    max_model_len: int  # the longest prompt + completion every shard can serve (as ListModels reports it)
    vocab_size: int


class TokenizeResponse(BaseModel):
    """vLLM's /tokenize reply."""

    count: int
    max_model_len: int  # as /v1/models reports it: a client compares count against it
    tokens: list[int]
    token_strs: list[str] | None = None  # asked with return_token_strs; left out of the reply otherwise


class DetokenizeResponse(BaseModel):
    prompt: str


class ListOf(BaseModel, Generic[Item]):
    """OpenAI's list object."""

    object: Literal["list"] = "list"
    data: list[Item]


ModelList = ListOf[ModelCard]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"  # stored whole on upload: nothing is processed later
    expires_at: int | None = None  # files are kept until deleted


class Page(ListOf[Item], Generic[Item]):
    """One page of a list endpoint (files, batches), continued with `after` = last_id."""

    first_id: str | None = None
    last_id: str | None = None
    has_more: bool

    @classmethod
    def of(cls, data: list[Item], has_more: bool) -> Page[Item]:
        return cls(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                   has_more=has_more)


FileList = Page[FileObject]


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchErrorItem(BaseModel):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


BatchErrors = ListOf[BatchErrorItem]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


BatchList = Page[BatchObject]
