"""The built-in Kimi chat format (docs/models.md#chat-format), written out in Python: no template file, no Jinja.

Its own module so that code without the tokenizer service's dependencies (the training script, training/) renders
dialogues exactly as the service does; chat_template.py re-exports every name.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from kimiserve.kimi_chat import (  # the markers: one definition, shared with the router
    ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END, THINK_BEGIN, THINK_END)
from tokenizer_svc.chat_types import ChatMessage

KIMI_DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
ROLE_TOKENS = {
    "system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>", "tool": "<|im_system|>",
}
GENERATION_PROMPT = f"{ROLE_TOKENS['assistant']}assistant{IM_MIDDLE}"
BUILTIN_SOURCE = "builtin:kimi"

Messages = Sequence[ChatMessage]
Tools = Sequence[Mapping[str, Any]]  # OpenAI-style tools[] entries


def _turn(role_token: str, name: str, body: str) -> str:
    return f"{role_token}{name}{IM_MIDDLE}{body}{IM_END}"


class BuiltinKimiTemplate:
    """The Kimi chat format, written out in Python so it needs no template file."""

    source = BUILTIN_SOURCE
    sha256 = hashlib.sha256(BUILTIN_SOURCE.encode()).hexdigest()

    def render(self, messages: Messages, tools: Tools, add_generation_prompt: bool,
               continue_final_message: bool = False) -> str:
        return "".join(self.render_parts(messages, tools, add_generation_prompt, continue_final_message))

    def render_parts(self, messages: Messages, tools: Tools, add_generation_prompt: bool,
                     continue_final_message: bool = False) -> list[str]:
        """The rendering, one string per turn (tool declarations, default system turn, each message, the generation
        prompt): where each ends is where a prefix cache may snapshot (tokenizer_svc/message_ends.py).

        continue_final_message: the last turn stays open (no end-of-turn marker, no generation prompt after it), for
        the model to continue; the caller has checked it is an assistant's text (kimiserve/chat_continuation.py).

        An assistant turn's reasoning is written back as the model wrote it (<think>...</think> before the content)
        only after the last user message, in the exchange still going on (a tool-call loop); earlier turns lose it,
        as Kimi's thinking models' own template does, so old thinking does not fill the context."""
        parts: list[str] = []
        if tools:
            declared = json.dumps(list(tools), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            parts.append(_turn(ROLE_TOKENS["system"], "tool_declare", declared))
        if messages[0].role != "system":
            parts.append(_turn(ROLE_TOKENS["system"], "system", KIMI_DEFAULT_SYSTEM_PROMPT))
        call_names: dict[str, str] = {}  # tool_call_id -> function name, so a tool result without a name gets one
        last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
        for i, msg in enumerate(messages):
            if msg.role == "tool":
                name = msg.name or call_names.get(msg.tool_call_id, "tool")
                parts.append(_turn(ROLE_TOKENS["tool"], name, f"## Return of {msg.tool_call_id}\n{msg.content}"))
                continue
            body = msg.content
            if msg.reasoning_content and i > last_user:
                body = f"{THINK_BEGIN}{msg.reasoning_content}{THINK_END}{body}"
            if msg.tool_calls:
                calls = []
                for j, call in enumerate(msg.tool_calls):
                    call_id = call.id or f"functions.{call.name}:{j}"  # Kimi's id form, index within the turn
                    call_names[call_id] = call.name
                    calls.append(f"{CALL_BEGIN}{call_id}{ARG_BEGIN}{call.arguments}{CALL_END}")
                body += SECTION_BEGIN + "".join(calls) + SECTION_END
            parts.append(_turn(ROLE_TOKENS[msg.role], msg.name or msg.role, body))
        if continue_final_message:
            parts[-1] = parts[-1].removesuffix(IM_END)
        elif add_generation_prompt:
            parts.append(GENERATION_PROMPT)
        return parts
