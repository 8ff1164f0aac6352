"""Chat conversation types shared by the tokenizer service and the router, and their validation."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kimiserve.kimi_chat import ToolCall  # the one definition, shared with the router
from kimiserve.limits import JsonTooDeep, loads_json
from kimiserve.text import clip
from tokenizer_svc.errors import RenderError

ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str = ""
    name: str = ""
    tool_calls: tuple[ToolCall, ...] = field(default_factory=tuple)
    tool_call_id: str = ""
    reasoning_content: str = ""  # assistant only: the thinking before its content

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI-style dict chat templates expect (empty optional fields left out)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        return out


def validate_messages(messages: Sequence[ChatMessage], max_message_chars: int) -> None:
    """Raise RenderError naming the first offending message index; renderers then never see bad input."""
    if not messages:
        raise RenderError("messages: the conversation is empty")
    for i, msg in enumerate(messages):
        if msg.role not in ROLES:
            raise RenderError(f"messages[{i}]: unknown role {clip(msg.role)} (expected one of {sorted(ROLES)})")
        size = len(msg.content) + len(msg.reasoning_content) + sum(len(c.arguments) for c in msg.tool_calls)
        if size > max_message_chars:
            raise RenderError(f"messages[{i}]: {size} characters is over the limit of {max_message_chars}")
        for name, value in (("tool_calls", msg.tool_calls), ("reasoning_content", msg.reasoning_content)):
            if value and msg.role != "assistant":
                raise RenderError(f"messages[{i}]: role {clip(msg.role)} cannot carry {name} (assistant only)")
        if msg.role == "tool" and not msg.tool_call_id:
            raise RenderError(f"messages[{i}]: a tool message needs the tool_call_id it answers")
        for j, call in enumerate(msg.tool_calls):
            if not call.name:
                raise RenderError(f"messages[{i}].tool_calls[{j}]: function name is empty")
            json_object(call.arguments, f"messages[{i}].tool_calls[{j}] ({clip(call.name, quote=False)})",
                        "arguments", "arguments are not JSON")


def json_object(text: str, where: str, field: str, not_json: str) -> dict[str, Any]:
    """`text` as a JSON object of bounded nesting, else RenderError "{where}: ..." naming `field` (the part of the
    message or tool it is; "" for the whole) and `not_json` (what malformed JSON is called there)."""
    named = f"{field} " if field else ""
    try:
        value = loads_json(text)
    except json.JSONDecodeError as exc:
        raise RenderError(f"{where}: {not_json}: {exc}") from exc
    except JsonTooDeep as exc:
        raise RenderError(f"{where}: {field}{': ' if field else ''}{exc}") from exc
    if not isinstance(value, dict):
        raise RenderError(f"{where}: {named}must be a JSON object, got {type(value).__name__}")
    return value


def parse_tool_json(index: int, text: str) -> dict[str, Any]:
    """One tools[] entry given as JSON text; RenderError naming the tool index when it is not a JSON object."""
    return json_object(text, f"tools[{index}]", "", "malformed JSON")


def function_tool(index: int, name: str, description: str, parameters_json: str) -> dict[str, Any]:
    """A structured function declaration in the OpenAI tools[] shape; parameters_json must be a JSON object."""
    if not name:
        raise RenderError(f"tools[{index}]: function name is empty")
    parameters = (json_object(parameters_json, f"tools[{index}] ({clip(name, quote=False)})", "parameters_json",
                              "parameters_json is malformed JSON") if parameters_json else {})
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
