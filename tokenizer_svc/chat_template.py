"""Chat rendering: the built-in Kimi format (docs/models.md#chat-format) or the checkpoint's own Jinja template (wins).

Also `parse_tool_calls`, the inverse for model output: the router turns a Kimi tool-calls section back into
structured calls.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kimiserve.limits import clip
from tokenizer_svc.chat_types import ChatMessage, ToolCall, validate_messages
from tokenizer_svc.errors import RenderError, TokenizerLoadError

KIMI_DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"
ROLE_TOKENS = {
    "system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>", "tool": "<|im_system|>",
}
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
GENERATION_PROMPT = f"{ROLE_TOKENS['assistant']}assistant{IM_MIDDLE}"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
BUILTIN_SOURCE = "builtin:kimi"

Messages = Sequence[ChatMessage]
Tools = Sequence[Mapping[str, Any]]  # OpenAI-style tools[] entries


class ChatTemplate(Protocol):
    source: str  # "builtin:kimi", "chat_template.jinja" or "tokenizer_config.json"
    sha256: str  # of the template text (of BUILTIN_SOURCE for the built-in one)

    def render(self, messages: Messages, tools: Tools, add_generation_prompt: bool) -> str:
        ...


def _turn(role_token: str, name: str, body: str) -> str:
    return f"{role_token}{name}{IM_MIDDLE}{body}{IM_END}"


class BuiltinKimiTemplate:
    """The Kimi chat format, written out in Python so it needs no template file."""

    source = BUILTIN_SOURCE
    sha256 = hashlib.sha256(BUILTIN_SOURCE.encode()).hexdigest()

    def render(self, messages: Messages, tools: Tools, add_generation_prompt: bool) -> str:
        parts: list[str] = []
        if tools:
            declared = json.dumps(list(tools), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            parts.append(_turn(ROLE_TOKENS["system"], "tool_declare", declared))
        if messages[0].role != "system":
            parts.append(_turn(ROLE_TOKENS["system"], "system", KIMI_DEFAULT_SYSTEM_PROMPT))
        call_names: dict[str, str] = {}  # tool_call_id -> function name, so a tool result without a name gets one
        for msg in messages:
            if msg.role == "tool":
                name = msg.name or call_names.get(msg.tool_call_id, "tool")
                parts.append(_turn(ROLE_TOKENS["tool"], name, f"## Return of {msg.tool_call_id}\n{msg.content}"))
                continue
            body = msg.content
            if msg.tool_calls:
                calls = []
                for j, call in enumerate(msg.tool_calls):
                    call_id = call.id or f"functions.{call.name}:{j}"  # Kimi's id form, index within the turn
                    call_names[call_id] = call.name
                    calls.append(f"{CALL_BEGIN}{call_id}{ARG_BEGIN}{call.arguments}{CALL_END}")
                body += SECTION_BEGIN + "".join(calls) + SECTION_END
            parts.append(_turn(ROLE_TOKENS[msg.role], msg.name or msg.role, body))
        if add_generation_prompt:
            parts.append(GENERATION_PROMPT)
        return "".join(parts)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF chat templates expect transformers' tojson (no HTML escaping, keys in order), not Jinja's built-in one.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


class JinjaChatTemplate:
    """A checkpoint's chat template, run in an immutable sandbox (the template is data from the checkpoint)."""

    def __init__(self, text: str, source: str, config: Mapping[str, Any]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]  # as transformers renders
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(text)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerLoadError(f"{source}: chat template does not compile: line {exc.lineno}: {exc}") from exc
        self.source = source
        self.sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        # Templates may refer to the special-token strings by their config names (bos_token, eos_token, ...).
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        self._specials = {k: _token_content(config.get(k)) for k in names}

    def _render(self, messages: Messages, tools: Tools, add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=[m.as_openai() for m in messages],
            tools=list(tools) or None,
            add_generation_prompt=add_generation_prompt,
            **self._specials,
        )

    def render(self, messages: Messages, tools: Tools, add_generation_prompt: bool) -> str:
        try:
            return self._render(messages, tools, add_generation_prompt)
        except Exception as exc:  # any exception a template raises is this request's render error
            index = self._first_failing_message(messages, tools, add_generation_prompt)
            # The template's message may quote the input (e.g. raise_exception on a whole message): cut it short.
            raise RenderError(
                f"messages[{index}]: chat template ({self.source}) raised {type(exc).__name__}: {clip(str(exc))}"
            ) from exc

    def _first_failing_message(self, messages: Messages, tools: Tools, gen: bool) -> int:
        """Index k such that messages[:k] renders and messages[:k + 1] fails, to point the client at a message.

        A binary search over prefix lengths (the whole conversation is known to fail, the empty one is taken to
        render): O(log n) renders of at most n messages each, where trying every prefix would be quadratic. When
        failures only grow with the prefix (the usual case) this is the first failing message."""
        ok, failing = 0, len(messages)
        while failing - ok > 1:
            mid = (ok + failing) // 2
            try:
                self._render(messages[:mid], tools, gen)
            except Exception:  # noqa: BLE001 - only locates the failure render() already re-raises as RenderError
                failing = mid
            else:
                ok = mid
        return failing - 1


def _token_content(value: object) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def load_chat_template(model_dir: Path, config: Mapping[str, Any]) -> ChatTemplate:
    """chat_template.jinja, else tokenizer_config.json's `chat_template`, else the built-in Kimi format."""
    path = model_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return JinjaChatTemplate(path.read_text(encoding="utf-8"), CHAT_TEMPLATE_FILE, config)
    text = config.get("chat_template")
    if isinstance(text, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
        if text is None:
            raise TokenizerLoadError(f"{model_dir}/tokenizer_config.json: chat_template list has no 'default' entry")
    if isinstance(text, str) and text:
        return JinjaChatTemplate(text, "tokenizer_config.json", config)
    return BuiltinKimiTemplate()


def render_chat(template: ChatTemplate, messages: Messages, tools: Tools,
                add_generation_prompt: bool, max_message_chars: int) -> str:
    """Validate, then render. Raises RenderError naming the message index."""
    validate_messages(messages, max_message_chars)
    return template.render(messages, tools, add_generation_prompt)


_CALL_RE = re.compile(
    re.escape(CALL_BEGIN) + r"((?:(?!" + re.escape(CALL_BEGIN) + r").)*?)" + re.escape(ARG_BEGIN)
    + r"((?:(?!" + re.escape(CALL_BEGIN) + r").)*?)" + re.escape(CALL_END),
    re.DOTALL,
)
_ID_RE = re.compile(r"^(?:functions\.)?(?P<name>.+?)(?::\d+)?$", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split model output (special tokens kept as text) into content and the calls of its tool-calls section.

    Content is the text outside the section. Arguments are returned verbatim, not validated. A call the model did not
    finish (e.g. cut by max_tokens) is not a call: its raw text is kept at the end of the content, never dropped.
    """
    head, found, rest = text.partition(SECTION_BEGIN)
    if not found:
        return text, []
    section, _, tail = rest.partition(SECTION_END)
    calls: list[ToolCall] = []
    consumed = 0
    for match in _CALL_RE.finditer(section):
        call_id = match.group(1).strip()
        name_match = _ID_RE.match(call_id)
        calls.append(ToolCall(id=call_id, name=name_match.group("name") if name_match else call_id,
                              arguments=match.group(2).strip()))
        consumed = match.end()
    leftover = section[consumed:]
    return head + tail + (leftover if leftover.strip() else ""), calls
