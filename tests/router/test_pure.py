"""Router logic that needs no network: stop strings, shard choice and the prefix-cache salt."""

import pytest

from router.balancer import NoHealthyShard, ShardView, pick_shard
from router.prefix_index import PrefixIndex, block_names
from router.stop_strings import StopStringFilter


def run(stops, deltas, include=False):
    f = StopStringFilter(stops, include)
    out = "".join(f.feed(d) for d in deltas)
    return out + f.flush(), f.stopped


@pytest.mark.parametrize("stops, deltas, expected, stopped", [
    (["END"], ["hello ", "wor", "ld"], "hello world", False),
    (["END"], ["abc E", "N", "D tail"], "abc ", True),
    (["END"], ["abcEND"], "abc", True),
    (["\n\n", "###"], ["a\n", "b#", "##c"], "a\nb", True),
    (["xyz"], ["xy", "a"], "xya", False),
    ([], ["a", "b"], "ab", False),
    (["ab", "b"], ["xab"], "x", True),
])
def test_stop_strings_cut_before_first_stop(stops, deltas, expected, stopped):
    assert run(stops, deltas) == (expected, stopped)


@pytest.mark.parametrize("stops, whole, kept, cut", [
    (["END"], "abc END tail", "abc END", "abc "),
    (["\n\n", "###"], "a\nb###c", "a\nb###", "a\nb"),
    (["ab", "b"], "xab yz", "xab", "x"),  # ending together: the longer
    (["b", "ab"], "xab yz", "xab", "x"),
    (["bcd", "abcde"], "abcdef", "abcd", "a"),  # complete first: the shorter, though the other starts earlier
])
def test_the_first_stop_string_complete_ends_the_text_whatever_the_deltas(stops, whole, kept, cut):
    for at in range(len(whole) + 1):
        deltas = [whole[:at], whole[at:]]
        assert run(stops, deltas, include=True) == (kept, True), deltas
        assert run(stops, deltas) == (cut, True), deltas
    assert run(stops, list(whole), include=True) == (kept, True)


@pytest.mark.parametrize("unarmed, rest, expected", [
    (["a", "a"], ["a", "a"], "aa"),  # vLLM's min_tokens 3 over "aaaa", stop "a": the 3rd token's "a" stops it
    (["xEN"], ["D tail"], "x"),  # begun while unarmed, ended after: a stop
    (["xEND", "y"], ["z"], "xENDyz"),  # ended while unarmed: text
    (["xEND"], ["yEND"], "xENDy"),  # the next one counts
])
def test_text_fed_unarmed_cannot_end_a_stop_string(unarmed, rest, expected):
    stops = ["a"] if unarmed[0] == "a" else ["END"]
    f = StopStringFilter(stops)
    out = "".join(f.feed(d, armed=False) for d in unarmed) + "".join(f.feed(d) for d in rest)
    assert out + f.flush() == expected and f.stopped == (expected != "xENDyz")


def test_held_back_text_is_never_emitted_early():
    f = StopStringFilter(["STOP"])
    assert f.feed("ST") == ""
    assert f.feed("O") == ""
    assert f.feed("x") == "S"  # only the last len("STOP") - 1 characters are held back
    assert f.flush() == "TOx"


def test_pick_shard_prefers_headroom_and_skips_unhealthy():
    a = ShardView("a", healthy=True, free_slots=4, queued=0)
    b = ShardView("b", healthy=True, free_slots=8, queued=1)
    c = ShardView("c", healthy=False, free_slots=100)
    assert pick_shard([a, b, c]).name == "b"
    b.sent_since_poll = 5
    assert pick_shard([a, b, c]).name == "a"
    with pytest.raises(NoHealthyShard, match="a"):
        pick_shard([ShardView("a"), c])


def _route(index: PrefixIndex, views: list[ShardView], prompt: list[int]) -> str:
    names = block_names(prompt)
    chosen = pick_shard(views, index.matched_tokens(names)).name
    index.record(chosen, names)
    return chosen


def test_the_next_turn_of_a_conversation_goes_where_its_prefix_went_while_that_shard_has_room():
    index, views = PrefixIndex(), [ShardView(n, healthy=True, free_slots=8) for n in ("s0", "s1", "s2")]
    turn1 = [(i * 7) % 97 for i in range(40)]
    first = _route(index, views, turn1)
    views[0].free_slots = views[1].free_slots = views[2].free_slots = 8  # the next poll: nobody busier
    next(v for v in views if v.name != first).free_slots = 9  # another shard has a little more room
    assert _route(index, views, turn1 + [1, 2, 3] * 20) == first  # 32 of its tokens were seen there
    assert _route(index, list(reversed(views)), turn1 + [9]) == first  # the order of the list does not matter
    busy = next(v for v in views if v.name == first)
    busy.free_slots = 1  # far less room than the others: headroom wins over affinity
    assert _route(index, views, turn1 + [4]) != first


def test_block_names_chain_each_blocks_ids_under_the_salt():
    import hashlib
    import random

    rng = random.Random(0)
    for length, salt in ((0, ""), (15, "s"), (16, ""), (100, "tenant\x00salt"), (4096, "x")):
        prompt = [rng.randrange(1 << 32) for _ in range(length)]
        want, previous = [], salt.encode()
        for k in range(length // 16):
            block = b"".join(t.to_bytes(4, "little") for t in prompt[16 * k:16 * (k + 1)])
            previous = hashlib.blake2b(previous + block, digest_size=16).digest()
            want.append(previous)
        assert block_names(prompt, salt) == want
    with pytest.raises(OverflowError):
        block_names([1 << 32] * 16)


def test_the_longest_match_wins_and_unseen_prompts_go_to_the_roomiest_shard():
    index, views = PrefixIndex(), [ShardView(n, healthy=True, free_slots=8) for n in ("s0", "s1")]
    system = list(range(100, 132))  # two blocks, shared
    index.record("s0", block_names(system))
    index.record("s1", block_names(system + list(range(16))))
    assert index.matched_tokens(block_names(system + list(range(16)) + [5])) == {"s0": 32, "s1": 48}
    assert pick_shard(views, index.matched_tokens(block_names(system + list(range(16))))).name == "s1"
    views[0].free_slots = 9
    assert pick_shard(views, index.matched_tokens(block_names([1] * 40))).name == "s0"  # cold: most headroom
    assert index.matched_tokens(block_names(list(range(15)))) == {}  # less than one block is never matched


def test_the_index_forgets_the_least_recently_sent_prefixes_beyond_its_capacity_and_removed_shards():
    index = PrefixIndex(capacity_blocks=4)
    a, b = list(range(48)), list(range(1000, 1032))
    index.record("s0", block_names(a))
    index.record("s0", block_names(b))  # five names: a's first block (the oldest) goes
    assert index.matched_tokens(block_names(a)) == {}
    assert index.matched_tokens(block_names(b)) == {"s0": 32}
    index.forget("s0")
    assert index.matched_tokens(block_names(b)) == {}
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(capacity_blocks=0)


def test_a_prompt_sharing_only_a_system_prompt_goes_where_it_went_and_salts_keep_prefixes_apart():
    index, views = PrefixIndex(), [ShardView(n, healthy=True, free_slots=8) for n in ("s0", "s1")]
    system = [(i * 13) % 200 for i in range(200)]  # 12 whole blocks and a partial one
    index.record("s1", block_names(system + [1] * 50, "salt-a"))  # the first chat, sent to s1
    other_user = system + [2] * 30
    assert index.matched_tokens(block_names(other_user, "salt-a")) == {"s1": 192}  # the shared whole blocks
    views[0].free_slots = 9  # s0 has a little more room; the snapshot at the system prompt's end is on s1
    assert pick_shard(views, index.matched_tokens(block_names(other_user, "salt-a"))).name == "s1"
    for salt in ("salt-b", ""):  # under another salt s1 holds nothing this prompt may restore
        assert index.matched_tokens(block_names(other_user, salt)) == {}
        assert pick_shard(views, index.matched_tokens(block_names(other_user, salt))).name == "s0"


def test_cache_salt_for_mixes_tenant_and_request_salt():
    from router.cache_salt import MAX_CACHE_SALT_CHARS, cache_salt_for
    from router.errors import InvalidArgument

    assert cache_salt_for("", "") == ""
    salts = {cache_salt_for(t, r) for t, r in [("", "x"), ("x", ""), ("a", "bc"), ("ab", "c"), ("a", "")]}
    assert len(salts) == 5 and all(len(s) == 64 for s in salts)
    assert cache_salt_for("a", "b") == cache_salt_for("a", "b")
    with pytest.raises(InvalidArgument, match=f"cache_salt has {MAX_CACHE_SALT_CHARS + 1} characters"):
        cache_salt_for("", "x" * (MAX_CACHE_SALT_CHARS + 1))
