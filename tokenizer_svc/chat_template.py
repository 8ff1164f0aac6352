"""Chat rendering: the built-in Kimi format (docs/models.md#chat-format) or the checkpoint's own Jinja template (wins).

The built-in format is in tokenizer_svc/kimi_chat.py (re-exported here); its markers, and their inverse for model
output (`parse_tool_calls`), in kimiserve/kimi_chat.py, shared with the router.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kimiserve.chat_continuation import ContinuationError, check_final_message, generation_prompt
from kimiserve.limits import clip
from kimiserve.tokenizer_files.errors import TokenizerLoadError
from tokenizer_svc.chat_types import validate_messages
from tokenizer_svc.errors import RenderError
from tokenizer_svc.kimi_chat import (  # noqa: F401 - the Kimi format's names are this module's too
    ARG_BEGIN, BUILTIN_SOURCE, CALL_BEGIN, CALL_END, GENERATION_PROMPT, IM_END, IM_MIDDLE, KIMI_DEFAULT_SYSTEM_PROMPT,
    ROLE_TOKENS, SECTION_BEGIN, SECTION_END, BuiltinKimiTemplate, Messages, Tools)

CHAT_TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplate(Protocol):
    source: str  # "builtin:kimi", "chat_template.jinja" or "tokenizer_config.json"
    sha256: str  # of the template text (of BUILTIN_SOURCE for the built-in one)

    def render(self, messages: Messages, tools: Tools, add_generation_prompt: bool,
               continue_final_message: bool = False) -> str:
        ...


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

    def render(self, messages: Messages, tools: Tools, add_generation_prompt: bool,
               continue_final_message: bool = False) -> str:
        """continue_final_message: the rendering without a generation prompt, cut where the final message's text
        ends (_open_final_message), for the model to continue it."""
        gen = add_generation_prompt and not continue_final_message
        try:
            text = self._render(messages, tools, gen)
        except Exception as exc:  # any exception a template raises is this request's render error
            index = self._first_failing_message(messages, tools, gen)
            # The template's message may quote the input (e.g. raise_exception on a whole message): cut it short.
            raise RenderError(
                f"messages[{index}]: chat template ({self.source}) raised {type(exc).__name__}: {clip(str(exc))}"
            ) from exc
        return self._open_final_message(text, messages) if continue_final_message else text

    def _open_final_message(self, text: str, messages: Messages) -> str:
        """`text` cut right after the last place the final message's text appears, as vLLM does (through
        transformers 4's apply_chat_template): a template knows nothing of open turns, so whatever closes the turn
        follows that text. A template that trims the message is matched on the trimmed text; its trailing whitespace
        is kept only where the template kept it."""
        content = messages[-1].content
        core = content.strip()
        at = text.rfind(core) if core else -1
        if at < 0:  # "" is found anywhere: an empty message gives no place to cut at either
            raise RenderError(f"messages[{len(messages) - 1}]: continue_final_message: the chat template "
                              f"({self.source}) renders no text of the final message to continue from"
                              + ("" if core else " (it has none)"))
        kept = content.lstrip()
        return text[:at + len(kept)] if text.startswith(kept, at) else text[:at + len(core)]

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


def render_chat(template: ChatTemplate, messages: Messages, tools: Tools, add_generation_prompt: bool,
                max_message_chars: int, continue_final_message: bool = False) -> str:
    """Validate, then render. Raises RenderError naming the message index (or the continue_final_message field)."""
    validate_messages(messages, max_message_chars)
    if continue_final_message:
        try:
            generation_prompt(add_generation_prompt, True)
            check_final_message(messages)
        except ContinuationError as exc:
            raise RenderError(str(exc)) from exc
    return template.render(messages, tools, add_generation_prompt, continue_final_message)
