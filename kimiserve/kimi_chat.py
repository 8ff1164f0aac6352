"""The Kimi chat format's markers and the parsing of a model's reply, shared by the tokenizer service (which renders
the markers into prompts) and the router (which splits replies into reasoning, content and tool calls).

A reply, special tokens kept as text, looks like

    [<think>REASONING</think>] CONTENT [<|tool_calls_section_begin|> CALLS <|tool_calls_section_end|>] [TAIL]

with each call `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>`. Every marker is a single
special token, so a marker's text always arrives whole in one detokenized delta.

A reply is read by one scan (`_read`) whether it arrives whole or in deltas: streamed, the scan of the text so far
shows only what no later text can change, so the deltas of a stream add up to the whole reply's parse exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_BEGIN, THINK_END = "<think>", "</think>"
_MARKERS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)


@dataclass(frozen=True)
class ToolCall:
    """One function call made by the assistant. `arguments` is a JSON object as text (cut: as far as it was
    written when max_tokens cut the reply)."""

    id: str
    name: str
    arguments: str
    cut: bool = False


@dataclass(frozen=True)
class ToolCallDelta:
    """What a streamed piece adds to call `index` of its reply: the call's id and name on its first delta (None on
    the later ones), then text to append to its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


# Inside a section: the markers that structure it (a second SECTION_BEGIN there is text).
_SECTION_RE = re.compile("(" + "|".join(re.escape(m) for m in (SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)) + ")")
_ID_RE = re.compile(r"^(?:functions\.)?(?P<name>\S+?)(?::\d+)?$")  # functions.NAME:INDEX, prefix and index optional
_CUT_ID_RE = re.compile(r"^(?:functions\.)?(?P<name>\S+?):\d*$")  # the name written (its colon), the index maybe not


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split model output (special tokens kept as text) into content and the calls of its tool-calls section.

    Content is the text outside the section plus whatever the section holds that is not a call (a stray marker, text
    between calls, a call whose id is not `[functions.]NAME[:INDEX]`), in reply order, never dropped. Arguments are
    returned verbatim less surrounding whitespace, not validated. A call ends at its CALL_END, or at the next call or
    the section's end if the model left CALL_END out. A last call cut (by max_tokens) once its function's name was
    written (`functions.NAME:`) is a call with the id and arguments generated so far, as OpenAI's API returns a call
    cut by the token limit (finish reason length, its arguments unterminated JSON).
    """
    content, calls = _read(text, final=True)
    return content, [ToolCall(c.id, c.name, c.arguments.strip(), c.cut) for c in calls]


@dataclass
class _Call:
    id: str
    name: str
    arguments: str = ""  # verbatim, whitespace included
    cut: bool = False


def _read(text: str, final: bool) -> tuple[str, list[_Call]]:
    """(content, calls) of a reply after its thinking block. Not final (more text may follow): only what no later text
    can change, i.e. without a tail that could start a marker, a call's id not yet followed by ARG_BEGIN, and text
    between calls that is whitespace so far."""
    if not final:
        text = _without_partial(text, _MARKERS)
    head, found, rest = text.partition(SECTION_BEGIN)
    content, calls = [head], []
    state, call_id = "between", ""

    def between(part: str, marker: bool) -> str:
        """Reads `part` between calls; returns the state after it."""
        nonlocal call_id
        if not marker:
            content.append(part if part.strip() else "")  # whitespace between calls is the format's, not content
            return "between"
        if part == CALL_BEGIN:
            call_id = ""
            return "id"
        if part == SECTION_END:
            return "after"
        content.append(part)  # a stray ARG_BEGIN or CALL_END
        return "between"

    for i, part in enumerate(_SECTION_RE.split(rest) if found else []):
        marker = i % 2 == 1
        if state == "after":
            content.append(part)
        elif state == "between":
            state = between(part, marker)
        elif not marker:  # text inside a call: its id, or its arguments
            if state == "id":
                call_id += part
            else:
                calls[-1].arguments += part
        elif state == "args":  # a call ends at any marker; one other than CALL_END is read again, between calls
            state = "between" if part == CALL_END else between(part, True)
        elif part == ARG_BEGIN and (name := _ID_RE.match(call_id.strip())):
            calls.append(_Call(call_id.strip(), name.group("name")))
            state = "args"
        else:  # not a call after all: its text is content; a marker other than ARG_BEGIN is read again
            content.append(CALL_BEGIN + call_id + (part if part == ARG_BEGIN else ""))
            state = "between" if part == ARG_BEGIN else between(part, True)
    if final and state == "args":
        calls[-1].cut = True
    if final and state == "id":
        name = _CUT_ID_RE.match(call_id.strip())
        if name is None:
            content.append(CALL_BEGIN + call_id)
        else:
            calls.append(_Call(call_id.strip(), name.group("name"), cut=True))
    return "".join(content), calls


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, rest) of a whole reply: the reasoning is the text of a leading <think>...</think> block (all of
    the text after <think> when the block was never closed, e.g. cut by max_tokens). No leading block: ("", text)."""
    if not text.startswith(THINK_BEGIN):
        return "", text
    reasoning, _, rest = text[len(THINK_BEGIN):].partition(THINK_END)
    return reasoning, rest


class ReplySplitter:
    """Splits a streamed reply into reasoning, content and tool-call deltas as it arrives.

    A call is streamed from the moment its id is complete (its ARG_BEGIN): the first delta names it, the next ones
    extend its arguments. Concatenating every delta gives exactly split_reasoning + parse_tool_calls of the whole
    reply; `finish` also returns the calls whole.
    """

    def __init__(self) -> None:
        self._raw = ""
        self._reasoning_shown = 0
        self._content_shown = 0
        self._arguments_shown: list[int] = []  # per call streamed so far: how much of its arguments
        self._tokens_before_close = 0  # tokens fed while no THINK_END had arrived

    def feed(self, delta: str, tokens: int = 0) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning delta, content delta, call deltas) that are safe to show now; `tokens`: how many generated
        tokens made `delta` (for reasoning_tokens)."""
        if THINK_END not in self._raw:  # the token that completes THINK_END still belongs to the block
            self._tokens_before_close += tokens
        self._raw += delta
        if THINK_BEGIN.startswith(self._raw):  # undecided: the reply may yet open a thinking block
            return "", "", []
        reasoning, rest = split_reasoning(self._raw)
        if self._raw.startswith(THINK_BEGIN) and THINK_END not in self._raw:
            reasoning = _without_partial(reasoning, (THINK_END,))
        content, calls = _read(rest, final=False)
        return self._take(reasoning, content, calls)

    def finish(self) -> tuple[str, str, list[ToolCallDelta], list[ToolCall]]:
        """(reasoning delta, content delta, call deltas, the calls whole) at the end of the reply."""
        reasoning, rest = split_reasoning(self._raw)
        content, calls = _read(rest, final=True)
        return (*self._take(reasoning, content, calls),
                [ToolCall(c.id, c.name, c.arguments.strip(), c.cut) for c in calls])

    @property
    def reasoning_tokens(self) -> int:
        """How many of the tokens fed so far made the leading thinking block, markers included (0: no block)."""
        return self._tokens_before_close if self._raw.startswith(THINK_BEGIN) else 0

    def _take(self, reasoning: str, content: str, calls: list[_Call]) -> tuple[str, str, list[ToolCallDelta]]:
        r, c = reasoning[self._reasoning_shown:], content[self._content_shown:]
        self._reasoning_shown = max(self._reasoning_shown, len(reasoning))
        self._content_shown = max(self._content_shown, len(content))
        deltas = []
        for k, call in enumerate(calls):
            # Surrounding whitespace is not part of the arguments; trailing whitespace may yet be followed by more.
            arguments = call.arguments.strip()
            if k == len(self._arguments_shown):
                self._arguments_shown.append(0)
                deltas.append(ToolCallDelta(k, arguments, call.id, call.name))
            elif len(arguments) > self._arguments_shown[k]:
                deltas.append(ToolCallDelta(k, arguments[self._arguments_shown[k]:]))
            self._arguments_shown[k] = max(self._arguments_shown[k], len(arguments))
        return r, c, deltas


def _without_partial(text: str, markers: tuple[str, ...]) -> str:
    """`text` less a tail that could be the start of one of `markers` (held back until the next delta decides)."""
    for n in range(min(max(map(len, markers)) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) and len(m) > n for m in markers):
            return text[:-n]
    return text
