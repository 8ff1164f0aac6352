"""Sampling parameters and the batched sampler of one pass: penalties, the structured-output mask, then greedy or
seeded temperature / top-k / top-p draws, with logprobs and top alternatives.

Each row's distribution is built in this order (the proto's SamplingParams documents the same):
  0. min_tokens: until the sequence has that many tokens, its stop ids (EOS, stop_token_ids) get -inf;
  1. penalties (shard_svc/engine/penalties.py): repetition over prompt + output, then presence and frequency over
     the output, from per-slot token counts kept on the device;
  2. logit_bias: each listed token's value added to its logit;
  3. the response_format mask (shard_svc/engine/grammar.py): disallowed tokens get -inf;
  4. greedy: argmax; sampled: max-shifted temperature, min-p, top-k, top-p, then a draw with the row's own
     generator.
logprob / top_logprobs are the natural logs of that final distribution (greedy: log-softmax of the penalised,
biased, masked logits). Every row's result depends only on its own logits, counts, mask and generator.

A sampled sequence's generator is reseeded before each of its draws with kimiserve.seeds.position_seed(seed,
position), position being the absolute index of the token drawn (prompt length + tokens generated before it): a
draw depends on (seed, position, distribution) alone, never on the generator's history, so a continuation (prompt +
the first k outputs, same seed) draws what the original did from position prompt + k on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kimiserve import sampling_rules
from kimiserve.seeds import draw_seed, position_seed
from shard_svc.engine.grammar import ResponseFormat, apply_allowed
from shard_svc.engine.penalties import Penalties, TokenCounts, apply_penalties
from shard_svc.errors import InvalidRequest

if TYPE_CHECKING:
    from kimiserve.v1 import common_pb2

# SamplingParams fields that are `optional` on the wire: unset there means this dataclass's default, nothing else.
OPTIONAL_WIRE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                        "repetition_penalty")


@dataclass(frozen=True)
class SamplingParams:
    """One sequence's sampling. The defaults are what an unset field means on the wire (common.proto), so an
    engine caller and an API client who leave a field out get the same thing."""

    max_tokens: int = 16
    temperature: float = 1.0  # OpenAI's default; 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0 means off
    seed: int | None = None  # same seed, same prompt, same model -> same tokens, whatever the batch
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # report log p(token) under the distribution it was drawn from
    presence_penalty: float = 0.0  # subtracted once from tokens present in the output
    frequency_penalty: float = 0.0  # times the token's count in the output, subtracted
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt + output tokens
    top_logprobs: int = 0  # alternatives reported per token (needs logprobs)
    response_format: ResponseFormat | None = None
    prompt_logprobs: int | None = None  # score the prompt with this many alternatives per position (None: do not)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit), ids ascending
    min_tokens: int = 0  # the stop ids cannot be drawn before this many tokens are generated

    @classmethod
    def from_proto(cls, s: common_pb2.SamplingParams, max_tokens: int) -> SamplingParams:
        """The one translation from the wire. max_tokens: the router's resolved budget (the shard's Submit carries
        it; the proto field's own default is the router's to apply)."""
        optional = {name: getattr(s, name) for name in OPTIONAL_WIRE_FIELDS if s.HasField(name)}
        return cls(max_tokens=max_tokens, stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
                   logprobs=s.logprobs, top_logprobs=s.top_logprobs,
                   prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
                   response_format=_response_format_from_proto(s.response_format),
                   logit_bias=tuple(sorted(s.logit_bias.items())), min_tokens=s.min_tokens, **optional)

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self, vocab_size: int) -> None:
        """The router's rules (kimiserve/sampling_rules.py), applied again for callers other than our router;
        InvalidRequest names every problem and, as `param`, the first field at fault."""
        values = {f: getattr(self, f) for f in (*OPTIONAL_WIRE_FIELDS, "max_tokens", "top_logprobs", "logprobs",
                                               "prompt_logprobs", "min_tokens")}
        problems = sampling_rules.sampling_problems(values | {"logit_bias": dict(self.logit_bias)})
        f = self.response_format
        if f is not None:
            problems += sampling_rules.response_format_problems(f.kind, self.ignore_eos, f.name, f.text, f.text,
                                                                self.min_tokens)
        problems += sampling_rules.token_id_problems("stop_token_ids", self.stop_token_ids, vocab_size)
        problems += sampling_rules.token_id_problems("logit_bias", [t for t, _ in self.logit_bias], vocab_size)
        if problems:  # the rest of a response_format is checked when it is compiled (Grammars.compile)
            raise InvalidRequest(*sampling_rules.describe(problems))


def _response_format_from_proto(f: common_pb2.ResponseFormat) -> ResponseFormat | None:
    kind = f.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        return ResponseFormat("json_schema", f.json_schema.schema, f.json_schema.name)
    if kind == "tool_calls":
        return ResponseFormat("tool_calls", functions=tuple((fn.name, fn.parameters) for fn in f.tool_calls.functions),
                              max_calls=f.tool_calls.max_calls, text_first=f.tool_calls.text_first)
    return ResponseFormat(kind, f.regex if kind == "regex" else "")


class SeededDraws:
    """A sampled sequence's randomness: its seed (params.seed, or one drawn when the request set none) and one
    generator on the device, reseeded for every draw. Reseeding sets the generator's state in place (on CUDA: the
    Philox seed and offset, host-side), so a draw allocates no generator and syncs nothing. torch's CPU generator
    keeps only a key's low 32 bits; position_seed's mixing makes those depend on every bit of seed and position."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        self._generator = torch.Generator(device=device)

    def at(self, position: int) -> torch.Generator:
        """The generator for the draw of the token at `position` (absolute in the sequence)."""
        return self._generator.manual_seed(position_seed(self.seed, position))


def make_draws(params: SamplingParams, device: torch.device) -> SeededDraws | None:
    """None for a greedy sequence; else its draws, seeded by params.seed or, unseeded, by a seed drawn now, once."""
    if params.temperature == 0:
        return None
    return SeededDraws(params.seed if params.seed is not None else draw_seed(), device)


# The token reported for a row that cannot be sampled: its logits hold NaN or +inf, or its response_format mask
# allows no token. Nothing is drawn from it, and the engine ends that sequence with an error instead of emitting a
# token (a bad row must never kill the pass or reach multinomial, which raises on the CPU and asserts on the GPU,
# taking the whole device context down).
NONFINITE_ROW = -1


@dataclass(frozen=True)
class SampleRow:
    """One sequence's input to a pass's sampler."""

    logits: torch.Tensor  # fp32 [vocab], on the device
    params: SamplingParams
    generator: torch.Generator | None = None  # sampled rows: seeded for this draw (SeededDraws.at)
    slot: int | None = None  # the sequence's state slot: its row of TokenCounts (needed when it has penalties)
    allowed: torch.Tensor | None = None  # response_format bitmask, int32 [ceil(vocab / 32)] on the host; None: all
    banned: tuple[int, ...] = ()  # ids that cannot be drawn now (its stop ids, before min_tokens)


@dataclass(frozen=True)
class Drawn:
    """One row's result."""

    token: int  # NONFINITE_ROW when the row could not be sampled
    logprob: float  # 0.0 without params.logprobs; nan for NONFINITE_ROW
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first; params.top_logprobs of them


def sample_all(rows: list[SampleRow], counts: TokenCounts | None = None) -> list[Drawn]:
    """Samples every row of a pass with one device-to-host copy in all, and counts each penalised row's token in
    `counts` on the device (required when a row has penalties).

    A pass emits a token per sequence; reading each back on its own would stop the host once per sequence. The
    penalties and masks run on the stacked rows at once; greedy rows share one argmax (ties to the lowest id, as
    per row); sampled rows keep their own generator, and their tokens stay on the device until the single copy.
    """
    if not rows:
        return []
    stacked = torch.stack([r.logits for r in rows]).float()
    # A fault of the model (NaN or +inf anywhere), judged before penalties and masks add -inf entries of their own.
    finite = ~(torch.isnan(stacked).any(-1) | torch.isposinf(stacked).any(-1))
    penalised = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if penalised and (counts is None or any(rows[i].slot is None for i in penalised)):
        raise ValueError(f"rows {penalised} have penalties: they need TokenCounts and each its state slot")
    device = stacked.device
    banned = [(i, t) for i, r in enumerate(rows) for t in r.banned]
    if banned:
        at = torch.tensor(banned, device=device).t()
        stacked[at[0], at[1]] = float("-inf")
    if penalised:
        pen_index = torch.tensor(penalised, device=device)
        slots = torch.tensor([rows[i].slot for i in penalised], device=device)
        stacked[pen_index] = apply_penalties(stacked[pen_index], counts, slots,
                                             [rows[i].params.penalties for i in penalised])
    biased = [(i, t, v) for i, r in enumerate(rows) for t, v in r.params.logit_bias]
    if biased:  # one small copy for every biased row of the pass
        at = torch.tensor([(i, t) for i, t, _ in biased], device=device).t()
        stacked.index_put_((at[0], at[1]), torch.tensor([v for *_, v in biased], device=device), accumulate=True)
    masked = [i for i, r in enumerate(rows) if r.allowed is not None]
    if masked:
        bits = torch.stack([rows[i].allowed for i in masked]).to(device, non_blocking=True)
        index = torch.tensor(masked, device=device)
        stacked[index] = apply_allowed(stacked[index], bits)
    finite &= stacked.max(-1).values > float("-inf")  # a mask that allows nothing cannot be sampled either
    tokens, logps = _draw(stacked, rows, finite)
    if penalised:
        counts.add(slots, tokens[pen_index])  # on the device: the next pass sees these tokens counted
    return _read_back(rows, tokens, finite, logps)


def _draw(stacked: torch.Tensor, rows: list[SampleRow], finite: torch.Tensor
          ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """(the token of every row [n] on the device, {row: its log-distribution} for rows that report logprobs)."""
    tokens: list[torch.Tensor | None] = [None] * len(rows)
    logps: dict[int, torch.Tensor] = {}
    greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0]
    if greedy:
        chosen = stacked[greedy]
        best = torch.argmax(chosen, -1)
        for j, i in enumerate(greedy):
            tokens[i] = best[j:j + 1]
        wants = [j for j, i in enumerate(greedy) if rows[i].params.logprobs]
        if wants:
            logp = torch.log_softmax(chosen[wants], -1)
            logps.update((greedy[j], logp[m]) for m, j in enumerate(wants))
    for i, r in enumerate(rows):
        if r.params.temperature == 0:
            continue
        filtered = _sampling_logits(stacked[i], r.params)
        # A row that cannot be sampled draws from a harmless stand-in (its result is replaced below): no host sync.
        probs = torch.where(finite[i], torch.softmax(filtered, -1), torch.ones_like(filtered))
        tokens[i] = torch.multinomial(probs, 1, generator=r.generator)
        if r.params.logprobs:
            logps[i] = torch.log_softmax(filtered, -1)
    return torch.cat(tokens), logps


def _read_back(rows: list[SampleRow], tokens: torch.Tensor, finite: torch.Tensor,
               logps: dict[int, torch.Tensor]) -> list[Drawn]:
    """Tokens, flags, chosen logprobs and top alternatives of every row, in the pass's one device-to-host copy."""
    n = len(rows)
    lp_rows = sorted(logps)
    parts = [tokens.double(), finite.double()]
    top_rows = [j for j, i in enumerate(lp_rows) if rows[i].params.top_logprobs]  # positions in lp_rows
    k = 0
    if lp_rows:
        lp = torch.stack([logps[i] for i in lp_rows])
        parts.append(lp.gather(-1, tokens[lp_rows][:, None])[:, 0].double())
        if top_rows:
            k = min(max(rows[lp_rows[j]].params.top_logprobs for j in top_rows), lp.shape[-1])
            top = torch.topk(lp[top_rows], k, -1)
            parts += [top.values.double().flatten(), top.indices.double().flatten()]
    host = torch.cat(parts).tolist()
    ids, ok = host[:n], host[n:2 * n]
    chosen = dict(zip(lp_rows, host[2 * n:2 * n + len(lp_rows)]))
    values = host[2 * n + len(lp_rows):2 * n + len(lp_rows) + k * len(top_rows)]
    indices = host[2 * n + len(lp_rows) + k * len(top_rows):]
    tops = {}
    for m, j in enumerate(top_rows):
        i = lp_rows[j]
        row = list(zip(indices[m * k:(m + 1) * k], values[m * k:(m + 1) * k]))[:rows[i].params.top_logprobs]
        # Only tokens the distribution can draw (top-k / top-p / a mask may leave fewer than asked for).
        tops[i] = tuple((int(t), v) for t, v in row if v > float("-inf"))
    return [Drawn(int(t), chosen.get(i, 0.0), tops.get(i, ())) if ok[i] else Drawn(NONFINITE_ROW, float("nan"))
            for i, t in enumerate(ids)]


def _sampling_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The log-weights a sampled row draws from: temperature, then the min-p, top-k and top-p cuts (-inf outside).

    The row is shifted by its maximum before the division, so a tiny temperature gives -inf (never inf - inf = NaN)
    and the distribution tends to the argmax, as the limit of the definition does. The shift also makes the most
    likely token's log-weight 0, so min-p's p >= min_p * p_max is log-weight >= log(min_p)."""
    scaled = (logits.float() - logits.max()) / params.temperature
    if params.min_p > 0:
        scaled = scaled.masked_fill(scaled < math.log(params.min_p), float("-inf"))
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled
