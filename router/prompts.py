"""From a Generate / Chat request to prompt token ids: the model check, tokenization or chat rendering. Shared by
the interactive RPCs and batch requests, so both validate and tokenize the same way."""

from __future__ import annotations

from kimiserve import limits
from kimiserve.chat_continuation import ContinuationError, check_final_message, generation_prompt
from kimiserve.v1 import router_pb2
from kimiserve.text import clip
from router.errors import InvalidArgument, NotFound
from router.generation import Generation

# Special tokens a chat reply shows: the tool-call markers (parsed into tool_calls) and the thinking markers.
PROMPT_FIELDS = {"text": "prompt", "prompt_token_ids": "prompt"}  # a GenerateRequest's prompt, as OpenAI names it
CHAT_VISIBLE_SPECIALS = frozenset({"<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                   "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                                   "<think>", "</think>"})


def chat_hidden_ids(info) -> frozenset[int]:
    """Ids returned in token_ids but never shown as text in a chat reply (end of turn, reserved tokens)."""
    return frozenset(t.id for t in info.special_tokens if t.content not in CHAT_VISIBLE_SPECIALS)


def check_model(gen: Generation, model: str) -> None:
    """Empty means the served model; any other name must be it (NOT_FOUND otherwise, as the proto says)."""
    served = gen.model_info().model_name
    if model and model != served:
        raise NotFound(f"model {clip(model)} is not served here; this router serves {served!r}")


def check_sizes(check, req) -> None:
    """The API's size limits (kimiserve/limits.py), before any rendering or tokenizing work; the error's param is the
    field as an OpenAI body names it ("stop" for sampling.stop[2], "prompt" for text)."""
    try:
        check(req)
    except limits.RequestTooLarge as e:
        field = e.field.removeprefix("sampling.").split(".")[0].split("[")[0]
        raise InvalidArgument(str(e), PROMPT_FIELDS.get(field, field)) from e


async def generate_prompt(gen: Generation, req: router_pb2.GenerateRequest) -> list[int]:
    check_sizes(limits.check_generate, req)
    check_model(gen, req.model)
    kind = req.WhichOneof("prompt")
    if kind == "text":
        if not req.text:
            raise InvalidArgument("empty prompt text", "prompt")
        return await gen.tokenizer.tokenize(req.text)
    if kind == "prompt_token_ids":
        return list(req.prompt_token_ids.ids)
    raise InvalidArgument("set either text or prompt_token_ids", "prompt")


async def chat_prompt(gen: Generation, req: router_pb2.ChatRequest,
                      cache_salt: str) -> tuple[list[int], tuple[int, ...]]:
    """The rendered prompt's ids and the offsets where its messages end; `cache_salt` (the request's whole salt,
    router/cache_salt.py) keys the tokenizer's cache of rendered pieces."""
    check_sizes(limits.check_chat, req)
    check_model(gen, req.model)
    if not req.messages:
        raise InvalidArgument("messages is empty", "messages")
    add = req.add_generation_prompt if req.HasField("add_generation_prompt") else None
    try:  # the tokenizer checks this too, but could not name the field to the client
        generation_prompt(add, req.continue_final_message)
        if req.continue_final_message:
            check_final_message(req.messages)
    except ContinuationError as e:
        raise InvalidArgument(str(e), e.field) from e
    return await gen.tokenizer.render_chat(req.messages, req.tools, cache_salt, add, req.continue_final_message)
