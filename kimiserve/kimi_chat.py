"""The Kimi chat format's markers and the parsing of a model's reply, shared by the tokenizer service (which renders
the markers into prompts) and the router (which splits replies into reasoning, content and tool calls).

A reply, special tokens kept as text, looks like

    [<think>REASONING</think>] CONTENT [<|tool_calls_section_begin|> CALLS <|tool_calls_section_end|>] [TAIL]

with each call `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>`. Every marker is a single
special token, so a marker's text always arrives whole in one detokenized delta.

A reply is read by one scanner (`_Scanner`) whether it arrives whole or in deltas. It reads each delta once (a
reply's cost is linear in its length, however long the thinking or a call's arguments) and shows only what no later
text can change, so the deltas of a stream add up to the whole reply's parse exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_BEGIN, THINK_END = "<think>", "</think>"
_SECTION_MARKERS = (SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)  # inside a section (SECTION_BEGIN there is text)


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
    scanner = _Scanner()
    scanner.feed(text, final=True)
    content, _ = scanner.take()
    return content, scanner.whole_calls()


class _Scanner:
    """Reads a reply (after its thinking block) delta by delta, each character once. What it has read is shown as
    content pieces and call deltas (`take`), holding back only what later text could change: a tail that could be a
    marker's start, a call's id until its ARG_BEGIN, whitespace between calls, and whitespace at the end of a call's
    arguments so far."""

    def __init__(self) -> None:
        self._state = "head"  # head (before the section) | between (calls) | id | args | after (the section)
        self._pending = ""  # a tail that could still be a marker's start
        self._content: list[str] = []  # content not taken yet
        self._deltas: list[ToolCallDelta] = []  # call deltas not taken yet
        self._calls: list[tuple[str, str, list[str]]] = []  # (id, name, argument pieces shown)
        self._cut = False  # the last call was cut (the reply ended inside it)
        self._call_id = ""  # state id: the id read so far
        self._between_text = False  # state between: this stretch holds more than whitespace, so it is content
        self._between_space = ""  # state between: its whitespace so far, shown once text follows
        self._args_begun = False  # state args: a non-whitespace character was read
        self._args_space = ""  # state args: trailing whitespace, shown once more text follows

    def feed(self, text: str, final: bool = False) -> None:
        buf = self._pending + text
        while True:
            markers = self._markers()
            at, marker = min(((buf.find(m), m) for m in markers if m in buf), default=(-1, ""))
            if not marker:
                break
            self._text(buf[:at])
            self._marker(marker)
            buf = buf[at + len(marker):]
        keep = 0 if final else len(buf) - len(_without_partial(buf, self._markers()))
        self._text(buf[:len(buf) - keep])
        self._pending = buf[len(buf) - keep:]
        if final:
            self._end()

    def take(self) -> tuple[str, list[ToolCallDelta]]:
        """The content and call deltas shown since the last take; a call's deltas of one take merged into one."""
        content, self._content = "".join(self._content), []
        merged: list[ToolCallDelta] = []
        for d in self._deltas:
            if merged and merged[-1].index == d.index:
                last = merged.pop()
                d = ToolCallDelta(d.index, last.arguments + d.arguments, last.id, last.name)
            merged.append(d)
        self._deltas = []
        return content, merged

    def whole_calls(self) -> list[ToolCall]:
        """Every call, whole (after feed(..., final=True))."""
        return [ToolCall(call_id, name, "".join(pieces), self._cut and k == len(self._calls) - 1)
                for k, (call_id, name, pieces) in enumerate(self._calls)]

    def _markers(self) -> tuple[str, ...]:
        return {"head": (SECTION_BEGIN,), "after": ()}.get(self._state, _SECTION_MARKERS)

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._state in ("head", "after"):
            self._content.append(text)
        elif self._state == "id":
            self._call_id += text
        elif self._state == "args":
            self._arguments(text)
        elif self._between_text:
            self._content.append(text)
        elif (space := self._between_space + text).strip():
            self._content.append(space)  # whitespace alone between calls is the format's; with text, content
            self._between_text, self._between_space = True, ""
        else:
            self._between_space = space

    def _arguments(self, text: str) -> None:
        if not self._args_begun:
            text = text.lstrip()
            if not text:
                return
            self._args_begun = True
        text = self._args_space + text
        shown = text.rstrip()
        self._args_space = text[len(shown):]
        if shown:
            self._calls[-1][2].append(shown)
            self._deltas.append(ToolCallDelta(len(self._calls) - 1, shown))

    def _marker(self, marker: str) -> None:
        if self._state == "head":
            self._between()
        elif self._state == "args":  # a call ends at any marker; one other than CALL_END is read again, between
            self._between()
            if marker != CALL_END:
                self._marker(marker)
        elif self._state == "id" and marker == ARG_BEGIN and (name := _ID_RE.match(self._call_id.strip())):
            self._open_call(name.group("name"))
            self._state, self._args_begun, self._args_space = "args", False, ""
        elif self._state == "id":  # not a call after all: its text is content; a marker but ARG_BEGIN is read again
            self._content.append(CALL_BEGIN + self._call_id + (marker if marker == ARG_BEGIN else ""))
            self._between()
            if marker != ARG_BEGIN:
                self._marker(marker)
        elif marker == CALL_BEGIN:
            self._state, self._call_id = "id", ""
        elif marker == SECTION_END:
            self._state = "after"
        else:
            self._content.append(marker)  # a stray ARG_BEGIN or CALL_END
            self._between()

    def _between(self) -> None:
        self._state, self._between_text, self._between_space = "between", False, ""

    def _end(self) -> None:
        if self._state == "args":
            self._cut = True
        elif self._state == "id":
            name = _CUT_ID_RE.match(self._call_id.strip())
            if name is None:
                self._content.append(CALL_BEGIN + self._call_id)
            else:
                self._open_call(name.group("name"))
                self._cut = True

    def _open_call(self, name: str) -> None:
        """A call begins: the id read so far is its id, and its first delta names it."""
        self._calls.append((self._call_id.strip(), name, []))
        self._deltas.append(ToolCallDelta(len(self._calls) - 1, "", self._calls[-1][0], name))


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
    reply; `finish` also returns the calls whole. Each delta is read once: a reply costs time linear in its length.
    """

    def __init__(self) -> None:
        self._state = "opening"  # opening (the reply may yet open a thinking block) | thinking | reply
        self._held = ""  # opening: the reply so far; thinking: a tail that could start THINK_END
        self._scanner = _Scanner()
        self._opened = False  # the reply opened with THINK_BEGIN
        self._tokens_before_close = 0  # tokens fed while no THINK_END had arrived

    def feed(self, delta: str, tokens: int = 0) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning delta, content delta, call deltas) that are safe to show now; `tokens`: how many generated
        tokens made `delta` (for reasoning_tokens)."""
        if self._state != "reply":  # the token that completes THINK_END still belongs to the block
            self._tokens_before_close += tokens
        reasoning = self._read(delta, final=False)
        return (reasoning, *self._scanner.take())

    def finish(self) -> tuple[str, str, list[ToolCallDelta], list[ToolCall]]:
        """(reasoning delta, content delta, call deltas, the calls whole) at the end of the reply."""
        reasoning = self._read("", final=True)
        return (reasoning, *self._scanner.take(), self._scanner.whole_calls())

    @property
    def reasoning_tokens(self) -> int:
        """How many of the tokens fed so far made the leading thinking block, markers included (0: no block)."""
        return self._tokens_before_close if self._opened else 0

    def _read(self, delta: str, final: bool) -> str:
        """Reads `delta`, passing the reply after the thinking block to the scanner; returns the reasoning shown."""
        if self._state == "opening":
            self._held += delta
            if THINK_BEGIN.startswith(self._held) and self._held != THINK_BEGIN and not final:
                return ""  # undecided: the reply may yet open a thinking block
            self._opened = self._held.startswith(THINK_BEGIN)
            self._state = "thinking" if self._opened else "reply"
            delta, self._held = (self._held[len(THINK_BEGIN):] if self._opened else self._held), ""
        if self._state == "reply":
            self._scanner.feed(delta, final)
            return ""
        text = self._held + delta
        at = text.find(THINK_END)
        if at >= 0:
            self._state, self._held = "reply", ""
            self._scanner.feed(text[at + len(THINK_END):], final)
            return text[:at]
        if final:
            self._scanner.feed("", final)
            self._held = ""
            return text  # never closed (cut by max_tokens): all of it is reasoning
        shown = _without_partial(text, (THINK_END,))
        self._held = text[len(shown):]
        return shown


def _without_partial(text: str, markers: tuple[str, ...]) -> str:
    """`text` less a tail that could be the start of one of `markers` (held back until the next delta decides)."""
    for n in range(min(max(map(len, markers), default=1) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) and len(m) > n for m in markers):
            return text[:-n]
    return text
