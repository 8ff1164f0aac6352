"""Prompt scoring (SamplingParams.prompt_logprobs) on tiny random models: gathered chunk by chunk during the prefill,
it must equal the log-softmax of the whole prompt's logits computed in one pass, whatever the chunking, and a cached
prefix must not be restored for it (a cached prefix has no logits)."""

import pytest
import torch

from shard_svc.engine import runner
from shard_svc.engine.sampling import SamplingParams
from shard_svc.errors import InvalidRequest
from tests.engine.conftest import linear_config, make_engine

F64 = torch.float64


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 255, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(ids: list[int]) -> torch.Tensor:
    """Log-softmax of the one-shot prompt logits, [P - 1, vocab]: row i scores prompt position i + 1."""
    seq = make_engine(linear_config(), dtype=F64).generate(
        ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), keep_prompt_logits=True)
    return torch.log_softmax(torch.cat(seq.prompt_logits)[:-1], dim=-1)


@pytest.mark.parametrize("budget, score_rows", [(5, 512), (16, 3), (1000, 512), (1000, 7)])
def test_scored_prompt_equals_one_shot_log_softmax_whatever_the_chunking(budget, score_rows, monkeypatch):
    """score_rows: positions scored at once inside a pass (runner.SCORE_ROWS), smaller than the pass or not."""
    monkeypatch.setattr(runner, "SCORE_ROWS", score_rows)
    ids = _prompt(41, seed=3)
    ref = _reference(ids)
    engine = make_engine(linear_config(), dtype=F64, prefill_token_budget=budget)
    seq = engine.add_request("s", ids, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                                      prompt_logprobs=3))
    events = []
    while engine.has_work():
        events += engine.step().events
    first = [e for e in events if e.index == 0 and e.token_id is not None]
    assert len(first) == 1 and all(e.prompt_scores is None for e in events if e is not first[0])
    logprobs, tops, ranks = first[0].prompt_scores.entries()
    assert len(logprobs) == len(ids) - 1
    expected = ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(logprobs, dtype=F64), expected, atol=1e-6)
    order = ref.argsort(dim=-1, descending=True)  # the rank of each prompt token by the reference's ordering
    assert ranks == [int((order[i] == t).nonzero()) + 1 for i, t in enumerate(ids[1:])]
    values, top_ids = ref.topk(3, dim=-1)
    assert [[t for t, _ in row] for row in tops] == top_ids.tolist()
    assert torch.allclose(torch.tensor([[lp for _, lp in row] for row in tops], dtype=F64), values, atol=1e-6)
    assert seq.finished


def test_one_token_prompt_scores_nothing_and_unasked_prompts_are_not_scored():
    engine = make_engine(linear_config())
    a = engine.add_request("a", [7], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    b = engine.add_request("b", _prompt(9, 1), SamplingParams(temperature=0.0, max_tokens=1))
    events = []
    while engine.has_work():
        events += engine.step().events
    by_id = {e.request_id: e for e in events}
    assert by_id["a"].prompt_scores.entries() == ([], [], [])
    assert by_id["b"].prompt_scores is None and b.prompt_scores is None and a.finished


def test_a_scored_prompt_is_prefilled_whole_despite_a_cached_prefix():
    engine = make_engine(linear_config(), dtype=F64, prefix_cache_entries=4)
    ids = _prompt(40, seed=5)
    engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), "warm")
    plain = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), "hit")
    assert plain.cached_tokens == len(ids)  # the cache does hold the prompt
    scored = engine.add_request("scored", ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                                              prompt_logprobs=0))
    events = []
    while engine.has_work():
        events += engine.step().events
    assert scored.cached_tokens == 0
    logprobs, _, _ = next(e for e in events if e.token_id is not None).prompt_scores.entries()
    expected = _reference(ids).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(logprobs, dtype=F64), expected, atol=1e-6)


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(InvalidRequest, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21).validate(256)
