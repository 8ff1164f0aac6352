"""The Kimi chat format's markers and the parsing of a model's reply, shared by the tokenizer service (which renders
the markers into prompts) and the router (which splits replies into reasoning, content and tool calls).

A reply, special tokens kept as text, looks like

    [<think>REASONING</think>] CONTENT [<|tool_calls_section_begin|> CALLS <|tool_calls_section_end|>] [TAIL]

with each call `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>`. Every marker is a single
special token, so a marker's text always arrives whole in one detokenized delta.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_BEGIN, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ToolCall:
    """One function call made by the assistant. `arguments` is a JSON object as text (cut: as far as it was
    written when max_tokens cut the reply)."""

    id: str
    name: str
    arguments: str
    cut: bool = False


_CALL_RE = re.compile(
    re.escape(CALL_BEGIN) + r"((?:(?!" + re.escape(CALL_BEGIN) + r").)*?)" + re.escape(ARG_BEGIN)
    + r"((?:(?!" + re.escape(CALL_BEGIN) + r").)*?)" + re.escape(CALL_END),
    re.DOTALL,
)
_ID_RE = re.compile(r"^(?:functions\.)?(?P<name>.+?)(?::\d+)?$", re.DOTALL)
_CUT_ID_RE = re.compile(r"^(?:functions\.)?(?P<name>[^:]+):\d*$", re.DOTALL)  # the name written, its index maybe not


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split model output (special tokens kept as text) into content and the calls of its tool-calls section.

    Content is the text outside the section. Arguments are returned verbatim, not validated. A last call cut (by
    max_tokens) once its function's name was written (`functions.NAME:`) is a call with the id and arguments
    generated so far, as OpenAI's API returns a call cut by the token limit (finish reason length, its arguments
    unterminated JSON). Anything else the section holds that is not a call (cut inside the name, or malformed) is
    kept as raw text at the end of the content, never dropped.
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
    cut = _cut_call(leftover)
    if cut is not None:
        calls.append(cut)
        leftover = ""
    return head + tail + (leftover if leftover.strip() else ""), calls


def _cut_call(text: str) -> ToolCall | None:
    """The call in `text` if it is exactly one call's start, cut after its name: CALL_BEGIN NAME:[INDEX [ARG_BEGIN
    ARGS...]] (the id's `functions.` prefix optional, as for a whole call)."""
    begin, found, rest = text.strip().partition(CALL_BEGIN)
    call_id, has_args, arguments = rest.partition(ARG_BEGIN)
    markers = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)
    name = _CUT_ID_RE.match(call_id.strip())
    if begin or not found or name is None or any(m in call_id + arguments for m in markers):
        return None
    return ToolCall(id=call_id.strip(), name=name.group("name"), arguments=arguments.strip(), cut=True)


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest) of a whole reply: the reasoning is the text of a leading <think>...</think> block (all of
    the text after <think> when the block was never closed, e.g. cut by max_tokens). No leading block: ("", text)."""
    if not text.startswith(THINK_BEGIN):
        return "", text
    reasoning, _, rest = text[len(THINK_BEGIN):].partition(THINK_END)
    return reasoning, rest


class ReplySplitter:
    """Splits a streamed reply into reasoning and content deltas as it arrives; `finish` parses the tool calls.

    Content is streamed only up to a tool-calls section (the section becomes structured calls at the end), and the
    text after the section (and an unfinished call's raw text) arrives with `finish`. Concatenating every delta gives
    exactly split_reasoning + parse_tool_calls of the whole reply.
    """

    def __init__(self) -> None:
        self._raw = ""
        self._reasoning_shown = 0
        self._content_shown = 0
        self._tokens_before_close = 0  # tokens fed while no THINK_END had arrived

    def feed(self, delta: str, tokens: int = 0) -> tuple[str, str]:
        """(reasoning delta, content delta) that are safe to show now; `tokens`: how many generated tokens made
        `delta` (for reasoning_tokens)."""
        if THINK_END not in self._raw:  # the token that completes THINK_END still belongs to the block
            self._tokens_before_close += tokens
        self._raw += delta
        if THINK_BEGIN.startswith(self._raw):  # undecided: the reply may yet open a thinking block
            return "", ""
        reasoning, rest = split_reasoning(self._raw)
        if self._raw.startswith(THINK_BEGIN) and THINK_END not in self._raw:
            reasoning = _without_partial(reasoning, THINK_END)
        content = _without_partial(rest.split(SECTION_BEGIN, 1)[0], SECTION_BEGIN)
        return self._take(reasoning, content)

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """(reasoning delta, content delta, tool calls) at the end of the reply."""
        reasoning, rest = split_reasoning(self._raw)
        content, calls = parse_tool_calls(rest)
        r, c = self._take(reasoning, content)
        return r, c, calls

    @property
    def reasoning_tokens(self) -> int:
        """How many of the tokens fed so far made the leading thinking block, markers included (0: no block)."""
        return self._tokens_before_close if self._raw.startswith(THINK_BEGIN) else 0

    def _take(self, reasoning: str, content: str) -> tuple[str, str]:
        r, c = reasoning[self._reasoning_shown:], content[self._content_shown:]
        self._reasoning_shown = max(self._reasoning_shown, len(reasoning))
        self._content_shown = max(self._content_shown, len(content))
        return r, c


def _without_partial(text: str, marker: str) -> str:
    """`text` less a tail that could be the start of `marker` (held back until the next delta decides)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return text[:-n]
    return text
