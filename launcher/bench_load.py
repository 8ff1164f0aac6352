"""What a serving benchmark sends and keeps (`kimiserve bench`, launcher/bench_serve.py and bench_long.py): the
synthetic prompts, one streamed request and its record, and the percentiles of a list of latencies."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import grpc

from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    prompt_tokens: int
    sent: float
    turn: int = 0
    first: float | None = None
    done: float | None = None
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    status: str = "OK"
    cached_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "OK" and self.first is not None and self.done is not None

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.done - self.first) / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass
class BenchArgs:
    router: str
    input_len: int
    input_spread: float
    output_len: int
    num_prompts: int
    seed: int
    turns: int
    turn_len: int
    slo_ttft_s: float | None
    slo_tpot_s: float | None


class Load:
    """Prompts and the streaming of one request."""

    def __init__(self, stub: router_pb2_grpc.RouterStub, args: BenchArgs, vocab: int):
        self.stub, self.args = stub, args
        self.rng = random.Random(args.seed)
        # Ordinary ids only: the low part of the vocabulary holds no special tokens in Kimi's or the tiny tokenizer.
        self.id_range = max(2, min(vocab, 500))

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.id_range) for _ in range(n)]

    def first_prompt(self) -> list[int]:
        s = self.args.input_spread
        n = round(self.args.input_len * self.rng.uniform(1 - s, 1 + s)) if s else self.args.input_len
        return self.tokens(max(1, n))

    async def one(self, prompt: list[int], turn: int = 0,
                  max_tokens: int | None = None) -> tuple[RequestRecord, list[int]]:
        record = RequestRecord(len(prompt), time.perf_counter(), turn)
        req = router_pb2.GenerateRequest(
            prompt_token_ids=common_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens or self.args.output_len, temperature=0.0,
                                               ignore_eos=True))
        output: list[int] = []
        try:
            async for chunk in self.stub.Generate(req):
                now = time.perf_counter()
                if chunk.token_ids:
                    record.first = record.first or now
                    record.chunk_times.append(now)
                    output.extend(chunk.token_ids)
                if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    record.output_tokens = chunk.usage.completion_tokens
                    record.cached_tokens = chunk.usage.cached_prompt_tokens
            record.done = time.perf_counter()
        except grpc.aio.AioRpcError as e:
            record.status = e.code().name
        return record, output

    async def conversation(self, records: list[RequestRecord], progress) -> None:
        prompt = self.first_prompt()
        for turn in range(self.args.turns):
            record, output = await self.one(prompt, turn)
            records.append(record)
            progress.update(1)
            if not record.ok:
                return
            prompt = prompt + output + self.tokens(self.args.turn_len)


def percentiles(values: list[float], scale: float = 1e3) -> dict:
    """{"p50", "p90", "p99", "mean"} of `values` (seconds) in milliseconds (scale); {} for none."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {f"p{p}": ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] * scale for p in PERCENTILES}
    out["mean"] = statistics.fmean(ordered) * scale
    return out
