"""`sample_all` against the definition of each sampling mode, row by row, and independent of batch neighbours."""

from __future__ import annotations

import pytest
import torch

from shard_svc.engine.grammar import ResponseFormat
from shard_svc.engine.penalties import TokenCounts
from shard_svc.engine.sampling import NONFINITE_ROW, SampleRow, SamplingParams, sample_all
from shard_svc.errors import InvalidRequest


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pair(d) -> tuple[int, float]:
    return d.token, d.logprob


def _reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then drop the tokens less likely than min_p x the most likely, keep the top_k largest, then the
    smallest prefix (by descending probability) whose mass reaches top_p, renormalised: written out with plain loops
    over the sorted vocabulary."""
    scaled = logits.double() / p.temperature
    full = torch.softmax(scaled, 0).tolist()
    order = sorted(range(scaled.numel()), key=lambda i: -float(scaled[i]))
    order = [i for i in order if full[i] >= p.min_p * max(full)]
    keep = order[: p.top_k] if p.top_k else order
    probs = torch.softmax(scaled[keep], 0)
    kept, mass = [], 0.0
    for i, pr in zip(keep, probs.tolist()):
        if mass >= p.top_p:
            break
        kept.append(i)
        mass += pr
    out = torch.zeros_like(scaled)
    out[kept] = torch.softmax(scaled[kept], 0)
    return out


def test_greedy_rows_are_argmax_with_lowest_id_ties_and_logprobs():
    g = _gen(0)
    rows = torch.randn(5, 50, generator=g)
    rows[2, 7] = rows[2, 31] = rows[2].max() + 1.0  # a tie: the lower id wins
    params = [SamplingParams(temperature=0.0, logprobs=i % 2 == 0) for i in range(5)]
    got = [(d.token, d.logprob) for d in sample_all([SampleRow(rows[i], params[i]) for i in range(5)])]
    for i, (token, lp) in enumerate(got):
        expect = max(range(50), key=lambda t: (float(rows[i, t]), -t))
        assert token == expect
        if params[i].logprobs:
            assert abs(lp - float(torch.log_softmax(rows[i].double(), 0)[token])) < 1e-6
        else:
            assert lp == 0.0
    assert got[2][0] == 7


def test_sampled_rows_draw_from_their_distribution_and_ignore_neighbours():
    g = _gen(1)
    logits = torch.randn(40, generator=g) * 3
    modes = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, top_k=5, seed=2),
             SamplingParams(temperature=1.0, top_p=0.6, seed=3), SamplingParams(temperature=0.9, top_k=8, top_p=0.8,
                                                                                 seed=4, logprobs=True),
             SamplingParams(temperature=1.2, min_p=0.1, seed=5), SamplingParams(temperature=0.8, min_p=0.02, top_k=12,
                                                                                 top_p=0.9, seed=6)]
    for p in modes:
        support = set(torch.nonzero(_reference_probs(logits, p)).flatten().tolist())
        alone = [_pair(sample_all([SampleRow(logits, p, _gen(p.seed + k))])[0]) for k in range(200)]
        assert {t for t, _ in alone} <= support, f"{p}: a token outside the top-k / top-p set was drawn"
        # empirical frequencies follow the reference distribution
        ref = _reference_probs(logits, p)
        top = int(torch.argmax(ref))
        freq = sum(t == top for t, _ in alone) / len(alone)
        assert abs(freq - float(ref[top])) < 0.12, (p, freq, float(ref[top]))
        if p.logprobs:
            assert all(abs(lp - float(torch.log(ref[t]))) < 1e-4 for t, lp in alone)
        # the same generator state gives the same token whatever else the pass holds
        mixed = sample_all([SampleRow(torch.randn(40, generator=g), SamplingParams(temperature=0.0)),
                            SampleRow(logits, p, _gen(p.seed)),
                            SampleRow(torch.randn(40, generator=g), SamplingParams(temperature=1.0, seed=9), _gen(9))])
        assert _pair(mixed[1]) == alone[0]


def test_empty_pass():
    assert sample_all([]) == []


def test_tiny_temperature_tends_to_the_argmax_instead_of_nan():
    """logits / 1e-45 overflows to inf (and inf - inf = NaN in a softmax); the limit of the definition is greedy."""
    g = _gen(2)
    logits = torch.randn(64, generator=g) * 4
    p = SamplingParams(temperature=1e-45, seed=5, logprobs=True)
    for k in range(20):
        token, lp = _pair(sample_all([SampleRow(logits, p, _gen(k))])[0])
        assert token == int(torch.argmax(logits))
        assert lp == 0.0


def test_non_finite_rows_are_reported_without_touching_neighbours():
    g = _gen(3)
    good = torch.randn(40, generator=g)
    nan_row, inf_row = good.clone(), good.clone()
    nan_row[3] = float("nan")
    inf_row[9] = float("inf")
    masked = good.clone()
    masked[:10] = float("-inf")  # -inf entries are a mask, not a fault
    sampled = SamplingParams(temperature=0.8, seed=1)
    rows = [SampleRow(good, SamplingParams(temperature=0.0)), SampleRow(nan_row, sampled, _gen(1)),
            SampleRow(inf_row, SamplingParams(temperature=0.0)), SampleRow(masked, sampled, _gen(1)),
            SampleRow(nan_row, SamplingParams(temperature=0.0, logprobs=True))]
    got = [_pair(d) for d in sample_all(rows)]
    assert got[0] == _pair(sample_all([rows[0]])[0])
    assert got[1][0] == NONFINITE_ROW and got[2][0] == NONFINITE_ROW and got[4][0] == NONFINITE_ROW
    assert got[3] == _pair(sample_all([SampleRow(masked, sampled, _gen(1))])[0]) and got[3][0] >= 10


# ---- penalties, masks and top_logprobs ------------------------------------------------------------------------

def _penalised_reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The penalties by their definitions, with plain loops over the token history: repetition over prompt + output
    (positive logits divided, negative multiplied), then presence once and frequency per occurrence in the output."""
    ref = logits.double().clone()
    for t in set(prompt) | set(output):
        ref[t] = ref[t] / p.repetition_penalty if ref[t] > 0 else ref[t] * p.repetition_penalty
    for t in set(output):
        ref[t] -= p.presence_penalty + p.frequency_penalty * output.count(t)
    return ref


def _bitmask(allowed: set[int], words: int) -> torch.Tensor:
    """llguidance's layout: bit t % 32 of int32 word t // 32 set when token t is allowed."""
    values = [sum(1 << (t % 32) for t in allowed if t // 32 == w) for w in range(words)]
    return torch.tensor([v - (1 << 32) if v >= 1 << 31 else v for v in values], dtype=torch.int32)


def _counts_with(history: dict[int, tuple[list[int], list[int]]], vocab: int, slots: int = 8) -> TokenCounts:
    """TokenCounts whose slots hold the given (prompt, output) histories, filled as the engine fills them: start()
    at the first draw, then one add() per generated token."""
    counts = TokenCounts(slots, vocab, torch.device("cpu"))
    counts.start([(slot, prompt, 0) for slot, (prompt, _) in history.items()])
    for slot, (_, output) in history.items():
        for t in output:
            counts.add(torch.tensor([slot]), torch.tensor([t]))
    return counts


PENALTIES = [SamplingParams(temperature=0.0, presence_penalty=1.5, logprobs=True, top_logprobs=5),
             SamplingParams(temperature=0.0, frequency_penalty=0.7, logprobs=True, top_logprobs=3),
             SamplingParams(temperature=0.0, repetition_penalty=1.8, logprobs=True, top_logprobs=4),
             SamplingParams(temperature=0.0, repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=2.0,
                            logprobs=True, top_logprobs=20),
             SamplingParams(temperature=0.0, presence_penalty=-2.0, frequency_penalty=-0.5, logprobs=True,
                            top_logprobs=1)]


def test_greedy_penalties_logprobs_and_top_logprobs_follow_the_definitions():
    g = _gen(10)
    vocab = 30
    prompt, output = [1, 2, 2, 5, 7], [3, 3, 3, 5, 9, 2]
    for p in PENALTIES:
        logits = torch.randn(vocab, generator=g) * 2
        logits[[2, 3, 5]] = logits[[2, 3, 5]].abs() + 2.5  # repeated tokens near the top, so penalties decide
        counts = _counts_with({4: (prompt, output)}, vocab)
        d = sample_all([SampleRow(logits, p, slot=4)], counts)[0]
        ref = _penalised_reference(logits, p, prompt, output)
        ref_lp = torch.log_softmax(ref, 0)
        assert d.token == int(torch.argmax(ref)), p
        assert abs(d.logprob - float(ref_lp[d.token])) < 1e-5
        want = sorted(range(vocab), key=lambda t: -float(ref_lp[t]))[:p.top_logprobs]
        assert [t for t, _ in d.top] == want
        assert all(abs(lp - float(ref_lp[t])) < 1e-5 for t, lp in d.top)
        assert int(counts.output[4, d.token]) == output.count(d.token) + 1, "the drawn token was counted"


def test_sampled_penalties_draw_from_the_penalised_distribution_and_report_its_logprobs():
    g = _gen(11)
    vocab = 40
    prompt, output = [0, 1, 2, 3], [4, 4, 5, 6, 4]
    logits = torch.randn(vocab, generator=g) * 2
    logits[[4, 5, 1]] += 3
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, seed=3, repetition_penalty=1.5, presence_penalty=0.5,
                       frequency_penalty=0.8, logprobs=True, top_logprobs=10)
    ref = _reference_probs(_penalised_reference(logits, p, prompt, output), p)
    support = set(torch.nonzero(ref).flatten().tolist())
    drawn = [sample_all([SampleRow(logits, p, _gen(k), slot=0)], _counts_with({0: (prompt, output)}, vocab))[0]
             for k in range(200)]
    assert {d.token for d in drawn} <= support
    top = int(torch.argmax(ref))
    assert abs(sum(d.token == top for d in drawn) / len(drawn) - float(ref[top])) < 0.12
    ref_lp = torch.log(ref)
    for d in drawn[:20]:
        assert abs(d.logprob - float(ref_lp[d.token])) < 1e-4
        # the alternatives are the sampled distribution's top entries: only tokens it can draw, most likely first
        assert [t for t, _ in d.top] == sorted(support, key=lambda t: -float(ref[t]))[:10]
        assert all(abs(lp - float(ref_lp[t])) < 1e-4 for t, lp in d.top)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_keeps_the_tokens_at_least_min_p_times_the_most_likely_and_reports_their_logprobs(min_p):
    """min_p is measured after temperature, on the whole vocabulary; logprobs and top_logprobs are those of the cut,
    renormalised distribution, and name only tokens it can draw. min_p 1 keeps the most likely token alone."""
    logits = torch.randn(64, generator=_gen(12)) * 2
    p = SamplingParams(temperature=0.7, min_p=min_p, seed=9, logprobs=True, top_logprobs=20)
    ref = _reference_probs(logits, p)
    support = set(torch.nonzero(ref).flatten().tolist())
    assert 1 <= len(support) < 64 and (min_p < 1 or len(support) == 1)
    drawn = [sample_all([SampleRow(logits, p, _gen(k))])[0] for k in range(100)]
    assert {d.token for d in drawn} <= support
    for d in drawn[:10]:
        assert abs(d.logprob - float(torch.log(ref[d.token]))) < 1e-5
        assert [t for t, _ in d.top] == sorted(support, key=lambda t: -float(ref[t]))[:20]


def test_greedy_penalty_steps_count_their_own_tokens_on_the_device():
    """Repeated passes over the same logits: each pass's token is counted by the sampler itself, so a strong
    frequency penalty walks down the ranking exactly as the loop reference does."""
    g = _gen(12)
    logits = torch.randn(16, generator=g)
    p = SamplingParams(temperature=0.0, frequency_penalty=0.9, presence_penalty=0.2, repetition_penalty=1.3)
    prompt = [0, 1]
    counts = _counts_with({2: (prompt, [])}, 16)
    got, output = [], []
    for _ in range(12):
        got.append(sample_all([SampleRow(logits, p, slot=2)], counts)[0].token)
        output.append(int(torch.argmax(_penalised_reference(logits, p, prompt, output))))
    assert got == output
    assert len(set(got)) > 3, "the penalty moved the argmax around"


def test_rows_with_penalties_masks_and_top_logprobs_ignore_their_neighbours():
    g = _gen(13)
    vocab = 50
    hist = {1: ([3, 4, 4], [7, 7, 8]), 5: ([9], [9, 9, 9, 1]), 6: ([2, 2], [])}
    allowed = {3, 6, 7, 28, 29, 31, 35}  # 31: the sign bit of the first int32 word
    mask = _bitmask(allowed, 2)
    rows = [SampleRow(torch.randn(vocab, generator=g), SamplingParams(temperature=0.0), None),
            SampleRow(torch.randn(vocab, generator=g), SamplingParams(temperature=0.0, frequency_penalty=1.1,
                                                                      logprobs=True,
                                                                      top_logprobs=4), slot=1),
            SampleRow(torch.randn(vocab, generator=g), SamplingParams(temperature=0.9, seed=4, repetition_penalty=1.7,
                                                                      logprobs=True, top_logprobs=6), _gen(4), 5),
            SampleRow(torch.randn(vocab, generator=g), SamplingParams(temperature=1.1, seed=5, logprobs=True,
                                                                      top_logprobs=20), _gen(5), allowed=mask),
            SampleRow(torch.randn(vocab, generator=g), SamplingParams(temperature=0.0,
                                                                      presence_penalty=1.0), slot=6, allowed=mask)]
    together = sample_all(rows, _counts_with(hist, vocab))
    for i, row in enumerate(rows):
        # rebuilt from scratch: a fresh generator and counts holding only this row's history
        alone_row = SampleRow(row.logits, row.params, _gen(row.params.seed) if row.generator else None, row.slot,
                              row.allowed)
        counts = _counts_with({row.slot: hist[row.slot]} if row.slot is not None else {}, vocab)
        assert sample_all([alone_row], counts)[0] == together[i], i
    assert together[3].token in allowed and together[4].token in allowed
    assert {t for t, _ in together[3].top} == allowed, "alternatives are only the tokens the mask allows"


def test_a_mask_that_allows_nothing_is_not_sampled():
    logits = torch.randn(40, generator=_gen(14))
    none = torch.zeros(2, dtype=torch.int32)
    got = sample_all([SampleRow(logits, SamplingParams(temperature=1.0), _gen(1), allowed=none),
                      SampleRow(logits, SamplingParams(temperature=0.0), allowed=none),
                      SampleRow(logits, SamplingParams(temperature=0.0))])
    assert got[0].token == NONFINITE_ROW and got[1].token == NONFINITE_ROW
    assert got[2].token == int(torch.argmax(logits))


def test_penalties_need_counts():
    with pytest.raises(ValueError, match="need TokenCounts and each its state slot"):
        sample_all([SampleRow(torch.zeros(8), SamplingParams(temperature=0.0, presence_penalty=1.0), slot=0)])


def test_logit_bias_is_added_before_the_draw_and_its_distribution_is_reported():
    g = _gen(12)
    vocab = 30
    logits = torch.randn(2, vocab, generator=g) * 2
    best = int(torch.argmax(logits[0]))
    bias = ((3, 4.5), (best, -7.0), (11, 100.0))
    greedy = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5, logit_bias=bias)
    plain = SamplingParams(temperature=0.0, logprobs=True)
    biased, neighbour = sample_all([SampleRow(logits[0], greedy), SampleRow(logits[1], plain)])
    ref = logits[0].double().clone()
    for t, v in bias:
        ref[t] += v
    ref_lp = torch.log_softmax(ref, 0)
    assert biased.token == 11 and abs(biased.logprob - float(ref_lp[11])) < 1e-5
    assert [t for t, _ in biased.top] == sorted(range(vocab), key=lambda t: -float(ref_lp[t]))[:5]
    assert neighbour.token == int(torch.argmax(logits[1])), "a row without a bias is left alone"
    banned = tuple((t, -100.0) for t in range(vocab) if t not in (4, 9))  # sampled: only 4 and 9 can be drawn
    sampled = SamplingParams(temperature=1.0, seed=5, logit_bias=banned)
    assert {sample_all([SampleRow(logits[0], sampled, _gen(k))])[0].token for k in range(40)} == {4, 9}


@pytest.mark.parametrize("bias, message", [
    (((3, 100.5),), "logit_bias values must be in"), (((3, float("nan")),), "logit_bias values must be in"),
    (((100, 1.0),), "logit_bias: 1 token ids outside"), (tuple((t, 1.0) for t in range(1025)), "at most 1024"),
])
def test_logit_bias_out_of_range_is_refused(bias, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(logit_bias=bias).validate(100 if len(bias) < 1025 else 2000)


@pytest.mark.parametrize("field,value,message", [
    ("presence_penalty", 2.5, "presence_penalty must be in"), ("presence_penalty", float("nan"), "presence_penalty"),
    ("frequency_penalty", -2.01, "frequency_penalty must be in"), ("repetition_penalty", 0.0, "repetition_penalty"),
    ("repetition_penalty", 2.5, "repetition_penalty"), ("top_logprobs", 21, "top_logprobs must be in"),
    ("min_p", -0.1, "min_p must be in"), ("min_p", 1.5, "min_p must be in"), ("min_p", float("nan"), "min_p"),
])
def test_out_of_range_fields_are_refused(field, value, message):
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(logprobs=True, **{field: value}).validate(100)


def test_top_logprobs_needs_logprobs_and_a_format_refuses_ignore_eos():
    with pytest.raises(InvalidRequest, match="top_logprobs=3 needs logprobs"):
        SamplingParams(temperature=0.0, top_logprobs=3).validate(100)
    with pytest.raises(InvalidRequest, match="ignore_eos cannot be combined with response_format"):
        SamplingParams(temperature=0.0, ignore_eos=True, response_format=ResponseFormat("json_object")).validate(100)
    with pytest.raises(InvalidRequest, match="not JSON"):
        SamplingParams(temperature=0.0, response_format=ResponseFormat("json_schema", "{nope")).validate(100)
    with pytest.raises(InvalidRequest, match="must be a JSON object"):
        SamplingParams(temperature=0.0, response_format=ResponseFormat("json_schema", "[1]")).validate(100)


def test_from_proto_unset_fields_take_the_engine_defaults_and_set_ones_carry_over():
    """One translation from the wire: an unset optional field means exactly the engine's default (temperature 1.0,
    OpenAI's), and a set one, 0 included, is taken as sent."""
    from kimiserve.v1 import common_pb2

    assert SamplingParams.from_proto(common_pb2.SamplingParams(), max_tokens=7) == SamplingParams(max_tokens=7)
    assert SamplingParams().temperature == 1.0
    wire = common_pb2.SamplingParams(
        temperature=0.0, top_p=0.5, top_k=3, min_p=0.25, seed=11, stop_token_ids=[4, 5], ignore_eos=True, logprobs=True,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.25, top_logprobs=2,
        response_format=common_pb2.ResponseFormat(regex="[ab]+"), logit_bias={9: -1.5, 2: 3.0})
    got = SamplingParams.from_proto(wire, max_tokens=3)
    assert got == SamplingParams(max_tokens=3, temperature=0.0, top_p=0.5, top_k=3, min_p=0.25, seed=11,
                                 stop_token_ids=(4, 5), ignore_eos=True, logprobs=True, presence_penalty=0.5,
                                 frequency_penalty=-0.5, repetition_penalty=1.25, top_logprobs=2,
                                 response_format=ResponseFormat("regex", "[ab]+"), logit_bias=((2, 3.0), (9, -1.5)))
