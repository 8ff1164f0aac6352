"""Parsing a Kimi reply: tool-call sections, thinking blocks, and the streamed split (no network)."""

import random

import pytest

from kimiserve.kimi_chat import THINK_END, ReplySplitter, ToolCall, ToolCallDelta, parse_tool_calls, split_reasoning

CALLS = ('<|tool_calls_section_begin|>'
         '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
         '<|tool_call_begin|> functions.search.web:1 <|tool_call_argument_begin|> {"q": "a<b"} <|tool_call_end|>'
         '<|tool_calls_section_end|>')


def test_parse_tool_calls() -> None:
    content, calls = parse_tool_calls("Let me check." + CALLS)
    assert content == "Let me check."
    assert calls == [
        ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
        ToolCall("functions.search.web:1", "search.web", '{"q": "a<b"}'),
    ]
    assert parse_tool_calls("plain answer") == ("plain answer", [])


def test_a_call_cut_in_its_arguments_is_a_call_with_the_arguments_so_far() -> None:
    text = 'Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": '
    assert parse_tool_calls(text) == ("Sure.", [ToolCall("functions.f:0", "f", '{"a":', cut=True)])
    after_one = CALLS.removesuffix('<|tool_calls_section_end|>').replace('{"q": "a<b"} <|tool_call_end|>', "")
    assert parse_tool_calls(after_one) == ("", [ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                                                ToolCall("functions.search.web:1", "search.web", "", cut=True)])


@pytest.mark.parametrize("cut, call", [
    ("functions.ping:", ToolCall("functions.ping:", "ping", "", cut=True)),  # the name written, not its index
    ("functions.ping:12", ToolCall("functions.ping:12", "ping", "", cut=True)),
    ("ping:0<|tool_call_argument_begin|>{", ToolCall("ping:0", "ping", "{", cut=True)),
])
def test_a_call_cut_after_its_name_is_a_call(cut, call) -> None:
    assert parse_tool_calls("<|tool_calls_section_begin|><|tool_call_begin|>" + cut) == ("", [call])


@pytest.mark.parametrize("section", [
    "<|tool_call_begin|>functions.get_wea",  # cut inside the name: no name to report
    "<|tool_call_begin|>functions.f:0<|tool_call_end|>",  # no arguments marker
    "<|tool_call_begin|>functions.f:0 x<|tool_call_argument_begin|>{",  # not an id
    "<|tool_call_argument_begin|>{}<|tool_call_end|>",  # stray markers
])
def test_parse_tool_calls_keeps_what_is_not_a_call_as_text(section) -> None:
    assert parse_tool_calls("<|tool_calls_section_begin|>" + section) == (section, [])


def test_an_id_cut_short_by_the_next_call_is_text_and_the_next_call_a_call() -> None:
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_begin|>functions.b:1"
            "<|tool_call_argument_begin|>{}<|tool_call_end|>")
    assert parse_tool_calls(text) == ("<|tool_call_begin|>functions.a:0", [ToolCall("functions.b:1", "b", "{}")])


def test_content_keeps_reply_order_around_calls() -> None:
    """Text in the section that is not a call stays where the model wrote it: before the tail, between the calls."""
    call = "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
    text = "Head.<|tool_calls_section_begin|>stray " + call + " \n " + call + "<|tool_calls_section_end|> tail"
    assert parse_tool_calls(text) == ("Head.stray  tail", [ToolCall("functions.f:0", "f", "{}")] * 2)


@pytest.mark.parametrize("section", [
    '<|tool_call_begin|>f:0<|tool_call_argument_begin|>{"a": 1}<|tool_call_begin|>g:1<|tool_call_argument_begin|>{}',
    '<|tool_call_begin|>f:0<|tool_call_argument_begin|>{"a": 1}<|tool_calls_section_end|>',
])
def test_a_call_without_its_end_marker_ends_at_the_next_marker(section) -> None:
    _, calls = parse_tool_calls("<|tool_calls_section_begin|>" + section)
    assert calls[0] == ToolCall("f:0", "f", '{"a": 1}')


@pytest.mark.parametrize("text, expected", [
    ("<think>plan</think>answer", ("plan", "answer")),
    ("<think>cut off by max_tokens", ("cut off by max_tokens", "")),
    ("answer <think>not leading</think>", ("", "answer <think>not leading</think>")),
    ("", ("", "")),
])
def test_split_reasoning(text, expected) -> None:
    assert split_reasoning(text) == expected


def stream(deltas):
    """(reasoning, content, calls rebuilt from the call deltas, (reasoning, content) delta of each feed), asserting
    that `finish` returns the same calls whole."""
    s = ReplySplitter()
    reasoning, content, steps, built = "", "", [], []
    for d in [*deltas, None]:
        if d is None:
            r, c, call_deltas, calls = s.finish()
        else:
            (r, c, call_deltas), calls = s.feed(d), None
            steps.append((r, c))
        reasoning, content = reasoning + r, content + c
        for cd in call_deltas:
            if cd.index == len(built):
                assert cd.id is not None and cd.name is not None, "a call's first delta names it"
                built.append([cd.id, cd.name, ""])
            else:
                assert cd.id is None and cd.name is None and cd.index < len(built)
            built[cd.index][2] += cd.arguments
    assert [[c.id, c.name, c.arguments] for c in calls] == built, "streamed calls differ from the whole ones"
    return reasoning, content, calls, steps


@pytest.mark.parametrize("deltas", [
    ["<think>", "a plan", "</think>", "Let me ", "check.", CALLS, " tail"],
    ["<", "think>a plan</", "think>Let me check.", "<|tool_calls_", "section_begin|>" + CALLS[28:] + " tail"],
    ["Let me check.", CALLS[:40], CALLS[40:], " tail"],
    ["<think>a plan"],
    ["just text"],
])
def test_streamed_split_equals_the_whole_reply_parsed(deltas) -> None:
    whole = "".join(deltas)
    reasoning, rest = split_reasoning(whole)
    content, calls = parse_tool_calls(rest)
    assert stream(deltas)[:3] == (reasoning, content, calls)


REPLIES = [
    "<think>plan</think>Let me check." + CALLS + " tail",
    "Sure." + CALLS[:-len("<|tool_calls_section_end|>")]
    + "<|tool_call_begin|>functions.f:2<|tool_call_argument_begin|>{",
    '<|tool_calls_section_begin|>x <|tool_call_begin|>bad id<|tool_call_argument_begin|>{} <|tool_call_end|> '
    '<|tool_call_begin|>functions.g:0<|tool_call_argument_begin|> {"k": " v "} <|tool_calls_section_end|>after',
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.ping:",
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_wea",
    "a <|tool_call_begin|> not a section <|tool_calls_section_end|>",
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_begin|>functions.b:1"
    "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_call_end|>",  # an id cut short by the next call
]


@pytest.mark.parametrize("reply", REPLIES)
@pytest.mark.parametrize("seed", range(20))
def test_any_split_into_deltas_streams_the_whole_parse(reply, seed) -> None:
    """Cut anywhere (inside markers too), the deltas add up to the whole reply's parse, calls included."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(reply)), min(len(reply) - 1, rng.randint(1, 12))))
    deltas = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
    reasoning, rest = split_reasoning(reply)
    content, calls = parse_tool_calls(rest)
    assert stream(deltas)[:3] == (reasoning, content, calls)


def test_a_call_streams_as_its_arguments_arrive() -> None:
    s = ReplySplitter()
    got = [s.feed(d)[2] for d in ["Ok.<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.f:0",
                                  "<|tool_call_argument_begin|>", '{"a"', ": 1} ", "}", "<|tool_call_end|>"]]
    assert got == [[], [], [], [ToolCallDelta(0, "", "functions.f:0", "f")], [ToolCallDelta(0, '{"a"')],
                   [ToolCallDelta(0, ": 1}")], [ToolCallDelta(0, " }")], []]


def test_no_marker_text_is_streamed_early() -> None:
    *_, steps = stream(["<think>", "plan </", "think>", "ok <|tool_calls", "_section_begin|>"])
    assert steps == [("", ""), ("plan ", ""), ("", ""), ("", "ok "), ("", "")]


@pytest.mark.parametrize("tokens, expected", [
    (["<think>", "a", " plan", "</think>", "Sure", "."], 4),  # the markers are tokens of their own
    (["<", "think>a", " plan</", "think>", "Sure"], 4),  # spelled out: the token that closes the block is in it
    (["<", "think>plan</think>Sure"], 2),  # one token both closes the block and starts the content
    (["<think>", "cut", " off"], 3),  # never closed (max_tokens): the whole reply
    (["<", "b>bold"], 0),  # looked like a block opening, was not
    (["Sure", " <think>", "x", "</think>"], 0),  # a block that does not lead is content
    (["<think>", "x", "</think>", "", ""], 3),  # hidden tokens (end of turn) after the block add no text
])
def test_reasoning_tokens_are_the_tokens_up_to_the_end_of_the_leading_block(tokens, expected) -> None:
    s = ReplySplitter()
    for t in tokens:
        s.feed(t, tokens=1)
    s.finish()
    assert s.reasoning_tokens == expected


def test_the_splitter_holds_back_only_a_markers_length():
    """Each delta is read once: what a streamed reply keeps unread is never more than a marker's start (or a call's
    id, or whitespace), however long the thinking, content or arguments grow, so a reply costs linear time."""
    s = ReplySplitter()
    longest = max(map(len, (THINK_END, "<|tool_calls_section_begin|>", "<|tool_call_argument_begin|>")))
    for d in ["<think>", *[" thought"] * 500, "</think>", *[" said"] * 500, CALLS[:60], *[' "x",'] * 500]:
        s.feed(d)
        assert len(s._held) < longest and len(s._scanner._pending) < longest
