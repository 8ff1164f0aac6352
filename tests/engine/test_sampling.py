"""`sample_all` against the definition of each sampling mode, row by row, and independent of batch neighbours."""

from __future__ import annotations

import torch

from shard_svc.engine.sampling import NONFINITE_ROW, SampleRow, SamplingParams, sample_all


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pair(d) -> tuple[int, float]:
    return d.token, d.logprob


def _reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then keep the top_k largest, then the smallest prefix (by descending probability) whose mass
    reaches top_p, renormalised: written out with plain loops over the sorted vocabulary."""
    scaled = logits.double() / p.temperature
    order = sorted(range(scaled.numel()), key=lambda i: -float(scaled[i]))
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
    params = [SamplingParams(logprobs=i % 2 == 0) for i in range(5)]
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
                                                                                 seed=4, logprobs=True)]
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
        mixed = sample_all([SampleRow(torch.randn(40, generator=g), SamplingParams()),
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
    rows = [SampleRow(good, SamplingParams()), SampleRow(nan_row, sampled, _gen(1)),
            SampleRow(inf_row, SamplingParams()), SampleRow(masked, sampled, _gen(1)),
            SampleRow(nan_row, SamplingParams(logprobs=True))]
    got = [_pair(d) for d in sample_all(rows)]
    assert got[0] == _pair(sample_all([rows[0]])[0])
    assert got[1][0] == NONFINITE_ROW and got[2][0] == NONFINITE_ROW and got[4][0] == NONFINITE_ROW
    assert got[3] == _pair(sample_all([SampleRow(masked, sampled, _gen(1))])[0]) and got[3][0] >= 10
