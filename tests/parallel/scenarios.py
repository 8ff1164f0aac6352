"""One scenario run on every rank of a shard group, and on rank 0 alone as the one-process reference.

A scenario is a list of requests (added at given steps) and cancels (at given steps), stepped to completion with
the same step-indexed timing on both sides, so the group and the reference see the same schedule. Rank 0 returns
both runs' outcomes (tokens, finish reason, usage and cached prompt tokens from the final event, logits); followers
return the logits they computed, to check every rank holds bitwise the same. Every rank also returns its prefix cache's
entry counts and running totals, which must be the same everywhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Request:
    rid: str
    prompt: tuple[int, ...]
    params: SamplingParams
    at_step: int = 0


@dataclass(frozen=True)
class Case:
    name: str
    tp: int
    ep: int
    raw: dict | None = None  # an in-memory random model (tests/engine/conftest.py random_model) ...
    checkpoint: str | None = None  # ... or a checkpoint directory
    dtype: torch.dtype = torch.float64
    requests: tuple[Request, ...] = ()
    cancels: tuple[tuple[str, int], ...] = ()  # (request id, at step)
    engine: dict = field(default_factory=dict)  # EngineConfig overrides
    reference_engine: dict | None = None  # EngineConfig overrides of the one-process reference (None: `engine`)
    follower_engine: dict | None = None  # different EngineConfig on followers: provokes a divergence
    load_format: str = "safetensors"  # "dummy": random weights per rank (no reference run)


def prompt(n: int, seed: int, vocab: int = 255) -> tuple[int, ...]:
    return tuple(torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def concurrent_requests(vocab: int = 255) -> tuple[Request, ...]:
    """Chunked prefill, max_tokens 1 (finishes at prefill), a stop-token finish, seeded sampling with penalties and
    logprobs (drawn on rank 0 only, its penalty counts held there), a late arrival, and a request cancelled
    mid-decode."""
    greedy = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    return (
        Request("long-prefill", prompt(90, 1, vocab), greedy),
        Request("one-token", prompt(12, 2, vocab), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
        Request("stops-early", prompt(20, 3, vocab),
                SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                               stop_token_ids=tuple(range(0, vocab, 3)))),
        Request("sampled", prompt(17, 4, vocab),
                SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, logprobs=True, ignore_eos=True,
                               frequency_penalty=0.8, repetition_penalty=1.3, top_logprobs=2)),
        Request("late", prompt(25, 5, vocab), greedy, at_step=2),
        Request("cancelled", prompt(8, 6, vocab), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
    )


def _model(case: Case, comm=None):
    """(cfg, model): the group's slice when `comm` is given, else the whole model."""
    if case.raw is not None:
        from shard_svc.parallel.loading import parallelize
        from tests.engine.conftest import random_model

        cfg, model = random_model(case.raw, seed=0, dtype=case.dtype)
        return (cfg, parallelize(model, comm)[0]) if comm is not None else (cfg, model)
    if comm is not None:
        from shard_svc.parallel.loading import GROUP_LOAD_FORMATS

        return GROUP_LOAD_FORMATS[case.load_format](case.checkpoint, CPU, case.dtype, comm)
    from shard_svc.checkpoint.loader import load_model

    return load_model(case.checkpoint, CPU, case.dtype)


def _drive(engine: Engine, case: Case) -> dict:
    """Leader side (or the reference): adds, cancels and steps by step index; the outcome of every request."""
    seqs, finals, step = {}, {}, 0
    pending = list(case.requests)
    while pending or engine.has_work():
        for req in [r for r in pending if r.at_step <= step]:
            seqs[req.rid] = engine.add_request(req.rid, list(req.prompt), req.params, keep_prompt_logits=True)
            pending.remove(req)
        for rid, at in case.cancels:
            if at == step and (event := engine.cancel(rid)) is not None:
                finals[rid] = event
        if engine.has_work():
            for event in engine.step().events:
                if event.finish_reason is not None:
                    finals[event.request_id] = event
        step += 1
    return {rid: {"tokens": list(s.output), "finish": finals[rid].finish_reason,
                  "usage": (finals[rid].prompt_tokens, finals[rid].completion_tokens),
                  "cached": finals[rid].cached_tokens,
                  "prompt_logits": torch.cat(s.prompt_logits) if s.prompt_logits else None,
                  "step_logits": torch.cat(s.step_logits) if s.step_logits else None}
            for rid, s in seqs.items()}


def _follow(engine: Engine) -> dict:
    """Follower side: the worker loop, keeping each added sequence to return its logits."""
    sync, seqs = engine.sync, {}
    while True:
        msg = sync.receive()
        sync.apply(engine, msg)
        for entry in msg.journal:
            if entry[0] == "add":
                seqs[entry[1]] = engine.sequences[entry[1]]
        if msg.kind == "stop":
            break
        if msg.kind == "step":
            engine.step()
    return {rid: {"prompt_logits": torch.cat(s.prompt_logits) if s.prompt_logits else None,
                  "step_logits": torch.cat(s.step_logits) if s.step_logits else None} for rid, s in seqs.items()}


def _replicated_digest(model) -> int:
    """A digest of the parameters every rank must hold identically (routers, norms, AttnRes pseudo-queries)."""
    from shard_svc.parallel.group import digest

    return digest([(n, p.double().sum().item()) for n, p in model.named_parameters()
                   if n.endswith(("norm.weight", "gate.weight", "e_score_correction_bias", "res.proj.weight"))])


def run_cases(group, cases: list[Case]) -> dict:
    """On every rank: each case in turn. A GroupError is returned (by name and message), not raised."""
    from shard_svc.parallel.errors import GroupError
    from shard_svc.parallel.layout import ParallelLayout
    from shard_svc.parallel.sync import StepSync

    out = {}
    for case in cases:
        layout = ParallelLayout(case.tp, case.ep, group.rank)
        comm = group.model_comm(layout)
        reference = None
        if group.rank == 0 and case.load_format == "safetensors":
            cfg, model = _model(case)
            ref_kw = case.engine if case.reference_engine is None else case.reference_engine
            reference = _drive(Engine(cfg, model, select_ops(CPU, "eager"), CPU, EngineConfig(**ref_kw)), case)
        cfg, model = _model(case, comm)
        engine_kw = case.engine if group.rank == 0 or case.follower_engine is None else case.follower_engine
        engine = Engine(cfg, model, select_ops(CPU, "eager"), CPU, EngineConfig(**engine_kw),
                        sync=StepSync(group, layout, cfg))
        try:
            if group.rank == 0:
                result = {"group": _drive(engine, case), "reference": reference}
                engine.sync.stop()
            else:
                result = {"group": _follow(engine)}
        except GroupError as e:
            result = {"error": (type(e).__name__, str(e))}
        result["replicated"] = _replicated_digest(model)
        cache = engine.prefix_cache
        result["prefix_cache"] = (None if cache is None else
                                  (len(cache), cache.host_entries, dataclasses.astuple(cache.stats)))
        out[case.name] = result
    return out
