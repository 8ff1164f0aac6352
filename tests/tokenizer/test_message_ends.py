"""Where a rendered chat prompt's messages end (RenderChatResponse.message_ends), the prefix cache's snapshot points:
each reported offset is where the token ids of that start of the conversation, rendered and tokenized on its own
(by hand-written text for the built-in format), end inside the whole prompt's ids."""

from __future__ import annotations

from kimiserve.tokenizer_files.splits import SplitRule
from tokenizer_svc import message_ends
from tokenizer_svc.chat_template import BuiltinKimiTemplate, JinjaChatTemplate
from tokenizer_svc.chat_types import ChatMessage

SYSTEM = "<|im_system|>system<|im_middle|>Answer briefly.<|im_end|>"
USER = "<|im_user|>user<|im_middle|>Hi there<|im_end|>"
ASSISTANT = "<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>"
USER2 = "<|im_user|>user<|im_middle|>More?<|im_end|>"
GEN = "<|im_assistant|>assistant<|im_middle|>"
CHAT = [ChatMessage("system", "Answer briefly."), ChatMessage("user", "Hi there"), ChatMessage("assistant", "Hello!"),
        ChatMessage("user", "More?")]


def _ends(tok, template, messages, tools=()):
    prompt = template.render(messages, list(tools), True)
    ids = tok.encode(prompt)
    return prompt, ids, message_ends.token_ends(tok.encode, prompt, ids,
                                                message_ends.char_ends(template, messages, list(tools), True, prompt))


def test_the_builtin_format_reports_every_turn_end(tok):
    prompt, ids, ends = _ends(tok, BuiltinKimiTemplate(), CHAT)
    texts = [SYSTEM, SYSTEM + USER, SYSTEM + USER + ASSISTANT, SYSTEM + USER + ASSISTANT + USER2]
    assert prompt == texts[-1] + GEN
    want = [len(tok.encode(t)) for t in texts]
    assert ends == want
    for end, text in zip(ends, texts, strict=True):
        assert ids[:end] == tok.encode(text)


def test_tool_declarations_and_the_default_system_turn_are_ends_too(tok):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    prompt, ids, ends = _ends(tok, BuiltinKimiTemplate(), [ChatMessage("user", "Hi there")], [tool])
    declared = prompt[:prompt.index("<|im_system|>system")]
    assert declared.startswith("<|im_system|>tool_declare") and declared.endswith("<|im_end|>")
    default_system = prompt[len(declared):prompt.index("<|im_user|>")]
    assert ends == [len(tok.encode(declared)), len(tok.encode(declared + default_system)),
                    len(tok.encode(declared + default_system + USER))]


def test_a_jinja_template_reports_the_starts_that_begin_the_prompt(tok):
    text = ("{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}" + GEN + "{% endif %}")
    template = JinjaChatTemplate(text, "chat_template.jinja", {})
    prompt, ids, ends = _ends(tok, template, CHAT)
    assert prompt == SYSTEM + USER + ASSISTANT + USER2 + GEN
    assert ends == [len(tok.encode(t)) for t in (SYSTEM, SYSTEM + USER, SYSTEM + USER + ASSISTANT,
                                                 SYSTEM + USER + ASSISTANT + USER2)]


def test_an_end_inside_a_merged_token_is_left_out_with_every_end_after_it(tok):
    prompt = "the<|im_end|>there"
    ids = tok.encode(prompt)
    assert tok.encode("t") + tok.encode("he") != tok.encode("the")  # the tiny BPE merges "the" across offset 1
    turn = len("the<|im_end|>")
    assert message_ends.token_ends(tok.encode, prompt, ids, [turn]) == [len(tok.encode("the<|im_end|>"))]
    assert message_ends.token_ends(tok.encode, prompt, ids, [1, turn]) == []


def test_piece_encoder_encodes_each_piece_once_within_its_bound(tok):
    calls = []

    def encode(text):
        calls.append(text)
        return tok.encode(text)

    prompt, ids, _ = _ends(tok, BuiltinKimiTemplate(), CHAT)
    ends = message_ends.char_ends(BuiltinKimiTemplate(), CHAT, [], True, prompt)
    expected = message_ends.token_ends(tok.encode, prompt, ids, ends)
    pieces = message_ends.PieceEncoder(encode, max_chars=1 << 20)
    assert message_ends.token_ends(pieces, prompt, ids, ends) == expected
    first = len(calls)
    assert first == len(ends)
    assert message_ends.token_ends(pieces, prompt, ids, ends) == expected
    assert len(calls) == first == pieces.misses, "the second request's pieces come from the cache"
    got = pieces(SYSTEM)
    got.append(-1)  # a caller's list is its own
    assert pieces(SYSTEM) == tok.encode(SYSTEM)

    assert len(USER) + len(ASSISTANT) <= len(SYSTEM) + len(USER) < len(SYSTEM) + len(USER) + len(ASSISTANT)
    small, calls[:] = message_ends.PieceEncoder(encode, max_chars=len(SYSTEM) + len(USER)), []
    for piece in (SYSTEM, USER, USER, ASSISTANT, USER, SYSTEM):  # ASSISTANT pushes out SYSTEM, least recently used
        assert small(piece) == tok.encode(piece)
    assert calls == [SYSTEM, USER, ASSISTANT, SYSTEM]
    long = "x" * (len(SYSTEM) + len(USER) + 1)
    small(long), small(long)
    assert calls.count(long) == 2, "a piece above the bound is never kept"

    salted, calls[:] = message_ends.PieceEncoder(encode, max_chars=1 << 20), []
    for salt in ("a", "b", "a", "b"):
        assert salted.for_salt(salt)(SYSTEM) == tok.encode(SYSTEM)
    assert calls == [SYSTEM, SYSTEM], "each salt encodes the piece once and finds only its own"
    tight, calls[:] = message_ends.PieceEncoder(encode, max_chars=len(SYSTEM) + 2), []
    tight(SYSTEM, "ab"), tight(SYSTEM, "ab"), tight(SYSTEM, "abc"), tight(SYSTEM, "abc")
    assert calls == [SYSTEM] * 3, "the salt counts in the bound: SYSTEM under 'abc' is never kept"


def test_ids_by_pieces_equal_the_whole_prompts_encoding(tok):
    """RenderChat's fast path: the pieces' ids joined are the whole prompt's ids and its ends are token_ends', for
    conversations whose messages hold special-token strings, whitespace and word characters at their edges."""
    rule, pieces = SplitRule(tok.hf), message_ends.PieceEncoder(tok.encode, max_chars=1 << 20)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    odd = ["the ", " the", "<|im_end|>", "x<|im_user|>y", "\n", "", "日本 é_", '"the."', "<|im_middle|>the"]
    conversations = [(CHAT, []), ([ChatMessage("user", "Hi there")], [tool]),
                     *(([ChatMessage("system", a), ChatMessage("user", b), ChatMessage("assistant", c)], [])
                       for a, b, c in zip(odd, odd[3:] + odd[:3], odd[5:] + odd[:5]))]
    prefills = ["the", "Sure, here is ", '{"answer":', " ", "<|im_end|>", "日本", "x<|im_middle|>"]
    conversations += [([ChatMessage("user", "Hi there"), ChatMessage("assistant", p)], []) for p in prefills]
    for messages, tools in conversations:
        # the generation prompt, none, or the final message continued (an assistant's alone: see chat_continuation)
        for gen, cont in ((True, False), (False, False), (False, messages[-1].role == "assistant")):
            prompt = BuiltinKimiTemplate().render(messages, tools, gen, cont)
            ends = message_ends.char_ends(BuiltinKimiTemplate(), messages, tools, gen, prompt, cont)
            ids = tok.encode(prompt)
            assert message_ends.ids_by_pieces(rule, pieces, prompt, ends) == (
                ids, message_ends.token_ends(tok.encode, prompt, ids, ends)), prompt


def test_a_template_that_joins_turns_with_text_is_encoded_whole(tok):
    text = ("{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}" + GEN + "{% endif %}")
    template = JinjaChatTemplate(text, "chat_template.jinja", {})
    prompt = template.render(CHAT, [], True)
    ends = message_ends.char_ends(template, CHAT, [], True, prompt)
    assert len(ends) == len(CHAT)
    assert message_ends.ids_by_pieces(SplitRule(tok.hf), tok.encode, prompt, ends) is None


def test_a_continued_final_message_ends_only_where_the_prompt_does(tok):
    """A prefilled assistant turn is open: the turns before it end where they always do, and none is reported for
    it (it has not ended), with the built-in format and with a checkpoint template alike."""
    prefill = [*CHAT[:3], ChatMessage("assistant", "Sure, the")]
    builtin = BuiltinKimiTemplate()
    prompt = builtin.render(prefill, [], False, True)
    assert prompt == SYSTEM + USER + ASSISTANT + GEN + "Sure, the"
    ids = tok.encode(prompt)
    ends = message_ends.token_ends(tok.encode, prompt, ids,
                                   message_ends.char_ends(builtin, prefill, [], False, prompt, True))
    assert ends == [len(tok.encode(t)) for t in (SYSTEM, SYSTEM + USER, SYSTEM + USER + ASSISTANT)]
    assert message_ends.ids_by_pieces(SplitRule(tok.hf), tok.encode, prompt,
                                      message_ends.char_ends(builtin, prefill, [], False, prompt, True)) == (ids, ends)

    text = ("{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}" + GEN + "{% endif %}")
    jinja = JinjaChatTemplate(text, "chat_template.jinja", {})
    assert jinja.render(prefill, [], False, True) == prompt
    assert message_ends.char_ends(jinja, prefill, [], False, prompt, True) == [
        len(SYSTEM), len(SYSTEM + USER), len(SYSTEM + USER + ASSISTANT)]
