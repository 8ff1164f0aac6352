"""Chat rendering against strings written by hand from docs/models.md#chat-format, checkpoint templates, render errors,
and parsing tool calls back out of model output."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NamedTuple

import pytest

from kimiserve.limits import MAX_ERROR_CHARS, MAX_JSON_DEPTH
from kimiserve.tokenizer_files.errors import TokenizerLoadError
from tokenizer_svc.chat_template import BuiltinKimiTemplate, JinjaChatTemplate, load_chat_template, render_chat
from tokenizer_svc.chat_types import ChatMessage, ToolCall, function_tool, parse_tool_json
from tokenizer_svc.errors import RenderError

LIMIT = 10_000


class FunctionTool(NamedTuple):
    name: str
    description: str
    parameters_json: str

DEFAULT_SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
    },
}


def render(messages: list[ChatMessage], tools: list[dict] | None = None, gen: bool = True) -> str:
    return render_chat(BuiltinKimiTemplate(), messages, tools or [], gen, LIMIT)


def test_default_system_inserted_and_generation_prompt() -> None:
    got = render([ChatMessage("user", "Hi there")])
    assert got == (
        DEFAULT_SYSTEM
        + "<|im_user|>user<|im_middle|>Hi there<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|>"
    )


def test_own_system_turn_and_names_and_no_generation_prompt() -> None:
    got = render(
        [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi", name="ann"), ChatMessage("assistant", "Hello")],
        gen=False,
    )
    assert got == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>ann<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello<|im_end|>"
    )


def test_tools_declared_first_with_sorted_keys_then_calls_and_results() -> None:
    messages = [
        ChatMessage("user", "Weather in Paris and Rome?"),
        ChatMessage(
            "assistant",
            "Checking.",
            tool_calls=(
                ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                ToolCall("", "get_weather", '{"city": "Rome"}'),  # no id: the Kimi form is generated
            ),
        ),
        ChatMessage("tool", "sunny", tool_call_id="functions.get_weather:0"),  # name looked up from the call
        ChatMessage("tool", "rain", name="get_weather", tool_call_id="functions.get_weather:1"),
    ]
    tools_json = (
        '[{"function":{"description":"Weather of a city","name":"get_weather","parameters":'
        '{"properties":{"city":{"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]'
    )
    assert render(messages, [WEATHER_TOOL]) == (
        "<|im_system|>tool_declare<|im_middle|>" + tools_json + "<|im_end|>"
        + DEFAULT_SYSTEM
        + "<|im_user|>user<|im_middle|>Weather in Paris and Rome?<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|>Checking."
        + "<|tool_calls_section_begin|>"
        + '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        + '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
        + "<|tool_calls_section_end|><|im_end|>"
        + "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
        + "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:1\nrain<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|>"
    )


def test_unknown_tool_result_name_falls_back_to_tool() -> None:
    got = render([ChatMessage("system", "s"), ChatMessage("tool", "42", tool_call_id="call_x")], gen=False)
    assert got == (
        "<|im_system|>system<|im_middle|>s<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of call_x\n42<|im_end|>"
    )


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([ChatMessage("user", "a"), ChatMessage("wizard", "b")], r"messages\[1\]: unknown role 'wizard'"),
        ([ChatMessage("user", "a"), ChatMessage("user", "x" * (LIMIT + 1))], r"messages\[1\]: 10001 characters"),
        (
            [
                ChatMessage("user", "a"),
                ChatMessage("user", "b"),
                ChatMessage("assistant", "", tool_calls=(ToolCall("", "f", "{nope"),)),
            ],
            r"messages\[2\]\.tool_calls\[0\] \(f\): arguments are not JSON",
        ),
        ([ChatMessage("assistant", "", tool_calls=(ToolCall("", "f", "[1]"),))], r"messages\[0\].*JSON object"),
        ([ChatMessage("user", "a"), ChatMessage("tool", "r")], r"messages\[1\]: a tool message needs the tool_call_id"),
        ([ChatMessage("user", "a", tool_calls=(ToolCall("", "f", "{}"),))], r"messages\[0\]: role 'user' cannot carry"),
        ([ChatMessage("user", "a"), ChatMessage("tool", "r", tool_call_id="c", reasoning_content="t")],
         r"messages\[1\]: role 'tool' cannot carry reasoning_content"),
        ([ChatMessage("user", "a"), ChatMessage("assistant", "b", reasoning_content="t" * LIMIT)],
         r"messages\[1\]: 10001 characters"),
        ([], r"messages: the conversation is empty"),
    ],
    ids=[
        "unknown-role", "oversized", "args-not-json", "args-not-object", "tool-without-id", "user-tool-calls",
        "tool-reasoning", "oversized-with-reasoning", "empty",
    ],
)
def test_render_errors_name_the_message(messages: list[ChatMessage], match: str) -> None:
    with pytest.raises(RenderError, match=match):
        render(messages)


def test_reasoning_is_rendered_back_only_in_the_exchange_still_going_on() -> None:
    """After the last user message (a tool-call loop) an assistant turn's reasoning is written back as the model
    wrote it, <think>...</think> before the content; in an earlier exchange it is left out."""
    call = ToolCall("functions.f:0", "f", "{}")
    got = render([ChatMessage("user", "q1"), ChatMessage("assistant", "a1", reasoning_content="old"),
                  ChatMessage("user", "q2"), ChatMessage("assistant", "", tool_calls=(call,), reasoning_content="new"),
                  ChatMessage("tool", "r", tool_call_id="functions.f:0")])
    assert "old" not in got and "<|im_assistant|>assistant<|im_middle|>a1<|im_end|>" in got
    assert ("<|im_assistant|>assistant<|im_middle|><think>new</think><|tool_calls_section_begin|>"
            "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>"
            "<|tool_calls_section_end|><|im_end|>") in got


def test_a_checkpoint_template_reads_reasoning_content(tmp_path: Path) -> None:
    template = "{% for m in messages %}{% if m.reasoning_content %}<{{ m.reasoning_content }}>{% endif %}" \
               "{{ m.content }}|{% endfor %}"
    loaded = load_chat_template(tmp_path, write_config(tmp_path, chat_template=template))
    got = render_chat(loaded, [ChatMessage("user", "q"), ChatMessage("assistant", "a", reasoning_content="t")], [],
                      False, LIMIT)
    assert got == "q|<t>a|"


def write_config(model_dir: Path, **extra: object) -> dict:
    config = {"bos_token": "[BOS]", "eos_token": "[EOS]", **extra}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return config


def test_checkpoint_template_wins(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    config = write_config(tmp_path, chat_template=template)
    loaded = load_chat_template(tmp_path, config)
    assert loaded.source == "tokenizer_config.json"
    assert render_chat(loaded, [ChatMessage("user", "hi")], [], True, LIMIT) == "[user:hi]>"
    # chat_template.jinja beats the config's template; tools and special-token names reach the template.
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ tools | tojson }}|{{ messages[0].content }}")
    loaded = load_chat_template(tmp_path, config)
    assert loaded.source == "chat_template.jinja"
    got = render_chat(loaded, [ChatMessage("user", "hé")], [{"b": 1, "a": "é"}], False, LIMIT)
    assert got == '[BOS][{"b": 1, "a": "é"}]|hé'
    assert load_chat_template(tmp_path / "missing", {}).source == "builtin:kimi"


def test_template_exception_names_the_message(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' and not m.content %}"
        "{{ raise_exception('assistant turn is empty') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    loaded = load_chat_template(tmp_path, write_config(tmp_path, chat_template=template))
    messages = [
        ChatMessage("user", "a"), ChatMessage("user", "b"), ChatMessage("assistant", ""), ChatMessage("user", "c"),
    ]
    expected = r"messages\[2\]: chat template \(tokenizer_config.json\) raised .*assistant turn is empty"
    with pytest.raises(RenderError, match=expected):
        render_chat(loaded, messages, [], True, LIMIT)


def test_template_failure_is_located_in_logarithmic_renders(tmp_path: Path, monkeypatch) -> None:
    """Locating the failing message renders O(log n) prefixes, not every prefix (quadratic in the conversation),
    and a template error that quotes the input is cut short."""
    template = (
        "{% for m in messages %}{% if m.content == 'bad' %}{{ raise_exception('bad turn: ' ~ messages|tojson) }}"
        "{% endif %}{{ m.content }}{% endfor %}"
    )
    loaded = load_chat_template(tmp_path, write_config(tmp_path, chat_template=template))
    renders = []
    original = JinjaChatTemplate._render

    def counted(self, messages, tools, gen):
        renders.append(len(messages))
        return original(self, messages, tools, gen)

    monkeypatch.setattr(JinjaChatTemplate, "_render", counted)
    messages = [ChatMessage("user", "x" * 100)] * 3000 + [ChatMessage("user", "bad")] + [ChatMessage("user", "y")]
    with pytest.raises(RenderError, match=r"messages\[3000\]: .* raised TemplateError: bad turn") as e:
        render_chat(loaded, messages, [], True, 1_000)
    assert len(renders) <= 2 + math.ceil(math.log2(len(messages))), renders
    assert len(str(e.value)) < MAX_ERROR_CHARS + 200 and "more characters cut" in str(e.value)


@pytest.mark.parametrize(
    "messages,tools",
    [
        ([ChatMessage("assistant", "", tool_calls=(ToolCall("", "f", '{"a":' + "[" * 5_000),))], []),
        ([ChatMessage("assistant", "", tool_calls=(ToolCall("", "f", '{"a":' + "[" * 64 + "]" * 64 + "}"),))], []),
        ([ChatMessage("user", "a")], ["[" * 100_000]),
        ([ChatMessage("user", "a")], [FunctionTool("f", "", '{"a":' * 5_000)]),
    ],
    ids=["args-recursion", "args-one-past-the-limit", "tool-json", "parameters"],
)
def test_deeply_nested_json_is_a_render_error(messages: list[ChatMessage], tools: list) -> None:
    """Nesting past MAX_JSON_DEPTH is refused by name (Python's parser would raise RecursionError around 1,000)."""
    with pytest.raises(RenderError, match=rf"(messages\[0\]|tools\[0\]).*deeper than the limit of {MAX_JSON_DEPTH}"):
        parsed = [function_tool(0, t.name, "", t.parameters_json) if isinstance(t, FunctionTool)
                  else parse_tool_json(0, t) for t in tools]
        render(messages, parsed)


def test_json_at_the_depth_limit_renders() -> None:
    args = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    deep = {"a": json.loads(args)}
    got = render([ChatMessage("assistant", "", tool_calls=(ToolCall("", "f", json.dumps(deep)),))])
    assert json.dumps(deep) in got


def test_sandbox_refuses_mutation_and_dunder_access(tmp_path: Path) -> None:
    mutate = load_chat_template(tmp_path, write_config(tmp_path, chat_template="{{ messages.append(1) }}"))
    with pytest.raises(RenderError, match="SecurityError"):
        render_chat(mutate, [ChatMessage("user", "a")], [], True, LIMIT)
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    dunder = load_chat_template(tmp_path, write_config(tmp_path, chat_template=escape))
    with pytest.raises(RenderError, match="SecurityError: access to attribute '__class__'"):
        render_chat(dunder, [ChatMessage("user", "a")], [], True, LIMIT)


def test_template_that_does_not_compile_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="does not compile"):
        load_chat_template(tmp_path, write_config(tmp_path, chat_template="{% for %}"))


def test_startup_warm_up_renders_encodes_and_survives_a_failing_template(tmp_path: Path, tok, caplog) -> None:
    """tokenizer_svc/server.py warm: one chat through render, encode and the incremental detokenizer before SERVING;
    a template that refuses a plain user turn is logged, and the service still starts."""
    import logging

    from tokenizer_svc.server import warm
    from tokenizer_svc.service import ServedTokenizer

    rendered = []
    good = load_chat_template(tmp_path, write_config(tmp_path, chat_template="{{ messages[0].content }}!"))
    good_render = good.render
    good.render = lambda *a: rendered.append(good_render(*a)) or rendered[-1]
    warm(ServedTokenizer(tok, good, "m", "kimi_linear", LIMIT, LIMIT))
    assert rendered == ["Hello!"]
    bad = load_chat_template(tmp_path, write_config(tmp_path, chat_template="{{ raise_exception('no users') }}"))
    with caplog.at_level(logging.WARNING, logger="tokenizer_svc.server"):
        warm(ServedTokenizer(tok, bad, "m", "kimi_linear", LIMIT, LIMIT))
    assert any("chat template warm-up failed" in r.getMessage() and "no users" in r.error for r in caplog.records)


# ---- continue_final_message (vLLM's assistant prefill) -------------------------------------------------------------

PREFILL_CHAT = [ChatMessage("user", "Give me JSON"), ChatMessage("assistant", '{"answer":')]


def test_the_builtin_format_leaves_a_continued_final_turn_open() -> None:
    user = "<|im_user|>user<|im_middle|>Give me JSON<|im_end|>"
    got = render_chat(BuiltinKimiTemplate(), PREFILL_CHAT, [], False, LIMIT, continue_final_message=True)
    assert got == DEFAULT_SYSTEM + user + '<|im_assistant|>assistant<|im_middle|>{"answer":'
    # Not continued: the same turn closed, and a generation prompt only when asked for.
    closed = DEFAULT_SYSTEM + user + '<|im_assistant|>assistant<|im_middle|>{"answer":<|im_end|>'
    assert render(PREFILL_CHAT, gen=False) == closed
    assert render(PREFILL_CHAT) == closed + "<|im_assistant|>assistant<|im_middle|>"


# Turns as a typical HF template writes them: text around each message, the turn closed after it.
HF_LIKE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.parametrize(("template", "messages", "want"), [
    (HF_LIKE, PREFILL_CHAT, '<|user|>\nGive me JSON</s>\n<|assistant|>\n{"answer":'),
    # the prefill's text said earlier too: the cut is after its last occurrence, the final message's own
    (HF_LIKE, [ChatMessage("user", "Say: Sure, here"), ChatMessage("assistant", "Sure, here")],
     "<|user|>\nSay: Sure, here</s>\n<|assistant|>\nSure, here"),
    # trailing whitespace the template keeps is kept ...
    (HF_LIKE, [ChatMessage("user", "Hi"), ChatMessage("assistant", "Sure, here is ")],
     "<|user|>\nHi</s>\n<|assistant|>\nSure, here is "),
    # ... and a template that trims the message is matched on the trimmed text, as transformers does for vLLM
    (HF_LIKE.replace("m.content", "m.content | trim"), [ChatMessage("user", "Hi"), ChatMessage("assistant", " Sure ")],
     "<|user|>\nHi</s>\n<|assistant|>\nSure"),
], ids=["json", "said-before", "kept-space", "trimmed"])
def test_a_checkpoint_template_is_cut_after_the_final_messages_text(template: str, messages: list[ChatMessage],
                                                                     want: str) -> None:
    loaded = JinjaChatTemplate(template, "chat_template.jinja", {})
    assert render_chat(loaded, messages, [], False, LIMIT, continue_final_message=True) == want
    # the rendering it is cut from: the whole conversation, turns closed, no generation prompt
    assert render_chat(loaded, messages, [], False, LIMIT).startswith(want)


@pytest.mark.parametrize(("content", "why"), [("I won't show", r"from$"), (" ", r"from \(it has none\)$")])
def test_a_template_that_leaves_the_final_message_out_cannot_continue_it(content: str, why: str) -> None:
    silent = JinjaChatTemplate("{% for m in messages %}[{{ m.role }}]{% if m.role == 'user' %}{{ m.content }}"
                               "{% endif %}{% endfor %}", "chat_template.jinja", {})
    where = r"messages\[1\]: continue_final_message: the chat template \(chat_template.jinja\) renders no text .*"
    with pytest.raises(RenderError, match=where + why):
        render_chat(silent, [ChatMessage("user", "Hi"), ChatMessage("assistant", content)], [], False, LIMIT,
                    continue_final_message=True)


@pytest.mark.parametrize(("messages", "gen", "match"), [
    ([ChatMessage("user", "Hi")], False,
     r"continue_final_message: the final message \(messages\[0\]\) has role 'user'"),
    ([ChatMessage("user", "Hi"), ChatMessage("assistant", "x", tool_calls=(ToolCall("", "f", "{}"),))], False,
     r"continue_final_message: the final message \(messages\[1\]\) has tool_calls"),
    (PREFILL_CHAT, True, r"add_generation_prompt: true cannot be combined with continue_final_message"),
], ids=["not-assistant", "tool-calls", "with-generation-prompt"])
def test_what_cannot_be_continued_is_a_render_error_naming_the_field(messages, gen: bool, match: str) -> None:
    for template in (BuiltinKimiTemplate(), JinjaChatTemplate(HF_LIKE, "chat_template.jinja", {})):
        with pytest.raises(RenderError, match=match):
            render_chat(template, messages, [], gen, LIMIT, continue_final_message=True)
