"""Batch input -> requests. Pure Python (no I/O), unit-tested in tests/batch/test_parse.py.

Two levels of failure, as the proto documents:
- the batch fails (BatchIssue) when the input cannot be split into identified requests: a line that is not a JSON
  object, a missing / non-string / empty custom_id, a duplicate custom_id, no requests, too many requests;
- one request fails alone (ParsedRequest.error) when its method, url, body or a parameter is wrong; it gets an error
  result while its neighbours run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kimiserve.limits import JsonTooDeep, loads_json
from kimiserve.text import encodable_json
from kimiserve.v1 import common_pb2, router_pb2

MAX_REQUESTS = 50_000
MAX_ISSUES = 20
MAX_METADATA_PAIRS = 16
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
GENERATE, CHAT, INVALID = "generate", "chat", "invalid"


@dataclass(frozen=True)
class BatchIssue:
    code: str
    message: str
    line: int = 0  # 1-based JSONL line (inline: index + 1); 0: the batch as a whole


@dataclass(frozen=True)
class ParsedRequest:
    idx: int  # 0-based position among the batch's requests
    custom_id: str
    line: int
    kind: str  # GENERATE | CHAT | INVALID
    payload: bytes = b""  # serialized GenerateRequest / ChatRequest
    error: tuple[str, str] | None = None  # (code, message) for INVALID


@dataclass
class ParsedInput:
    requests: list[ParsedRequest] = field(default_factory=list)
    issues: list[BatchIssue] = field(default_factory=list)


class BodyError(ValueError):
    """A request's method, url or body is unusable; it fails alone with code invalid_request."""


# ---- JSONL (OpenAI batch line format) ---------------------------------------------------------------------------

def parse_jsonl(text: str) -> ParsedInput:
    out = ParsedInput()
    seen: dict[str, int] = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = encodable_json(loads_json(raw))  # lone surrogate escapes become U+FFFD, as in the tokenizer
        except json.JSONDecodeError as e:
            _issue(out, "invalid_json", f"line {line_no} is not valid JSON: {e.msg} at column {e.colno}", line_no)
            continue
        except JsonTooDeep as e:
            _issue(out, "invalid_json", f"line {line_no}: {e}", line_no)
            continue
        if not isinstance(obj, dict):
            _issue(out, "invalid_line", f"line {line_no} is a JSON {type(obj).__name__}, not an object", line_no)
            continue
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            _issue(out, "missing_custom_id", f"line {line_no} has no custom_id string (got {custom_id!r})", line_no)
            continue
        if not _unique(out, seen, custom_id, line_no):
            continue
        try:
            kind, payload = _line_request(obj)
            req = ParsedRequest(len(out.requests), custom_id, line_no, kind, payload.SerializeToString())
        except BodyError as e:
            req = ParsedRequest(len(out.requests), custom_id, line_no, INVALID,
                                error=("invalid_request", f"custom_id {custom_id!r} (line {line_no}): {e}"))
        out.requests.append(req)
    _check_size(out)
    return out


def _line_request(obj: dict[str, Any]) -> tuple[str, router_pb2.GenerateRequest | router_pb2.ChatRequest]:
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise BodyError(f"unknown line field(s) {unknown}")
    method = obj.get("method", "POST")
    if method != "POST":
        raise BodyError(f"method must be POST, got {method!r}")
    url, body = obj.get("url"), obj.get("body")
    if not isinstance(body, dict):
        raise BodyError(f"body must be a JSON object, got {type(body).__name__}")
    if url == CHAT_URL:
        return CHAT, chat_request(body)
    if url == COMPLETIONS_URL:
        return GENERATE, completion_request(body)
    raise BodyError(f"unknown url {url!r}; expected {CHAT_URL!r} or {COMPLETIONS_URL!r}")


# ---- bodies -----------------------------------------------------------------------------------------------------

# Fields accepted only at their default (they change nothing then); any other value is refused, never ignored.
NOOP_DEFAULTS = {"n": 1, "stream": False, "presence_penalty": 0, "frequency_penalty": 0, "best_of": 1,
                 "echo": False, "tool_choice": "auto", "parallel_tool_calls": True, "logprobs": False}
SAMPLING_FIELDS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                   "stop_token_ids", "ignore_eos"}


def completion_request(body: dict[str, Any]) -> router_pb2.GenerateRequest:
    body = _present(body)
    _check_fields(body, {"model", "prompt", "user"} | SAMPLING_FIELDS)
    req = router_pb2.GenerateRequest(model=_str(body, "model"), sampling=sampling_params(body))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        req.text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        req.prompt_token_ids.ids.extend(prompt)
    else:
        raise BodyError("prompt must be a non-empty string or a non-empty list of token ids (one prompt per "
                        f"request), got {_describe(prompt)}")
    return req


def chat_request(body: dict[str, Any]) -> router_pb2.ChatRequest:
    body = _present(body)
    _check_fields(body, {"model", "messages", "tools", "user"} | SAMPLING_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BodyError(f"messages must be a non-empty list, got {_describe(messages)}")
    req = router_pb2.ChatRequest(model=_str(body, "model"), sampling=sampling_params(body))
    req.messages.extend(_message(m, i) for i, m in enumerate(messages))
    tools = body.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BodyError("tools must be a list of JSON objects")
    req.tools.extend(common_pb2.Tool(json=json.dumps(t)) for t in tools)
    return req


def _message(m: Any, i: int) -> common_pb2.ChatMessage:
    if not isinstance(m, dict):
        raise BodyError(f"messages[{i}] must be an object, got {_describe(m)}")
    m = _present(m)
    unknown = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"})
    if unknown:
        raise BodyError(f"messages[{i}] has unsupported field(s) {unknown}")
    out = common_pb2.ChatMessage(role=_str(m, "role", f"messages[{i}].role"), content=_content(m.get("content"), i),
                                 name=_str(m, "name", f"messages[{i}].name"),
                                 tool_call_id=_str(m, "tool_call_id", f"messages[{i}].tool_call_id"))
    calls = m.get("tool_calls", [])
    if not isinstance(calls, list):
        raise BodyError(f"messages[{i}].tool_calls must be a list")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BodyError(f"messages[{i}].tool_calls[{j}] needs a function with a name")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        out.tool_calls.append(common_pb2.ToolCall(id=str(call.get("id") or ""), name=fn["name"], arguments=arguments))
    return out


def _content(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BodyError(f"messages[{i}].content must be a string or a list of text parts")


def sampling_params(body: dict[str, Any]) -> common_pb2.SamplingParams:
    """OpenAI body fields -> SamplingParams. Only types are checked here; values are validated as for Generate
    when the request runs (so the error is the same one a single request gets)."""
    s = common_pb2.SamplingParams()
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise BodyError("give max_tokens or max_completion_tokens, not both")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None:
        s.max_tokens = _int(max_tokens, "max_tokens", -(1 << 31), (1 << 31) - 1)
    for name in ("temperature", "top_p"):
        if name in body:
            if not _is_number(body[name]):
                raise BodyError(f"{name} must be a number, got {_describe(body[name])}")
            setattr(s, name, float(body[name]))
    if "top_k" in body:
        s.top_k = _int(body["top_k"], "top_k", -(1 << 31), (1 << 31) - 1)
    if "seed" in body:
        s.seed = _int(body["seed"], "seed", 0, (1 << 64) - 1)
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        raise BodyError(f"stop must be a string or a list of strings, got {_describe(stop)}")
    s.stop.extend(stop)
    ids = body.get("stop_token_ids", [])
    if not isinstance(ids, list):
        raise BodyError(f"stop_token_ids must be a list of token ids, got {_describe(ids)}")
    s.stop_token_ids.extend(_int(t, "stop_token_ids[]", 0, (1 << 32) - 1) for t in ids)
    if "ignore_eos" in body:
        if not isinstance(body["ignore_eos"], bool):
            raise BodyError(f"ignore_eos must be true or false, got {_describe(body['ignore_eos'])}")
        s.ignore_eos = body["ignore_eos"]
    return s


def _present(d: dict[str, Any]) -> dict[str, Any]:
    """A field set to null is treated as absent (clients serialise unset optionals that way)."""
    return {k: v for k, v in d.items() if v is not None}


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    bad = []
    for key, value in body.items():
        if key in allowed:
            continue
        if key in NOOP_DEFAULTS and value == NOOP_DEFAULTS[key] and type(value) is type(NOOP_DEFAULTS[key]):
            continue
        bad.append(f"{key}={value!r}" if key in NOOP_DEFAULTS else key)
    if bad:
        raise BodyError(f"unsupported body field(s) {sorted(bad)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if not _is_int(v) or not lo <= v <= hi:
        raise BodyError(f"{name} must be an integer in [{lo}, {hi}], got {_describe(v)}")
    return v


def _str(d: dict[str, Any], key: str, name: str | None = None) -> str:
    v = d.get(key, "")
    if not isinstance(v, str):
        raise BodyError(f"{name or key} must be a string, got {_describe(v)}")
    return v


def _describe(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, (bytes, set)) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


# ---- inline requests --------------------------------------------------------------------------------------------

def parse_inline(items: "list[router_pb2.BatchRequestItem]") -> ParsedInput:
    out = ParsedInput()
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        line = i + 1
        if not item.custom_id:
            _issue(out, "missing_custom_id", f"request {i} has an empty custom_id", line)
            continue
        if not _unique(out, seen, item.custom_id, line):
            continue
        which = item.WhichOneof("request")
        if which is None:
            out.requests.append(ParsedRequest(len(out.requests), item.custom_id, line, INVALID, error=(
                "invalid_request", f"custom_id {item.custom_id!r} (request {i}): set generate or chat")))
            continue
        inner = getattr(item, which)
        inner.ClearField("request_id")  # the router names batch requests itself
        out.requests.append(ParsedRequest(len(out.requests), item.custom_id, line,
                                          GENERATE if which == "generate" else CHAT, inner.SerializeToString()))
    _check_size(out)
    return out


# ---- shared -----------------------------------------------------------------------------------------------------

def _issue(out: ParsedInput, code: str, message: str, line: int = 0) -> None:
    if len(out.issues) < MAX_ISSUES:
        out.issues.append(BatchIssue(code, message, line))


def _unique(out: ParsedInput, seen: dict[str, int], custom_id: str, line: int) -> bool:
    if custom_id in seen:
        _issue(out, "duplicate_custom_id",
               f"custom_id {custom_id!r} on line {line} was already used on line {seen[custom_id]}", line)
        return False
    seen[custom_id] = line
    return True


def _check_size(out: ParsedInput) -> None:
    if not out.requests and not out.issues:
        _issue(out, "empty_input", "the input holds no requests")
    if len(out.requests) > MAX_REQUESTS:
        _issue(out, "too_many_requests", f"{len(out.requests)} requests; a batch holds at most {MAX_REQUESTS}")


def check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_PAIRS:
        raise ValueError(f"metadata has {len(metadata)} pairs; at most {MAX_METADATA_PAIRS}")
