"""Limits on what one request may ask for, in one place, checked at the API edge (router) before any rendering or
tokenizing, and again where a service can be called directly (tokenizer, engine).

Each size limit bounds the work one request can cause before it is admitted: once the protobuf is parsed, the router
(and the tokenizer service, which can be called directly) only counts sizes here, in time linear in the request,
before anything is rendered, tokenized or queued. A request over a limit is refused with a `RequestTooLarge` naming
the field, the limit and the value, which each service answers INVALID_ARGUMENT. Every limit is documented on the
field it bounds in protos/kimiserve/v1/*.proto; change both together.

Sizes of messages and tools are their serialized protobuf size (what the client sent, computed by the protobuf
runtime without a copy); strings are counted in UTF-8 bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: chat_types imports this module, and training/ runs where protobuf is absent
    from google.protobuf.message import Message

# The router's gRPC receive limit (the gRPC default, kept explicit): a larger request is RESOURCE_EXHAUSTED from
# gRPC itself. Every limit below is smaller, so a request is refused by name before the transport limit is reached.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
# The router's receive limit on the tokenizer's replies: a rendered prompt within the limits below comes back as its
# text plus up to one token id (up to 3 bytes on the wire) per byte, beyond gRPC's default of 4 MiB.
MAX_TOKENIZER_REPLY_BYTES = 64 * 1024 * 1024
MAX_PROMPT_BYTES = 3 * 1024 * 1024  # GenerateRequest.text, UTF-8 bytes
MAX_PROMPT_TOKEN_IDS = 1 << 20  # GenerateRequest.prompt_token_ids (the context check then applies)
MAX_CHAT_MESSAGES = 4096  # ChatRequest.messages
MAX_CHAT_BYTES = 3 * 1024 * 1024  # ChatRequest.messages, all of them, serialized
MAX_TOOLS = 128  # ChatRequest.tools
MAX_TOOLS_BYTES = 512 * 1024  # ChatRequest.tools, all of them, serialized
MAX_STOP_STRINGS = 16  # SamplingParams.stop
MAX_STOP_STRING_BYTES = 1024  # each SamplingParams.stop string (matched against every text delta)
MAX_STOP_TOKEN_IDS = 256  # SamplingParams.stop_token_ids
# Temperatures above this are a uniform draw in all but name; NaN and inf are refused with everything above it.
MAX_TEMPERATURE = 100.0
# Request ids travel in gRPC metadata and in every log line: printable ASCII, bounded length.
MAX_REQUEST_ID_CHARS = 256
# OpenAI's ranges for the presence and frequency penalties: [-MAX_PENALTY, MAX_PENALTY].
MAX_PENALTY = 2.0
# Repetition penalty range (0, MAX_REPETITION_PENALTY]; 1 is off. Beyond 2 a repeated token is all but banned.
MAX_REPETITION_PENALTY = 2.0
# Alternatives per generated token (OpenAI's top_logprobs cap).
MAX_TOP_LOGPROBS = 20
# logit_bias: OpenAI's value range [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], and at most this many biased tokens a request.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
# Ids in one tokenizer TokenBytes call (the router asks for a long scored prompt's bytes in pieces of this size).
MAX_TOKEN_BYTES_IDS = 65_536
# Choices one request may fan out to (OpenAI's n; each is a sequence taking a shard slot), gRPC and HTTP alike.
MAX_N = 16
# Calls in one reply under tool_choice 'required' (ResponseFormat.tool_calls.max_calls): the grammar numbers the
# calls, so it spells out each position.
MAX_TOOL_CALLS = 16
# SamplingParams.response_format json_schema.schema or regex, UTF-8 bytes: the shard compiles it into a grammar.
MAX_RESPONSE_FORMAT_BYTES = 64 * 1024
# A json_schema's name, as OpenAI bounds it.
MAX_SCHEMA_NAME_CHARS = 64
# Nesting of JSON given as text (tool-call arguments, tools, parameter schemas, batch lines): deeper is refused
# before Python's recursive parser or a chat template's tojson could run out of stack.
MAX_JSON_DEPTH = 64
# Longest error text a service puts in a gRPC status; longer text is cut (status details travel in trailers,
# which gRPC bounds to a few KiB).
MAX_ERROR_CHARS = 2000


class RequestTooLarge(ValueError):
    """A request field is over its limit; the message names the field, the limit and the value."""

    def __init__(self, message: str, field: str):
        """field: the request field over its limit, as the proto names it ("sampling.stop[2]", "messages")."""
        super().__init__(message)
        self.field = field


class JsonTooDeep(ValueError):
    """JSON text nests deeper than MAX_JSON_DEPTH."""


def _over(field: str, value: int, limit: int, unit: str) -> RequestTooLarge:
    return RequestTooLarge(f"{field}: {value:,} {unit} is over the limit of {limit:,}", field)


def check_sampling(s: Message) -> None:
    """SamplingParams sizes: stop strings (count, bytes each), stop token ids (count), response_format text."""
    if len(s.stop) > MAX_STOP_STRINGS:
        raise _over("sampling.stop", len(s.stop), MAX_STOP_STRINGS, "stop strings")
    for i, stop in enumerate(s.stop):
        if (size := len(stop.encode("utf-8"))) > MAX_STOP_STRING_BYTES:
            raise _over(f"sampling.stop[{i}]", size, MAX_STOP_STRING_BYTES, "bytes")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _over("sampling.stop_token_ids", len(s.stop_token_ids), MAX_STOP_TOKEN_IDS, "ids")
    fmt = s.response_format
    kind = fmt.WhichOneof("kind") if s.HasField("response_format") else None
    text = fmt.json_schema.schema if kind == "json_schema" else fmt.regex if kind == "regex" else ""
    if (size := len(text.encode("utf-8"))) > MAX_RESPONSE_FORMAT_BYTES:
        field = "json_schema.schema" if kind == "json_schema" else kind
        raise _over(f"sampling.response_format.{field}", size, MAX_RESPONSE_FORMAT_BYTES, "bytes")


def check_generate(req: Message) -> None:
    """GenerateRequest: prompt size and sampling sizes."""
    kind = req.WhichOneof("prompt")
    if kind == "text" and (size := len(req.text.encode("utf-8"))) > MAX_PROMPT_BYTES:
        raise _over("text", size, MAX_PROMPT_BYTES, "bytes")
    if kind == "prompt_token_ids" and len(req.prompt_token_ids.ids) > MAX_PROMPT_TOKEN_IDS:
        raise _over("prompt_token_ids", len(req.prompt_token_ids.ids), MAX_PROMPT_TOKEN_IDS, "ids")
    check_sampling(req.sampling)


def check_chat_parts(messages: Sequence[Message], tools: Sequence[Message]) -> None:
    """Messages and tools of a ChatRequest or RenderChatRequest: counts first (O(1)), then serialized sizes."""
    if len(messages) > MAX_CHAT_MESSAGES:
        raise _over("messages", len(messages), MAX_CHAT_MESSAGES, "messages")
    if len(tools) > MAX_TOOLS:
        raise _over("tools", len(tools), MAX_TOOLS, "tools")
    if (size := sum(m.ByteSize() for m in messages)) > MAX_CHAT_BYTES:
        raise _over("messages", size, MAX_CHAT_BYTES, "bytes")
    if (size := sum(t.ByteSize() for t in tools)) > MAX_TOOLS_BYTES:
        raise _over("tools", size, MAX_TOOLS_BYTES, "bytes")


def check_chat(req: Message) -> None:
    """ChatRequest: messages, tools and sampling sizes."""
    check_chat_parts(req.messages, req.tools)
    check_sampling(req.sampling)


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, `[]` is 1), counted without recursion; stops counting
    once `limit` is passed, so the walk is linear in the value and never deeper than the stack."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def loads_json(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads, refusing nesting deeper than `max_depth` with JsonTooDeep (json.JSONDecodeError as json.loads).

    Python's parser recurses once per level and fails with RecursionError around 1,000 levels; that failure is
    reported as JsonTooDeep too, and anything it parsed is then walked to enforce the (much lower) limit."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonTooDeep(f"JSON nests deeper than the limit of {max_depth} levels") from None
    if (depth := json_depth(value, max_depth)) > max_depth:
        raise JsonTooDeep(f"JSON nests deeper than the limit of {max_depth} levels (at least {depth})")
    return value


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` cut to at most `limit` characters, saying how much was cut, for error messages built from input."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters cut)"
