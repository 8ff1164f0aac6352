"""The prefix cache at shared boundaries, as a user meets it (issue 26), and its isolation by cache salt (issue 35).

Two stacks of the tiny kimi_linear model: one with the prefix cache on (two shards, so cache-aware routing has a
choice to get right) and one with it off, the reference every greedy reply is compared with. Chat requests sharing a
long system message restore it from the second request on (the tokenizer reports where the system message ends and
the shard snapshots there); an id prompt sharing the first 2,000 tokens of a cached 3,000-token one restores all but
less than the 256-token interval of them; a different cache_salt restores nothing, the same salt everything; and
after a mixed run the memory the cache's snapshots hold stays within its bound (the shards' metrics).

The tests share the stacks and run in file order: the salt test first, on empty caches, so that no eviction (which
the value policy may make of a short, unused entry while longer ones are held) can take its tenant's entry between
its requests."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from openai import OpenAI

from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, router_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from launcher.up import start_stack
from shard_svc.engine.prefill_share import CHUNK_ALIGN
from tests.services.conftest import Stack
from tests.services.helpers import generate, sampling, scrape, total

INTERVAL = 256  # --prefix-state-interval: finer than the default (1,024) for these short document starts
ENTRIES = 24
CAPACITY = ("--num-state-slots", "4", "--num-kv-blocks", "640", "--max-model-len", "4096",
            "--prefix-state-interval", str(INTERVAL))
GREEDY = dict(temperature=0.0, ignore_eos=True)


class HttpStack(Stack):
    def __init__(self, children, http_port: int):
        super().__init__(children)
        self.openai = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0,
                             timeout=120)

    def shard_series(self, name: str) -> list[float]:
        return [total(scrape(c.metrics_url), name) for c in self.children.values() if c.role == "shard"]

    def snapshots(self, kind: str) -> float:
        """Prefix-cache snapshots of one kind made by every shard."""
        return sum(v for c in self.children.values() if c.role == "shard"
                   for k, v in scrape(c.metrics_url).items()
                   if k.startswith("kimiserve_shard_prefix_cache_snapshots_total{") and f'kind="{kind}"' in k)

    def system_end(self, system: str, user: str) -> int:
        """Where the tokenizer service says the system message of this chat ends, in prompt tokens."""
        with grpc.insecure_channel(self.children["tokenizer"].address) as channel:
            reply = tokenizer_pb2_grpc.TokenizerStub(channel).RenderChat(tokenizer_pb2.RenderChatRequest(
                messages=[common_pb2.ChatMessage(role="system", content=system),
                          common_pb2.ChatMessage(role="user", content=user)]), timeout=30)
        return reply.message_ends[0]


def _start(model, shards: int, shard_args: tuple[str, ...]) -> HttpStack:
    http_port = free_port()
    children = start_stack(model, shards, "cpu", "127.0.0.1", free_port(), timeout=180,
                           shard_args=CAPACITY + shard_args, router_args=("--http-port", str(http_port)))
    return HttpStack(children, http_port)


@pytest.fixture(scope="module")
def stacks(tiny_linear):
    cached = _start(tiny_linear, 2, ("--prefix-cache-entries", str(ENTRIES)))
    try:
        plain = _start(tiny_linear, 1, ("--prefix-cache-entries", "0"))
    except BaseException:
        cached.close()
        raise
    yield cached, plain
    plain.close()
    cached.close()


def _chat(stack: Stack, system: str, user: str, max_tokens: int = 6, salt: str = ""):
    """One greedy Chat over gRPC: (token ids, usage)."""
    req = router_pb2.ChatRequest(
        messages=[common_pb2.ChatMessage(role="system", content=system),
                  common_pb2.ChatMessage(role="user", content=user)],
        sampling=sampling(max_tokens=max_tokens, **GREEDY), cache_salt=salt)
    ids, last = [], None
    for chunk in stack.stub.Chat(req, timeout=120):
        ids.extend(chunk.token_ids)
        last = chunk
    return ids, last.usage


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def test_a_different_cache_salt_restores_nothing_and_the_same_salt_everything(stacks):
    cached, plain = stacks
    system, user = "You keep secrets.", "The vault code of Mr 893005 is 45. " * 8
    tokenizer = cached.children["tokenizer"].metrics_url

    def pieces_from_cache() -> float:  # the tokenizer's cache of rendered pieces is keyed by the salt too
        return total(scrape(tokenizer), 'kimiserve_tokenizer_chat_pieces_total{cached="true"}')

    want, _ = _chat(plain, system, user)
    first, usage = _chat(cached, system, user, salt="tenant-a")
    assert first == want and usage.cached_prompt_tokens == 0
    for salt in ("tenant-b", ""):
        before = pieces_from_cache()
        got, other = _chat(cached, system, user, salt=salt)
        assert (got, other.cached_prompt_tokens) == (want, 0), salt
        assert pieces_from_cache() == before, salt
        again, same = _chat(cached, system, user, salt="tenant-a")  # the entry the other salt did not get is there
        assert (again, same.cached_prompt_tokens) == (want, same.prompt_tokens), salt
        assert pieces_from_cache() == before + 3, salt  # system turn, user turn, generation prompt
    # over HTTP: completions and chat bodies carry it as vLLM's `cache_salt`
    prompt = _ids(300, 4)
    replies = [cached.openai.completions.create(model="", prompt=prompt, max_tokens=3, temperature=0,
                                                extra_body={"cache_salt": salt, "ignore_eos": True})
               for salt in ("http-a", "http-b", "http-a")]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, 0, 300]
    assert len({r.choices[0].text for r in replies}) == 1


def test_chats_sharing_a_long_system_message_restore_it_from_the_second_on(stacks):
    cached, plain = stacks
    rng = random.Random(1)
    words = ["the", "house", "letter", "walk", "morning", "sister", "garden", "every", "friend", "said"]
    system = " ".join(rng.choice(words) for _ in range(700)) + "."
    users = ["What is the garden like?", "Who wrote the letter?", "Tell me about the morning walk.",
             "Which sister said it?"]
    end = cached.system_end(system, users[0])
    point = end - end % CHUNK_ALIGN  # the message point: the KDA chunk line at or before the system message's end
    assert point % INTERVAL  # so a hit of exactly `point` tokens is the message snapshot, not an interval one
    made = cached.snapshots("message")
    for i, user in enumerate(users):
        got, usage = _chat(cached, system, user)
        want, _ = _chat(plain, system, user)
        assert got == want, user
        assert usage.prompt_tokens > 1000
        if i:
            assert usage.cached_prompt_tokens == point >= 0.8 * usage.prompt_tokens, (i, end, usage)
    # the first request's, at the system message's end; the others restored it (their user turns end fewer than
    # MIN_MESSAGE_GAP tokens later: no point of their own)
    assert cached.snapshots("message") - made == 1


def test_an_id_prompt_sharing_2000_tokens_of_a_cached_3000_token_one(stacks):
    cached, plain = stacks
    long = _ids(3000, 2)
    shared = long[:2000] + _ids(300, 3)
    for prompt in (long, shared):
        got, _, last = generate(cached.stub, prompt, max_tokens=5, **GREEDY)
        want, _, _ = generate(plain.stub, prompt, max_tokens=5, **GREEDY)
        assert got == want
    assert last.usage.cached_prompt_tokens >= 2000 - INTERVAL  # 1,792: the interval snapshot below 2,000


def test_snapshot_memory_stays_within_its_bound_under_a_mixed_run(stacks):
    cached, plain = stacks
    base, other = _ids(1200, 5), _ids(1500, 6)
    shapes = [(0, 700), (1200, 40), (600, 300), (0, 1400), (900, 90), (300, 650), (1200, 200), (0, 520)]
    prompts = [start[:n] + _ids(k, 10 + 8 * j + i) for j, start in enumerate((base, other))
               for i, (n, k) in enumerate(shapes)]
    made_before = sum(cached.shard_series("kimiserve_shard_prefix_cache_snapshots_total"))
    evicted_before = sum(cached.shard_series("kimiserve_shard_prefix_cache_evictions_total"))
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: generate(cached.stub, p, max_tokens=4, **GREEDY)[0], prompts))
    for p, tokens in zip(prompts, got, strict=True):
        assert tokens == generate(plain.stub, p, max_tokens=4, **GREEDY)[0]
    entries = cached.shard_series("kimiserve_shard_prefix_cache_entries")
    made = cached.shard_series("kimiserve_shard_prefix_cache_snapshots_total")
    evicted = cached.shard_series("kimiserve_shard_prefix_cache_evictions_total")
    state = cached.shard_series("kimiserve_shard_prefix_cache_state_bytes")
    limit = cached.shard_series("kimiserve_shard_prefix_cache_state_bytes_limit")
    # this run alone made more snapshots than both shards' caches keep, so some were evicted
    assert sum(made) - made_before > 2 * ENTRIES and sum(evicted) > evicted_before
    for e, m, v, s, bound in zip(entries, made, evicted, state, limit, strict=True):
        assert e == m - v <= ENTRIES  # every snapshot made is held or was evicted
        assert s <= bound and s == bound * e / ENTRIES
