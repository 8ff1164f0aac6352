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
        return out


def validate_messages(messages: Sequence[ChatMessage], max_message_chars: int) -> None:
    """Raise RenderError naming the first offending message index; renderers then never see bad input."""
    if not messages:
        raise RenderError("messages: the conversation is empty")
    for i, msg in enumerate(messages):
        if msg.role not in ROLES:
            raise RenderError(f"messages[{i}]: unknown role {clip(msg.role)} (expected one of {sorted(ROLES)})")
        size = len(msg.content) + sum(len(c.arguments) for c in msg.tool_calls)
        if size > max_message_chars:
            raise RenderError(f"messages[{i}]: {size} characters is over the limit of {max_message_chars}")
        if msg.tool_calls and msg.role != "assistant":
            raise RenderError(f"messages[{i}]: role {clip(msg.role)} cannot carry tool_calls (assistant only)")
        if msg.role == "tool" and not msg.tool_call_id:
            raise RenderError(f"messages[{i}]: a tool message needs the tool_call_id it answers")
        for j, call in enumerate(msg.tool_calls):
            if not call.name:
                raise RenderError(f"messages[{i}].tool_calls[{j}]: function name is empty")
            where = f"messages[{i}].tool_calls[{j}] ({clip(call.name, quote=False)})"
            try:
                args = loads_json(call.arguments)
            except json.JSONDecodeError as exc:
                raise RenderError(f"{where}: arguments are not JSON: {exc}") from exc
            except JsonTooDeep as exc:
                raise RenderError(f"{where}: arguments: {exc}") from exc
            if not isinstance(args, dict):
                raise RenderError(f"messages[{i}].tool_calls[{j}] ({clip(call.name, quote=False)}): arguments must be "
                                  "a JSON object")


def parse_tool_json(index: int, text: str) -> dict[str, Any]:
    """One tools[] entry given as JSON text; RenderError naming the tool index when it is not a JSON object."""
    try:
        tool = loads_json(text)
    except json.JSONDecodeError as exc:
        raise RenderError(f"tools[{index}]: malformed JSON: {exc}") from exc
    except JsonTooDeep as exc:
        raise RenderError(f"tools[{index}]: {exc}") from exc
    if not isinstance(tool, dict):
        raise RenderError(f"tools[{index}]: must be a JSON object, got {type(tool).__name__}")
    return tool


def function_tool(index: int, name: str, description: str, parameters_json: str) -> dict[str, Any]:
    """A structured function declaration in the OpenAI tools[] shape; parameters_json must be a JSON object."""
    if not name:
        raise RenderError(f"tools[{index}]: function name is empty")
    try:
        parameters = loads_json(parameters_json) if parameters_json else {}
    except json.JSONDecodeError as exc:
        raise RenderError(f"tools[{index}] ({clip(name, quote=False)}): parameters_json is malformed JSON: {exc}"
                          ) from exc
    except JsonTooDeep as exc:
        raise RenderError(f"tools[{index}] ({clip(name, quote=False)}): parameters_json: {exc}") from exc
    if not isinstance(parameters, dict):
        raise RenderError(f"tools[{index}] ({clip(name, quote=False)}): parameters_json must be a JSON object")
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
