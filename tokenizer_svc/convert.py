"""Proto -> domain conversion for chat messages (with their tool calls) and tools."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kimiserve.v1 import common_pb2
from tokenizer_svc.chat_types import ChatMessage, ToolCall, function_tool, parse_tool_json
from tokenizer_svc.errors import RenderError


def messages_from_pb(messages: Iterable[common_pb2.ChatMessage]) -> list[ChatMessage]:
    return [
        ChatMessage(
            role=m.role,
            content=m.content,
            name=m.name,
            tool_calls=tuple(ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in m.tool_calls),
            tool_call_id=m.tool_call_id,
            reasoning_content=m.reasoning_content,
        )
        for m in messages
    ]


def tools_from_pb(tools: Iterable[common_pb2.Tool]) -> list[dict[str, Any]]:
    """Tools as OpenAI-style dicts; RenderError naming the tool index for malformed JSON or an empty entry."""
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        kind = tool.WhichOneof("definition")
        if kind == "function":
            fn = tool.function
            out.append(function_tool(i, fn.name, fn.description, fn.parameters_json))
        elif kind == "json":
            out.append(parse_tool_json(i, tool.json))
        else:
            raise RenderError(f"tools[{i}]: neither `function` nor `json` is set")
    return out
