"""OpenAI Responses request bodies (/v1/responses) -> the chat flow's request. Pure Python, no I/O.

A Responses request is a chat request in other words: `instructions` is a system message, `input` a string (one user
message) or a list of items (messages; the model's `function_call`s and the client's `function_call_output`s, which
the chat form carries as an assistant message's tool calls and tool messages), `max_output_tokens` is max_tokens,
`text.format` the response_format, and tools are flat (`{"type": "function", "name", "parameters"}`). So the body is
rewritten into a chat body and goes through openai_body.chat_request, the one translation every chat request takes,
after the Responses shapes are checked here, each problem a BodyError naming the Responses field. Which top-level
fields are honoured, ignored or refused: router/openai_fields.py (RESPONSES_*).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from kimiserve.v1 import router_pb2
from router import openai_body, openai_fields
from router.openai_body import BodyError, describe, present

HONOURED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
            "text", "stream", "stream_options", "include", "top_logprobs", "parallel_tool_calls"
            } | set(openai_fields.EXTENSIONS)
LOGPROBS = "message.output_text.logprobs"  # `include`: each output_text's tokens with logprobs
# `include`: reasoning items carry their text sealed in encrypted_content, so a client that keeps nothing but the
# items (store: false, as agent SDKs send it) can hand them back; this server reads its own seal (not encrypted:
# the text is in the item's content anyway), no other server's.
ENCRYPTED_REASONING = "reasoning.encrypted_content"
SEAL = "kimiserve-reasoning-v1."
MESSAGE_ROLES = {"user", "system", "developer", "assistant"}
TEXT_PARTS = {"input_text", "output_text"}  # a text part from the client, or one of the model's earlier replies


@dataclass(frozen=True)
class Echo:
    """What the response object repeats of its request (OpenAI's response carries these fields)."""

    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: Any
    text_format: dict[str, Any]
    metadata: dict[str, Any]
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class ResponsesOptions:
    stream: bool
    echo: Echo
    logprobs: bool = False  # include names LOGPROBS
    encrypted_reasoning: bool = False  # include names ENCRYPTED_REASONING


def responses_request(body: dict[str, Any]) -> tuple[router_pb2.ChatRequest, ResponsesOptions]:
    body = present(body)
    try:
        openai_fields.check(body, HONOURED, openai_fields.RESPONSES_RULES)
    except openai_fields.FieldError as e:
        raise BodyError(str(e), e.field) from None
    chat: dict[str, Any] = {k: body[k] for k in {"model", "temperature", "top_p", "stream", "parallel_tool_calls"}
                            | set(openai_fields.EXTENSIONS) if k in body}
    chat["messages"] = _instructions(body) + _messages(body.get("input"))
    if "max_output_tokens" in body:
        chat["max_tokens"] = _max_output_tokens(body["max_output_tokens"])
    text_format = _text(body.get("text", {}))
    chat["response_format"] = _response_format(text_format)
    tools = body.get("tools", [])
    if not isinstance(tools, list):
        raise BodyError(f"tools must be a list, got {describe(tools)}", "tools")
    chat["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    choice = body.get("tool_choice", "auto")
    chat["tool_choice"] = _tool_choice(choice)
    raw_options = body.get("stream_options", {})
    if not isinstance(raw_options, dict) or set(raw_options) - {"include_obfuscation"}:
        raise BodyError(f"stream_options may hold ['include_obfuscation'], got {describe(raw_options)}",
                        "stream_options")
    include = _include(body)
    chat.update(_logprobs(body, include))
    req, options = openai_body.chat_request(chat)
    metadata = body.get("metadata", {})
    echo = Echo(instructions=body.get("instructions"), max_output_tokens=chat.get("max_tokens"),
                temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                tools=[_flat_tool(t) for t in chat["tools"]], tool_choice=choice, text_format=text_format,
                metadata=metadata, parallel_tool_calls=chat.get("parallel_tool_calls", True))
    return req, ResponsesOptions(stream=options.stream, echo=echo, logprobs=options.logprobs,
                                 encrypted_reasoning=ENCRYPTED_REASONING in include)


def seal_reasoning(text: str) -> str:
    """A reasoning item's encrypted_content: its text, read back by open_reasoning."""
    return SEAL + base64.urlsafe_b64encode(text.encode()).decode()


def open_reasoning(sealed: str) -> str | None:
    """The text seal_reasoning sealed; None for what it did not seal (another server's encrypted_content)."""
    if not sealed.startswith(SEAL):
        return None
    try:
        return base64.urlsafe_b64decode(sealed[len(SEAL):].encode()).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def _include(body: dict[str, Any]) -> list[str]:
    include = body.get("include", [])
    if not isinstance(include, list) or any(v not in (LOGPROBS, ENCRYPTED_REASONING) for v in include):
        raise BodyError(f"include may hold {LOGPROBS!r} and {ENCRYPTED_REASONING!r} (no stored or tool output "
                        f"here), got {describe(include)}", "include")
    return include


def _logprobs(body: dict[str, Any], include: list[str]) -> dict[str, Any]:
    """`include` and `top_logprobs` as the chat body's logprobs fields."""
    top = body.get("top_logprobs", 0)
    if LOGPROBS not in include:
        if top:
            raise BodyError(f"top_logprobs needs include: [{LOGPROBS!r}]", "top_logprobs")
        return {}
    return {"logprobs": True, "top_logprobs": top}


def _instructions(body: dict[str, Any]) -> list[dict[str, Any]]:
    instructions = body.get("instructions")
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise BodyError(f"instructions must be a string, got {describe(instructions)}", "instructions")
    return [{"role": "system", "content": instructions}]


def _messages(items: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: a reply's items make one assistant turn, as the model wrote it: a reasoning item
    opens it (its text is the turn's reasoning_content), and the assistant message and function calls after it join
    it."""
    if isinstance(items, str) and items:
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BodyError(f"input must be a non-empty string or a non-empty list of items, got {describe(items)}",
                        "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise BodyError(f"{param} must be an object, got {describe(item)}", param)
        kind = item.get("type", "message")
        last = messages[-1] if messages else None
        if kind == "message":
            message = _message(item, param)
            if (last is not None and message["role"] == "assistant" and last.get("reasoning_content")
                    and not last["content"] and "tool_calls" not in last):
                last["content"] = message["content"]  # the reasoning item before it opened this turn
            else:
                messages.append(message)
        elif kind == "reasoning":
            messages.append({"role": "assistant", "content": "", "reasoning_content": _reasoning_text(item, param)})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", param), "type": "function",
                    "function": {"name": _field(item, "name", param), "arguments": _field(item, "arguments", param)}}
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", param),
                             "content": _text_content(item.get("output"), f"{param}.output")})
        else:
            raise BodyError(f"{param} is a {describe(kind)} item; input takes message, reasoning, function_call "
                            "and function_call_output items (nothing is stored here to refer to)", f"{param}.type")
    return messages


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    unknown = sorted(set(item) - {"type", "role", "content", "id", "status"})
    if unknown:
        raise BodyError(f"{param} has unsupported field(s) {unknown}", param)
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise BodyError(f"{param}.role must be one of {sorted(MESSAGE_ROLES)}, got {describe(role)}", f"{param}.role")
    return {"role": role, "content": _text_content(item.get("content"), f"{param}.content")}


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its reasoning_text parts, or this server's sealed encrypted_content. Another
    server's encrypted_content cannot be read here, and a summary is not what the model wrote: refused."""
    unknown = sorted(set(item) - {"type", "id", "status", "summary", "content", "encrypted_content"})
    if unknown:
        raise BodyError(f"{param} has unsupported field(s) {unknown}", param)
    parts = item.get("content") or []
    sealed = item.get("encrypted_content")
    if not parts and isinstance(sealed, str) and (text := open_reasoning(sealed)) is not None:
        return text
    if not (isinstance(parts, list) and parts and all(
            isinstance(p, dict) and p.get("type") == "reasoning_text" and isinstance(p.get("text"), str)
            for p in parts)):
        raise BodyError(f"{param}: a reasoning item is read from its content's reasoning_text parts or this "
                        f"server's encrypted_content (a summary, or another server's encrypted_content, is not the "
                        f"model's text here), got content {describe(parts)}", f"{param}.content")
    return "".join(p["text"] for p in parts)


def _text_content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str)):
                raise BodyError(f"{param}[{j}] must be an input_text or output_text part (text is all this model "
                                f"reads), got {describe(part)}", f"{param}[{j}]")
            texts.append(part["text"])
        return "".join(texts)
    raise BodyError(f"{param} must be a string or a list of text parts, got {describe(content)}", param)


def _field(item: dict[str, Any], key: str, param: str) -> str:
    v = item.get(key)
    if not isinstance(v, str) or (key != "arguments" and not v):
        raise BodyError(f"{param}.{key} must be a{'' if key == 'arguments' else ' non-empty'} string, got "
                        f"{describe(v)}", f"{param}.{key}")
    return v


def _max_output_tokens(v: Any) -> int:
    if not (isinstance(v, int) and not isinstance(v, bool)) or v < 1:
        raise BodyError(f"max_output_tokens must be a positive integer, got {describe(v)}", "max_output_tokens")
    return v


def _text(text: Any) -> dict[str, Any]:
    """`text`'s format ({"type": "text"} when absent); its verbosity only at OpenAI's default."""
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise BodyError(f"text may hold format and verbosity, got {describe(text)}", "text")
    if text.get("verbosity", "medium") != "medium":
        raise BodyError(f"text.verbosity is accepted only as 'medium', as any other value would change the reply, "
                        f"got {describe(text['verbosity'])}", "text.verbosity")
    return text.get("format", {"type": "text"})


def _response_format(fmt: Any) -> dict[str, Any]:
    """text.format (flat: {"type": "json_schema", "name", "schema", "strict"}) -> chat's response_format."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object") and set(fmt) == {"type"}:
        return fmt
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict) and set(fmt) <= {"type", "name", "schema",
                                                                                      "strict"}:
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise BodyError("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                    "\"json_schema\", \"name\", \"schema\": {...}, \"strict\"}, got " + describe(fmt), "text.format")


def _tool(t: Any, i: int) -> dict[str, Any]:
    """A flat function tool -> chat's {"type": "function", "function": {...}}."""
    param = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function":
        raise BodyError(f"{param} must be a function tool (the only kind this server runs: no built-in tools), got "
                        f"{describe(t)}", param)
    unknown = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise BodyError(f"{param} has unsupported field(s) {unknown}", param)
    return {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}


def _flat_tool(t: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", **t["function"]}


def _tool_choice(v: Any) -> Any:
    if v in ("auto", "none", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function" and set(v) == {"type", "name"}:
        return {"type": "function", "function": {"name": v["name"]}}
    raise BodyError("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}, got "
                    + describe(v), "tool_choice")

