"""Router logic that needs no network: stop strings and shard choice."""

import pytest

from router.balancer import NoHealthyShard, ShardView, pick_shard
from router.stop_strings import StopStringFilter


def run(stops, deltas):
    f = StopStringFilter(stops)
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


def test_prefix_affinity_keeps_a_prompt_start_on_one_shard_while_it_has_room():
    from router.balancer import affinity_key

    views = [ShardView(n, healthy=True, free_slots=8) for n in ("s0", "s1", "s2")]
    convo = list(range(300))
    first = pick_shard(views, affinity_key(convo)).name
    assert pick_shard(views, affinity_key(convo + [7, 8, 9])).name == first  # the next turn: same start
    assert pick_shard(list(reversed(views)), affinity_key(convo)).name == first  # order does not matter
    spread = {pick_shard(views, affinity_key([i] * 10)).name for i in range(60)}
    assert spread == {"s0", "s1", "s2"}  # different starts spread over every shard
    busy = next(v for v in views if v.name == first)
    busy.free_slots = 1  # far less room than the others: headroom wins over affinity
    assert pick_shard(views, affinity_key(convo)).name != first
    busy.free_slots = 7  # within the slack: affinity holds
    assert pick_shard(views, affinity_key(convo)).name == first
