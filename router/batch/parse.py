"""Batch input -> requests. Pure Python (no I/O), unit-tested in tests/router/batch/test_parse.py.

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
from kimiserve.v1 import router_pb2
from kimiserve.text import clip
from router import openai_body, openai_responses
from router.openai_body import BodyError  # a request's method, url or body is unusable: it fails alone

MAX_REQUESTS = 50_000
MAX_ISSUES = 20
MAX_METADATA_PAIRS = 16
CHAT_URL, COMPLETIONS_URL, RESPONSES_URL = "/v1/chat/completions", "/v1/completions", "/v1/responses"
URLS = (CHAT_URL, COMPLETIONS_URL, RESPONSES_URL)
GENERATE, CHAT, RESPONSES, INVALID = "generate", "chat", "responses", "invalid"


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
    kind: str  # GENERATE | CHAT | RESPONSES | INVALID
    # serialized GenerateRequest / ChatRequest; RESPONSES: the Responses body as canonical JSON (its response repeats
    # fields of the body that the ChatRequest it becomes no longer tells apart, such as instructions)
    payload: bytes = b""
    error: tuple[str, str] | None = None  # (code, message) for INVALID
    param: str | None = None  # with error: the request field at fault, where one is


@dataclass
class ParsedInput:
    requests: list[ParsedRequest] = field(default_factory=list)
    issues: list[BatchIssue] = field(default_factory=list)


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
            _issue(out, "missing_custom_id", f"line {line_no} has no custom_id string (got {clip(custom_id)})", line_no)
            continue
        if not _unique(out, seen, custom_id, line_no):
            continue
        try:
            kind, payload = _line_request(obj)
            req = ParsedRequest(len(out.requests), custom_id, line_no, kind, payload)
        except BodyError as e:
            req = ParsedRequest(len(out.requests), custom_id, line_no, INVALID,
                                error=("invalid_request", f"custom_id {clip(custom_id)} (line {line_no}): {e}"),
                                param=e.param)
        out.requests.append(req)
    _check_size(out)
    return out


def _line_request(obj: dict[str, Any]) -> tuple[str, bytes]:
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise BodyError(f"unknown line field(s) {unknown}")
    method = obj.get("method", "POST")
    if method != "POST":
        raise BodyError(f"method must be POST, got {clip(method)}")
    url, body = obj.get("url"), obj.get("body")
    if not isinstance(body, dict):
        raise BodyError(f"body must be a JSON object, got {type(body).__name__}")
    if url == RESPONSES_URL:
        opts = openai_responses.responses_request(body)[1]
        refused = ["stream=True"] * opts.stream + [f"include={openai_responses.LOGPROBS}"] * opts.logprobs
        if refused:  # as for chat lines: a result is stored whole, without logprobs
            raise BodyError(f"unsupported body field(s) {refused} in a batch request")
        return RESPONSES, json.dumps(body, sort_keys=True, ensure_ascii=False).encode()
    if url in (CHAT_URL, COMPLETIONS_URL):
        kind, req = _body_request(url, body)
        return kind, req.SerializeToString()
    raise BodyError(f"unknown url {clip(url)}; expected one of {list(URLS)}")


# ---- bodies (router/openai_body.py, shared with the HTTP API) -----------------------------------------------------

def _body_request(url: str, body: dict[str, Any]) -> tuple[str, router_pb2.GenerateRequest | router_pb2.ChatRequest]:
    """A batch line runs one sequence and stores its whole result: n, stream, logprobs and echo are refused here."""
    if url == CHAT_URL:
        kind, (req, options), many = CHAT, openai_body.chat_request(body), False
    else:
        (requests, options), kind = openai_body.completion_requests(body), GENERATE
        req, many = requests[0], len(requests) > 1
    if many:
        raise BodyError(f"one prompt per request in a batch, got {len(requests)}")
    if options.non_default():
        raise BodyError(f"unsupported body field(s) {options.non_default()} in a batch request")
    return kind, req


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
                "invalid_request", f"custom_id {clip(item.custom_id)} (request {i}): set generate or chat")))
            continue
        inner = getattr(item, which)
        if inner.n > 1:  # a result holds one choice: refused here, at validation, never run as n = 1
            out.requests.append(ParsedRequest(len(out.requests), item.custom_id, line, INVALID, error=(
                "invalid_request", f"custom_id {clip(item.custom_id)} (request {i}): n={inner.n}, but a batch request "
                "runs one choice; send n requests with their own custom_ids (and seeds) instead"), param="n"))
            continue
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
               f"custom_id {clip(custom_id)} on line {line} was already used on line {seen[custom_id]}", line)
        return False
    seen[custom_id] = line
    return True


def _check_size(out: ParsedInput) -> None:
    if not out.requests and not out.issues:
        _issue(out, "empty_input", "the input holds no requests")
    if len(out.requests) > MAX_REQUESTS:
        _issue(out, "too_many_requests", f"{len(out.requests)} requests; a batch holds at most {MAX_REQUESTS}")
