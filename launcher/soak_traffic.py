"""What `make soak` sends (launcher/soak.py): a weighted mix of request kinds, each one function that sends one request
the way a client would (the official OpenAI SDK over HTTP, or the gRPC stubs) and returns its outcome.

An outcome is "OK" (a good request answered whole: every choice, a finish reason, usage), a status name for a
refusal or an error ("400", "INVALID_ARGUMENT", "TIMEOUT", ...), or "CUT" (the client left a stream on purpose).
MIX gives each kind its weight and the outcomes it may end with; any other outcome is an unexpected error.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import httpx
import openai

from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc

# One system message many conversations share (its rendering is a prefix the shards cache) and the users' lines.
SHARED_SYSTEM = ("You are a well-read companion who answers in the manner of a novel of manners: briefly, politely, "
                 "and with an eye for the follies of society.")
TOPICS = ("a ball at Netherfield", "an unexpected letter", "the rain at Bath", "a proposal declined",
          "a walk to the village", "the officers in town", "an evening of cards", "a visit from Lady Catherine")
WORDS = ("sense", "pride", "letter", "estate", "sister", "carriage", "morning", "fortune", "marriage", "walk",
         "gentleman", "house", "evening", "ball", "country", "heart", "family", "neighbourhood", "regiment", "tea")
LONG_PROMPT_WORDS = (600, 1500)  # words of a long prompt: about 1,000 to 3,000 tokens of the default model
# Letters of made-up words: mostly ASCII, some accented, now and then CJK or an emoji (several bytes a character),
# so that prompts are as unlike one another as real users' and the tokenizer meets new words all the time.
LETTERS = "abcdefghijklmnopqrstuvwxyz" * 8 + "éèàüößçñ" + "的一是不了人我在" + "😀🎉"


@dataclass(frozen=True)
class Clients:
    """The soak's clients: one OpenAI SDK client (HTTP, no retries) and one gRPC channel's stub, shared by all."""

    openai: openai.OpenAI
    grpc: router_pb2_grpc.RouterStub
    model: str


Kind = Callable[[Clients, random.Random], str]


def _made_up(rng: random.Random) -> str:
    """A new word; now and then a long one, as identifiers, hashes and URLs are (a tokenizer that keeps the words it
    has seen holds ~10 KB for each of those: issue 33)."""
    length = rng.randint(30, 200) if rng.random() < 0.05 else rng.randint(2, 10)
    return "".join(rng.choice(LETTERS) for _ in range(length))


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) if rng.random() < 0.7 else _made_up(rng) for _ in range(count))


def _user_line(rng: random.Random) -> str:
    return f"Tell me about {rng.choice(TOPICS)} and {_words(rng, rng.randint(1, 30))}."


def _messages(rng: random.Random, system: bool) -> list[dict[str, str]]:
    user = {"role": "user", "content": _user_line(rng)}
    return [{"role": "system", "content": SHARED_SYSTEM}, user] if system else [user]


def _chat_ok(reply, n: int, logprobs: bool = False) -> str:
    if len(reply.choices) != n or any(c.finish_reason not in ("stop", "length") for c in reply.choices):
        return "MALFORMED"
    if reply.usage is None or reply.usage.completion_tokens <= 0:
        return "MALFORMED"
    if logprobs and any(c.logprobs is None or not c.logprobs.content for c in reply.choices):
        return "MALFORMED"
    return "OK"


def _http(call: Callable[[], str]) -> str:
    """The outcome of one SDK call: its own, or the status or failure it ended with."""
    try:
        return call()
    except (openai.APITimeoutError, httpx.TimeoutException):  # the SDK wraps a timeout before the reply, not in it
        return "TIMEOUT"
    except openai.APIStatusError as e:
        return str(e.status_code)
    except openai.APIConnectionError as e:
        return f"CONNECTION {type(e.__cause__).__name__}"
    except httpx.HTTPError as e:  # a stream that broke while the client read it
        return f"STREAM {type(e).__name__}"


def chat(c: Clients, rng: random.Random, system: bool = False) -> str:
    return _http(lambda: _chat_ok(c.openai.chat.completions.create(
        model=c.model, messages=_messages(rng, system), max_tokens=rng.randint(4, 48),
        temperature=rng.choice([0.0, 0.7])), 1))


def chat_shared_system(c: Clients, rng: random.Random) -> str:
    return chat(c, rng, system=True)


def chat_n2(c: Clients, rng: random.Random) -> str:
    return _http(lambda: _chat_ok(c.openai.chat.completions.create(
        model=c.model, messages=_messages(rng, rng.random() < 0.5), max_tokens=rng.randint(4, 32), n=2,
        temperature=0.8, seed=rng.randrange(1 << 30)), 2))


def chat_logprobs(c: Clients, rng: random.Random) -> str:
    return _http(lambda: _chat_ok(c.openai.chat.completions.create(
        model=c.model, messages=_messages(rng, rng.random() < 0.5), max_tokens=rng.randint(4, 32), logprobs=True,
        top_logprobs=rng.randint(0, 5), temperature=0.0), 1, logprobs=True))


def long_chat(c: Clients, rng: random.Random) -> str:
    """A conversation of several turns with long messages, rendered and tokenized whole by the tokenizer."""
    messages = [{"role": "system", "content": SHARED_SYSTEM}]
    for _ in range(rng.randint(1, 4)):
        messages += [{"role": "user", "content": _words(rng, rng.randint(50, 300))},
                     {"role": "assistant", "content": _words(rng, rng.randint(20, 100))}]
    messages.append({"role": "user", "content": _user_line(rng)})
    return _http(lambda: _chat_ok(c.openai.chat.completions.create(
        model=c.model, messages=messages, max_tokens=rng.randint(4, 24), temperature=0.0,
        stream=False), 1))


def long_prompt(c: Clients, rng: random.Random) -> str:
    text = _words(rng, rng.randint(*LONG_PROMPT_WORDS))

    def call() -> str:
        reply = c.openai.completions.create(model=c.model, prompt=text, max_tokens=rng.randint(4, 24),
                                            temperature=0.0, logprobs=rng.choice([None, 2]))
        ok = len(reply.choices) == 1 and reply.usage is not None and reply.usage.prompt_tokens > 500
        return "OK" if ok else "MALFORMED"

    return _http(call)


def stream_cut(c: Clients, rng: random.Random) -> str:
    """A streamed chat the client leaves after a few chunks (closing the connection mid-stream)."""
    keep = rng.randint(1, 6)

    def call() -> str:
        stream = c.openai.chat.completions.create(model=c.model, messages=_messages(rng, rng.random() < 0.5),
                                                  max_tokens=200, stream=True, temperature=0.7)
        got = 0
        try:
            for _ in stream:
                got += 1
                if got >= keep:
                    return "CUT"
        finally:
            stream.close()
        return "OK"

    return _http(call)


def client_timeout(c: Clients, rng: random.Random) -> str:
    """A request the client gives up on: a long reply (streamed or not) with a timeout shorter than it takes."""
    client = c.openai.with_options(timeout=httpx.Timeout(rng.uniform(0.1, 0.8)))
    stream = rng.random() < 0.5

    def call() -> str:
        reply = client.chat.completions.create(model=c.model, messages=_messages(rng, False), max_tokens=400,
                                               temperature=0.7, stream=stream, extra_body={"ignore_eos": True})
        if not stream:
            return _chat_ok(reply, 1)
        with reply:
            for _ in reply:
                pass
        return "OK"

    return _http(call)


# Requests the HTTP API must refuse with 400: out-of-range sampling, no messages, an unknown role, a bad n.
BAD_BODIES = (
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "n": 0},
    {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5},
)


def bad_request(c: Clients, rng: random.Random) -> str:
    which = rng.randrange(len(BAD_BODIES))
    outcome = _http(lambda: _chat_ok(c.openai.chat.completions.create(model=c.model, **BAD_BODIES[which]), 1))
    return outcome if outcome == "400" else f"{outcome} (BAD_BODIES[{which}])"


def _grpc(call: Callable[[], str]) -> str:
    try:
        return call()
    except grpc.RpcError as e:
        return e.code().name


def _sampling(rng: random.Random, max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.0, 0.7]),
                                     seed=rng.randrange(1 << 30), logprobs=rng.random() < 0.3)


def _drain(chunks) -> str:
    last, streamed = None, 0
    for last in chunks:
        streamed += len(last.token_ids)
    if last is None or last.usage.completion_tokens != streamed or streamed == 0:
        return "MALFORMED"
    return "OK"


def grpc_chat(c: Clients, rng: random.Random) -> str:
    messages = [common_pb2.ChatMessage(role=m["role"], content=m["content"])
                for m in _messages(rng, rng.random() < 0.5)]
    return _grpc(lambda: _drain(c.grpc.Chat(router_pb2.ChatRequest(messages=messages,
                                                                   sampling=_sampling(rng, rng.randint(4, 48))),
                                            timeout=120)))


def grpc_generate(c: Clients, rng: random.Random) -> str:
    req = router_pb2.GenerateRequest(text=f"It is a truth universally acknowledged that {_words(rng, 12)}",
                                     sampling=_sampling(rng, rng.randint(4, 48)))
    return _grpc(lambda: _drain(c.grpc.Generate(req, timeout=120)))


def grpc_stream_cut(c: Clients, rng: random.Random) -> str:
    """A gRPC stream the client cancels after a few chunks, or cuts with a short deadline."""
    keep = rng.randint(1, 6)
    deadline = rng.random() < 0.4
    req = router_pb2.GenerateRequest(text=f"The {rng.choice(WORDS)} of the {rng.choice(WORDS)}",
                                     sampling=common_pb2.SamplingParams(max_tokens=200, ignore_eos=True,
                                                                        temperature=0.7))
    call = c.grpc.Generate(req, timeout=rng.uniform(0.1, 0.6) if deadline else 120)

    def run() -> str:
        for i, _ in enumerate(call):
            if not deadline and i + 1 >= keep:
                call.cancel()
        return "OK"

    outcome = _grpc(run)
    return "CUT" if outcome == "CANCELLED" else outcome


def grpc_bad(c: Clients, rng: random.Random) -> str:
    req = rng.choice((
        router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=0)),
        router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[5, 10**7])),
        router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4)),
    ))
    return _grpc(lambda: _drain(c.grpc.Generate(req, timeout=30)))


# kind -> (function, weight in the mix, outcomes it may end with)
MIX: dict[str, tuple[Kind, int, frozenset[str]]] = {
    "chat": (chat, 14, frozenset({"OK"})),
    "chat-shared-system": (chat_shared_system, 14, frozenset({"OK"})),
    "chat-n2": (chat_n2, 6, frozenset({"OK"})),
    "chat-logprobs": (chat_logprobs, 6, frozenset({"OK"})),
    "long-prompt": (long_prompt, 4, frozenset({"OK"})),
    "long-chat": (long_chat, 4, frozenset({"OK"})),
    "stream-cut": (stream_cut, 10, frozenset({"CUT", "OK"})),
    "client-timeout": (client_timeout, 6, frozenset({"TIMEOUT", "OK"})),
    "bad-request": (bad_request, 6, frozenset({"400"})),
    "grpc-chat": (grpc_chat, 10, frozenset({"OK"})),
    "grpc-generate": (grpc_generate, 8, frozenset({"OK"})),
    "grpc-stream-cut": (grpc_stream_cut, 10, frozenset({"CUT", "DEADLINE_EXCEEDED", "OK"})),
    "grpc-bad": (grpc_bad, 4, frozenset({"INVALID_ARGUMENT"})),
}


def pick(rng: random.Random, kinds: tuple[str, ...] = tuple(MIX)) -> str:
    """One kind of `kinds` (every kind unless narrowed, e.g. to find which one a service's memory follows)."""
    return rng.choices(kinds, [MIX[n][1] for n in kinds])[0]
