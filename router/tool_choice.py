"""tool_choice: which tools a chat request declares to the model, the decoding constraint that makes the reply
comply, and the check of the finished reply.

    auto      every tool declared, no constraint (parallel_tool_calls false: text first, then at most one call)
    none      no tool declared
    required  every tool declared; the reply is one or more calls (ResponseFormat.tool_calls, at most MAX_TOOL_CALLS;
              exactly one with parallel_tool_calls false)
    function  only the named tool declared; the reply is exactly one call to it

The constraint is a response_format the shard compiles into a grammar (shard_svc/engine/grammar.py), so the model
can only write Kimi's tool-calls section with arguments valid under each function's parameters schema. The check on
the finished reply stays as a backstop: with the grammar in force it fails only when something cut the reply short
that the grammar does not govern (a stop string or stop token id).
"""

from __future__ import annotations

import json

from kimiserve.kimi_chat import ToolCall
from kimiserve.limits import MAX_TOOL_CALLS
from kimiserve.v1 import common_pb2, router_pb2
from kimiserve.text import clip
from router.errors import InvalidArgument, ToolChoiceNotMet

ToolChoice = router_pb2.ToolChoice
ToolCalls = common_pb2.ResponseFormat.ToolCalls
CONSTRAINED = (ToolChoice.MODE_REQUIRED, ToolChoice.MODE_FUNCTION)


def _function(tool: common_pb2.Tool) -> dict:
    """The tool's {"name", "parameters", ...} object ({} when malformed: the tokenizer service refuses those with the
    tool's index when the prompt is rendered)."""
    if tool.WhichOneof("definition") == "function":
        return {"name": tool.function.name, "parameters": tool.function.parameters_json or None}
    try:
        fn = json.loads(tool.json).get("function", {})
    except (json.JSONDecodeError, AttributeError):
        return {}
    return fn if isinstance(fn, dict) else {}


def tool_name(tool: common_pb2.Tool) -> str:
    name = _function(tool).get("name", "")
    return name if isinstance(name, str) else ""


def offered_tools(tools, choice: router_pb2.ToolChoice) -> list[common_pb2.Tool]:
    """The tools declared to the model under `choice`: none for NONE, only the named one for FUNCTION."""
    if choice.mode == ToolChoice.MODE_NONE:
        return []
    if choice.mode == ToolChoice.MODE_REQUIRED and not tools:
        raise InvalidArgument("tool_choice 'required' needs at least one tool in tools", "tool_choice")
    if choice.mode == ToolChoice.MODE_FUNCTION:
        named = [t for t in tools if tool_name(t) == choice.function_name]
        if not named:
            raise InvalidArgument(f"tool_choice names function {clip(choice.function_name)}, which is not in tools "
                                  f"{[tool_name(t) for t in tools]}", "tool_choice")
        return named[:1]
    return list(tools)


def constraint(offered: list[common_pb2.Tool], choice: router_pb2.ToolChoice, sampling: common_pb2.SamplingParams,
               parallel: bool = True) -> common_pb2.ResponseFormat | None:
    """The response_format that enforces `choice` over the offered tools (already rendered, so well-formed), and
    at most one call when not `parallel`; None when nothing needs constraining. Under AUTO the reply is text first
    and the section optional (ToolCalls.text_first); with a response_format of its own, that format already leaves
    no room for a tool-calls section, so at most one call holds without a second constraint."""
    if choice.mode not in CONSTRAINED:
        if parallel or not offered or sampling.HasField("response_format"):
            return None
        _no_end_override(sampling, "parallel_tool_calls false", "parallel_tool_calls")
        return common_pb2.ResponseFormat(tool_calls=ToolCalls(functions=_functions(offered), max_calls=1,
                                                              text_first=True))
    if sampling.HasField("response_format"):
        raise InvalidArgument(f"tool_choice {_describe(choice)} and sampling.response_format both constrain the "
                              "reply; set one of them", "tool_choice")
    _no_end_override(sampling, f"tool_choice {_describe(choice)}", "tool_choice")
    max_calls = 1 if choice.mode == ToolChoice.MODE_FUNCTION or not parallel else MAX_TOOL_CALLS
    return common_pb2.ResponseFormat(tool_calls=ToolCalls(functions=_functions(offered), max_calls=max_calls))


def _no_end_override(sampling: common_pb2.SamplingParams, what: str, param: str) -> None:
    """Named for what the client set: the grammar behind `what` is a response_format it never sent (ignore_eos and
    min_tokens would overrule where it ends the reply)."""
    for name, on in (("ignore_eos", sampling.ignore_eos), ("min_tokens", sampling.min_tokens > 0)):
        if on:
            raise InvalidArgument(f"{name} cannot be combined with {what}: the tool-call grammar decides where the "
                                  "reply ends", param)


def _functions(offered: list[common_pb2.Tool]) -> list[common_pb2.ResponseFormat.ToolCalls.Function]:
    return [ToolCalls.Function(name=tool_name(t), parameters=_parameters(t)) for t in offered]


def _parameters(tool: common_pb2.Tool) -> str:
    """The tool's parameters schema as JSON text; "" when it has none (any arguments object)."""
    params = _function(tool).get("parameters")
    if params is None or isinstance(params, str):
        return params or ""
    return json.dumps(params)


def check_reply(choice: router_pb2.ToolChoice, calls: list[ToolCall], request_id: str, parallel: bool = True) -> None:
    """The backstop: a finished reply that broke REQUIRED / FUNCTION or made several calls where `parallel` is off
    is refused rather than returned as if it complied. Decoding enforces all three, so only a stop string or stop
    token id cutting the reply short gets here."""
    if not parallel and len(calls) > 1:
        raise ToolChoiceNotMet(f"request {request_id!r}: parallel_tool_calls is false but the reply made {len(calls)} "
                               "tool calls (decoding enforces at most one: this is a bug)")
    if choice.mode == ToolChoice.MODE_REQUIRED and not calls:
        raise ToolChoiceNotMet(f"request {request_id!r}: tool_choice 'required' but the reply made no complete tool "
                               "call (decoding enforces it: a stop string or stop token id must have cut it short)")
    if choice.mode == ToolChoice.MODE_FUNCTION and (len(calls) != 1 or calls[0].name != choice.function_name):
        raise ToolChoiceNotMet(f"request {request_id!r}: tool_choice names {clip(choice.function_name)} but the reply "
                               f"called {[c.name for c in calls]} (decoding enforces it: a stop string or stop "
                               "token id must have cut it short)")


def _describe(choice: router_pb2.ToolChoice) -> str:
    return "'required'" if choice.mode == ToolChoice.MODE_REQUIRED else f"function {clip(choice.function_name)}"
