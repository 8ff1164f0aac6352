"""OpenAI request bodies (/v1/chat/completions, /v1/completions) -> Router requests. Pure Python, no I/O.

The one translation of OpenAI JSON, used by the HTTP API (router/http) and by batch input lines (router/batch/parse.py),
so an HTTP request and a batch line accept exactly the same bodies. Types are checked here and every problem is a
BodyError naming the field (`param`); values (ranges, context length) are validated when the request runs, as for the
gRPC API. Which fields are honoured, accepted and ignored, or refused: router/openai_fields.py (a field that would
change the reply and is not honoured is refused, never ignored).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kimiserve.limits import MAX_N
from kimiserve.v1 import common_pb2, router_pb2
from router import openai_fields, structured_outputs
from router.openai_fields import describe

SAMPLING_FIELDS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "response_format", "logit_bias", "min_tokens", structured_outputs.FIELD,
                   *structured_outputs.LEGACY, "include_stop_str_in_output"}
OPTION_FIELDS = {"n", "stream", "stream_options", "logprobs"}
REASONING_FIELDS = ("reasoning_content", "reasoning")  # an assistant message's thinking, under either name
# OpenAI's `developer` role is its `system` role under the name newer models use ("developer messages replace the
# previous system messages"); the chat template knows `system`.
ROLE_ALIASES = {"developer": "system"}
# include_usage and include_obfuscation are OpenAI's; continuous_usage_stats is vLLM's (openai_fields.EXTENSIONS).
STREAM_OPTIONS = {"include_usage", "include_obfuscation", "continuous_usage_stats"}
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (SamplingParams.top_logprobs); the legacy logprobs int stops at 5
ToolChoice = router_pb2.ToolChoice


class BodyError(ValueError):
    """A body field is unusable; `param` names it (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Options:
    """How a request is answered, beyond the Router request itself (the HTTP API's business)."""

    n: int = 1  # sequences per prompt
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    logprobs: bool = False  # the chosen tokens' log-probabilities
    top_logprobs: int = 0  # alternatives per token (0-20)
    echo: bool = False  # completions: the prompt text before the completion
    score_only: bool = False  # completions' max_tokens 0 with echo: the scored prompt and no completion
    prompt_logprobs: int | None = None  # completions: vLLM's prompt_logprobs (alternatives per prompt position)
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk (vLLM's)

    def non_default(self) -> list[str]:
        return [f"{k}={v!r}" for k, v in vars(self).items() if v != getattr(DEFAULT_OPTIONS, k)]


DEFAULT_OPTIONS = Options()


def chat_request(body: dict[str, Any]) -> tuple[router_pb2.ChatRequest, Options]:
    body = present(body)
    _check_fields(body, {"model", "messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs"}
                  | SAMPLING_FIELDS | OPTION_FIELDS | set(openai_fields.EXTENSIONS)
                  | set(openai_fields.CHAT_EXTENSIONS))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BodyError(f"messages must be a non-empty list, got {describe(messages)}", "messages")
    req = router_pb2.ChatRequest(model=str_field(body, "model"), sampling=sampling_params(body),
                                 cache_salt=str_field(body, "cache_salt"))
    req.messages.extend(_message(m, i) for i, m in enumerate(messages))
    tools = body.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BodyError("tools must be a list of JSON objects", "tools")
    req.tools.extend(common_pb2.Tool(json=json.dumps(t)) for t in tools)
    req.tool_choice.CopyFrom(_tool_choice(body.get("tool_choice", "auto")))
    if "parallel_tool_calls" in body:
        req.parallel_tool_calls = bool_field(body, "parallel_tool_calls")
    if "add_generation_prompt" in body:
        req.add_generation_prompt = bool_field(body, "add_generation_prompt")
    req.continue_final_message = bool_field(body, "continue_final_message")
    last = messages[-1]  # an object: _message checked it
    if req.continue_final_message and last.get("content") is None and not last.get("tool_calls"):
        # The rest of the rule is the router's, for gRPC too (router/prompts.py); only JSON tells null from "".
        raise BodyError(f"continue_final_message: the final message (messages[{len(messages) - 1}]) has no content "
                        "to continue", "continue_final_message")
    logprobs = bool_field(body, "logprobs")
    top = _int(body.get("top_logprobs", 0), "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise BodyError("top_logprobs needs logprobs: true", "top_logprobs")
    req.sampling.logprobs, req.sampling.top_logprobs = logprobs, top
    return req, _options(body, logprobs=logprobs, top_logprobs=top)


def completion_requests(body: dict[str, Any]) -> tuple[list[router_pb2.GenerateRequest], Options]:
    """One GenerateRequest per prompt (a string, a list of strings, token ids, or a list of token-id lists)."""
    body = present(body)
    _check_fields(body, {"model", "prompt", "echo"} | SAMPLING_FIELDS | OPTION_FIELDS | set(openai_fields.EXTENSIONS)
                  | set(openai_fields.COMPLETIONS_EXTENSIONS))
    sampling = sampling_params(body)
    echo = bool_field(body, "echo")
    top = body.get("logprobs")
    if top is not None:  # the legacy API's logprobs is the number of alternatives per token
        top = _int(top, "logprobs", 0, 5)
        sampling.logprobs, sampling.top_logprobs = True, top
        if echo:  # the echoed prompt's tokens carry theirs too, scored by the shard during its prefill
            sampling.prompt_logprobs = top
    prompt_top = body.get("prompt_logprobs")
    if prompt_top is not None:  # vLLM's: the scored prompt in a field of its own (the shard computes the larger k)
        prompt_top = _int(prompt_top, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
        sampling.prompt_logprobs = max(prompt_top, sampling.prompt_logprobs)
    score_only = sampling.HasField("max_tokens") and sampling.max_tokens == 0
    if score_only:
        if not (echo or prompt_top is not None):
            raise BodyError("max_tokens 0 generates nothing; it is accepted only with echo: true or prompt_logprobs "
                            "(the prompt, scored)", "max_tokens")
        # The shard's prefill always draws one token; the reply drops it (OpenAI's and vLLM's max_tokens 0 + echo).
        sampling.max_tokens = 1
    requests = []
    for prompt in _prompts(body.get("prompt")):
        req = router_pb2.GenerateRequest(model=str_field(body, "model"), sampling=sampling,
                                         cache_salt=str_field(body, "cache_salt"))
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.prompt_token_ids.ids.extend(prompt)
        requests.append(req)
    return requests, _options(body, logprobs=top is not None, top_logprobs=top or 0, echo=echo,
                              score_only=score_only, prompt_logprobs=prompt_top)


def _prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str) and prompt:
        return [prompt]
    if isinstance(prompt, list) and prompt and all(is_int(t) and t >= 0 for t in prompt):
        return [prompt]
    if (isinstance(prompt, list) and prompt and len(prompt) <= MAX_PROMPTS
            and all((isinstance(p, str) and p) or (isinstance(p, list) and p and all(is_int(t) and t >= 0 for t in p))
                    for p in prompt)):
        return list(prompt)
    raise BodyError("prompt must be a non-empty string, a list of token ids, or a list of at most "
                    f"{MAX_PROMPTS} non-empty strings or token-id lists, got {describe(prompt)}", "prompt")


def _options(body: dict[str, Any], **kw) -> Options:
    n = _int(body.get("n", 1), "n", 1, MAX_N)
    stream = bool_field(body, "stream")
    raw = body.get("stream_options", {})
    stream_options = present(raw) if isinstance(raw, dict) else None
    if stream_options is None or set(stream_options) - STREAM_OPTIONS:
        raise BodyError(f"stream_options may hold {sorted(STREAM_OPTIONS)}, got {describe(raw)}", "stream_options")
    # include_obfuscation pads OpenAI's chunks against size side channels: no padding is sent, the text is the same.
    bool_field(stream_options, "include_obfuscation")
    # Without stream, stream_options changes nothing: a whole response always carries usage.
    include_usage = bool_field(stream_options, "include_usage") and stream
    continuous = bool_field(stream_options, "continuous_usage_stats") and stream
    return Options(n=n, stream=stream, include_usage=include_usage, continuous_usage=continuous, **kw)


def _tool_choice(v: Any) -> router_pb2.ToolChoice:
    modes = {"auto": ToolChoice.MODE_AUTO, "none": ToolChoice.MODE_NONE, "required": ToolChoice.MODE_REQUIRED}
    if isinstance(v, str) and v in modes:
        return ToolChoice(mode=modes[v])
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
        return ToolChoice(mode=ToolChoice.MODE_FUNCTION, function_name=fn["name"])
    raise BodyError("tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": "
                    f"{{\"name\": ...}}}}, got {describe(v)}", "tool_choice")


def _message(m: Any, i: int) -> common_pb2.ChatMessage:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BodyError(f"{param} must be an object, got {describe(m)}", param)
    m = present(m)
    unknown = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id", *REASONING_FIELDS})
    if unknown:
        raise BodyError(f"{param} has unsupported field(s) {unknown}", param)
    role = str_field(m, "role", f"{param}.role")
    out = common_pb2.ChatMessage(role=ROLE_ALIASES.get(role, role), content=_content(m.get("content"), i),
                                 name=str_field(m, "name", f"{param}.name"),
                                 tool_call_id=str_field(m, "tool_call_id", f"{param}.tool_call_id"),
                                 reasoning_content=_reasoning(m, param))
    calls = m.get("tool_calls", [])
    if not isinstance(calls, list):
        raise BodyError(f"{param}.tool_calls must be a list", f"{param}.tool_calls")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BodyError(f"{param}.tool_calls[{j}] needs a function with a name", f"{param}.tool_calls[{j}]")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        out.tool_calls.append(common_pb2.ToolCall(id=str(call.get("id") or ""), name=fn["name"], arguments=arguments))
    return out


def _reasoning(m: dict[str, Any], param: str) -> str:
    """An assistant message's reasoning as a reply gave it (reasoning_content; vLLM's newer name: reasoning), sent
    back by clients that keep the model's thinking in the conversation."""
    given = {k: str_field(m, k, f"{param}.{k}") for k in REASONING_FIELDS if k in m}
    if len(set(given.values())) > 1:
        raise BodyError(f"{param} has reasoning_content and reasoning that differ; send one", param)
    return next(iter(given.values()), "")


def _content(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BodyError(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def sampling_params(body: dict[str, Any]) -> common_pb2.SamplingParams:
    """OpenAI body fields -> SamplingParams. Only types are checked here; values are validated as for Generate
    when the request runs (so the error is the same one a single request gets)."""
    s = common_pb2.SamplingParams()
    if "max_tokens" in body and "max_completion_tokens" in body and not (
            is_int(body["max_tokens"]) and body["max_tokens"] == body["max_completion_tokens"]):
        raise BodyError(f"max_tokens ({describe(body['max_tokens'])}) and max_completion_tokens "
                        f"({describe(body['max_completion_tokens'])}) differ; give one of them", "max_tokens")
    name = "max_tokens" if "max_tokens" in body else "max_completion_tokens"
    if name in body:
        s.max_tokens = _int(body[name], name, -(1 << 31), (1 << 31) - 1)
    for name in ("temperature", "top_p", "min_p"):
        if name in body:
            if not _is_number(body[name]):
                raise BodyError(f"{name} must be a number, got {describe(body[name])}", name)
            setattr(s, name, float(body[name]))
    if "top_k" in body:
        s.top_k = _int(body["top_k"], "top_k", -(1 << 31), (1 << 31) - 1)
    if "min_tokens" in body:
        s.min_tokens = _int(body["min_tokens"], "min_tokens", 0, (1 << 32) - 1)
    if "seed" in body:
        # OpenAI documents an int64 seed and clients send -1; the wire's seed is uint64: a negative seed is its
        # two's complement there (-1 and 2**64 - 1 are one seed), so every int64 and every uint64 is a seed.
        s.seed = _int(body["seed"], "seed", -(1 << 63), (1 << 64) - 1) & ((1 << 64) - 1)
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        raise BodyError(f"stop must be a string or a list of strings, got {describe(stop)}", "stop")
    s.stop.extend(stop)
    ids = body.get("stop_token_ids", [])
    if not isinstance(ids, list):
        raise BodyError(f"stop_token_ids must be a list of token ids, got {describe(ids)}", "stop_token_ids")
    s.stop_token_ids.extend(_int(t, "stop_token_ids[]", 0, (1 << 32) - 1) for t in ids)
    s.ignore_eos = bool_field(body, "ignore_eos")
    s.include_stop_str_in_output = bool_field(body, "include_stop_str_in_output")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):  # ranges: checked when it runs
        if name in body:
            if not _is_number(body[name]):
                raise BodyError(f"{name} must be a number, got {describe(body[name])}", name)
            setattr(s, name, float(body[name]))
    if "response_format" in body:
        _response_format(body["response_format"], s)
    try:
        structured_outputs.apply(body, s)
    except openai_fields.FieldError as e:
        raise BodyError(str(e), e.field) from None
    _logit_bias(body.get("logit_bias", {}), s)
    return s


def _logit_bias(v: Any, s: common_pb2.SamplingParams) -> None:
    """OpenAI's {"token id": bias} (ids as JSON object keys, so strings) -> SamplingParams.logit_bias."""
    if not isinstance(v, dict):
        raise BodyError(f"logit_bias must be a JSON object of token id -> number, got {describe(v)}", "logit_bias")
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit() and int(key) < 1 << 32):
            raise BodyError(f"logit_bias keys must be token ids (decimal strings), got {describe(key)}", "logit_bias")
        if not _is_number(bias):
            raise BodyError(f"logit_bias[{key}] must be a number, got {describe(bias)}", "logit_bias")
        s.logit_bias[int(key)] = float(bias)


def _response_format(v: Any, s: common_pb2.SamplingParams) -> None:
    """OpenAI's response_format -> SamplingParams.response_format (enforced on the shard by constrained decoding)."""
    kind = v.get("type") if isinstance(v, dict) else None
    if kind == "text" and set(v) == {"type"}:
        return
    if kind == "json_object" and set(v) == {"type"}:
        s.response_format.json_object.SetInParent()
        return
    spec = v.get("json_schema") if kind == "json_schema" and set(v) == {"type", "json_schema"} else None
    if isinstance(spec, dict) and isinstance(spec.get("schema"), dict) and set(spec) <= {"name", "schema", "strict"}:
        js = s.response_format.json_schema
        js.name = str_field(spec, "name", "response_format.json_schema.name")
        js.schema = json.dumps(spec["schema"])
        js.strict = bool_field(spec, "strict")
        return
    raise BodyError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                    "\"json_schema\", \"json_schema\": {\"name\", \"schema\": {...}, \"strict\"}}, got "
                    f"{describe(v)}", "response_format")


# ---- helpers ----------------------------------------------------------------------------------------------------

def present(d: dict[str, Any]) -> dict[str, Any]:
    """A field set to null is treated as absent (clients serialise unset optionals that way)."""
    return {k: v for k, v in d.items() if v is not None}


def _check_fields(body: dict[str, Any], honoured: set[str]) -> None:
    try:
        openai_fields.check(body, honoured)
    except openai_fields.FieldError as e:
        raise BodyError(str(e), e.field) from None


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v: Any, name: str, lo: int, hi: int) -> int:
    if not is_int(v) or not lo <= v <= hi:
        raise BodyError(f"{name} must be an integer in [{lo}, {hi}], got {describe(v)}", name.rstrip("[]"))
    return v


def bool_field(d: dict[str, Any], key: str) -> bool:
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise BodyError(f"{key} must be true or false, got {describe(v)}", key)
    return v


def str_field(d: dict[str, Any], key: str, name: str | None = None) -> str:
    v = d.get(key, "")
    if not isinstance(v, str):
        raise BodyError(f"{name or key} must be a string, got {describe(v)}", name or key)
    return v

