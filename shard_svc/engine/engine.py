"""The engine: requests in, token events out. `step()` runs one prefill pass and one decode pass."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from kimiserve import sampling_rules
from shard_svc.config import ModelConfig
from shard_svc.engine.prefill_share import PrefillShare, context_tokens_per_token
from shard_svc.engine.prefix_cache import PrefixCache
from shard_svc.engine.prefix_host import PrefixHostConfigError, PrefixHostTier
from shard_svc.engine.prompt_logprobs import PromptScores
from shard_svc.engine.runner import ModelRunner
from shard_svc.engine.grammar import Grammars
from shard_svc.engine.handoff import SequenceState, check_continues
from shard_svc.engine.penalties import TokenCounts
from shard_svc.engine.sampling import NONFINITE_ROW, Drawn, SampleRow, SamplingParams, make_draws, sample_all
from shard_svc.engine.scheduler import Scheduler
from shard_svc.engine.sequence import PrefixHints, Sequence, SequenceTiming
from shard_svc.engine.step_sync import ALONE, StepSync
from shard_svc.errors import ContextTooLong, DuplicateRequest, InvalidRequest
from shard_svc.model import KimiForCausalLM
from shard_svc.ops import Ops
from shard_svc.state.host_copy import HostCopier
from shard_svc.state.kv_offload import HostKVOffload
from shard_svc.weight_streaming.metrics import StreamingMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    num_state_slots: int = 16  # concurrent sequences (KDA state pool slots)
    num_kv_blocks: int = 1024  # MLA latent cache blocks
    kv_block_size: int = 16  # tokens per block
    prefill_token_budget: int = 512  # new prompt tokens per prefill pass (bounds decode step time)
    max_model_len: int | None = None  # None: the model's own context length
    # Host memory for the MLA KV pages of sequences moved off the device when its blocks run short (the scheduler's
    # offload policy, shard_svc/engine/scheduler.py); 0: off, every KV promise stays within the device's blocks.
    host_kv_bytes: int = 0
    # Prefix cache (shard_svc/engine/prefix_cache.py): entries (each one KDA state slot beside the running ones,
    # plus shared KV blocks); 0: off. Interval: also snapshot every this many prompt tokens (0: never; a multiple of
    # kv_block_size), beside prompt ends and the message boundaries requests send.
    prefix_cache_entries: int = 0
    prefix_state_interval: int = 0
    # Host tier of the prefix cache (shard_svc/engine/prefix_host.py): entries evicted from the device kept in host
    # memory, at most this many; 0: off (evicted entries are dropped).
    prefix_host_entries: int = 0
    # How a pass's budget is shared between prompts (shard_svc/engine/prefill_share.py; None: derived from the
    # budget there): "fair" or "fcfs"; prompts with more tokens left than the threshold are long; a long prompt gets
    # at least the floor each pass; a pass with a long prompt in it costs at most mixed_prefill_cost
    # token-equivalents while other sequences run.
    prefill_policy: str = "fair"
    long_prefill_threshold: int | None = None
    long_prefill_floor: int | None = None
    mixed_prefill_cost: int | None = None
    fold_decodes: bool = False  # decodes ride in a long prompt's prefill passes
    # Prefill passes of at most this many tokens (and engine/prefill_graphs.py's MAX_SEQS sequences) replay CUDA
    # graphs where the decode steps do; a power of two >= 16, or 0: every prefill pass eager.
    prefill_graph_tokens: int = 256


@dataclass(frozen=True)
class TokenEvent:
    request_id: str
    token_id: int | None  # None on a finish without a new token (cancel, error)
    index: int  # position of the token in the output
    finish_reason: str | None = None  # set on the last event of a sequence
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprob: float | None = None
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    prompt_scores: PromptScores | None = None  # on the first token, when the prompt was scored
    timing: SequenceTiming | None = None  # on a finish: where the sequence's time went (the engine loop sets it)
    moved_tokens: int = 0  # finish "moved": tokens the state handed over holds (0: none, the receiver recomputes)
    state_bytes: int = 0  # finish "moved": the packed state's size (the engine loop sets it)


@dataclass
class PassStats:
    kind: str  # "prefill" | "decode"
    seconds: float
    sequences: int
    tokens: int
    request_ids: list[str]
    started: float = 0.0  # time.monotonic() at the pass's start
    seq_tokens: list[int] = field(default_factory=list)  # tokens of each sequence in the pass (as request_ids)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens of each forward the runner ran (micro-batches)
    decode_rows: int = 0  # a prefill pass: sequences past their prompt that took their decode step in it
    graphed: bool = False  # replayed from CUDA graphs (decode graphs, or prefill graphs: engine/prefill_graphs.py)


@dataclass
class StepResult:
    events: list[TokenEvent] = field(default_factory=list)
    passes: list[PassStats] = field(default_factory=list)


class Engine:
    def __init__(self, cfg: ModelConfig, model: KimiForCausalLM, ops: Ops, device: torch.device,
                 engine_cfg: EngineConfig = EngineConfig(), sync: StepSync = ALONE,
                 kv_metrics: StreamingMetrics | None = None,
                 grammars: Grammars | None = None, advertised: EngineConfig | None = None,
                 decode_ops: Ops | None = None):
        """decode_ops: what decode-only passes run (None: `ops`; ModelRunner).
        kv_metrics: where the host KV offload (engine_cfg.host_kv_bytes) reports the pages it moves.
        grammars: the checkpoint's vocabulary for response_format (None: such requests are refused).
        advertised: the capacity the shard reports (engine_cfg less the decode graphs' padding slot and block;
        None: engine_cfg)."""
        self.cfg, self.device, self.engine_cfg = cfg, device, engine_cfg
        self.advertised_cfg = advertised or engine_cfg
        # Alone on one process; a shard group's rank steps with the others (shard_svc/parallel/sync.py StepSync).
        self.sync = sync
        # The prefix cache's entries hold state slots of their own, beside the running sequences' slots.
        self.runner = ModelRunner(cfg, model, ops, device,
                                  engine_cfg.num_state_slots + engine_cfg.prefix_cache_entries,
                                  engine_cfg.num_kv_blocks, engine_cfg.kv_block_size,
                                  kda_heads=sync.kda_heads, decode_ops=decode_ops)
        self.kv_offload = (HostKVOffload.for_budget(self.runner.kv_cache, cfg, engine_cfg.host_kv_bytes, kv_metrics)
                           if engine_cfg.host_kv_bytes else None)
        pools = self.runner
        if engine_cfg.prefix_host_entries and not engine_cfg.prefix_cache_entries:
            raise PrefixHostConfigError(f"a prefix cache host tier of {engine_cfg.prefix_host_entries} entries needs "
                                        "the prefix cache on (prefix_cache_entries > 0): only device entries are "
                                        "evicted to the host")
        host = (PrefixHostTier(pools.kda_pool, pools.kv_cache, engine_cfg.prefix_host_entries)
                if engine_cfg.prefix_host_entries else None)
        self.prefix_cache = (PrefixCache(pools.kda_pool.slots, pools.kv_cache.blocks, engine_cfg.prefix_cache_entries,
                                         engine_cfg.prefix_state_interval, pools.kda_pool.copy_slot,
                                         pools.kv_cache.copy_block, host)
                             if engine_cfg.prefix_cache_entries else None)
        share = PrefillShare(engine_cfg.prefill_token_budget, engine_cfg.prefill_policy,
                             engine_cfg.long_prefill_threshold, engine_cfg.long_prefill_floor,
                             engine_cfg.mixed_prefill_cost, context_tokens_per_token(cfg), engine_cfg.fold_decodes)
        self.copier = HostCopier(pools.kda_pool, pools.kv_cache)  # states moving between shards (engine/handoff.py)
        self.scheduler = Scheduler(pools.kda_pool.slots, pools.kv_cache.blocks, engine_cfg.num_state_slots, share,
                                   self.kv_offload, self.prefix_cache, self.copier)
        # The longest sequence this engine can hold: the model's limit, the operator's, and the KV cache (a sequence's
        # whole KV promise must fit on the device even with host offload, which moves whole sequences).
        kv_tokens = engine_cfg.num_kv_blocks * engine_cfg.kv_block_size
        self.max_model_len = min(engine_cfg.max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings, kv_tokens)
        self.context_limits = (f"model {cfg.max_position_embeddings}, --max-model-len {engine_cfg.max_model_len}, "
                               f"KV cache {engine_cfg.num_kv_blocks} blocks x {engine_cfg.kv_block_size} = "
                               f"{kv_tokens} tokens")
        self.sequences: dict[str, Sequence] = {}
        self.grammars = grammars
        # Penalties' state, a row per state slot: running sequences may hold any slot of the pool (the prefix cache
        # hands slots back and forth).
        self.token_counts = TokenCounts(pools.kda_pool.slots.num_slots, cfg.vocab_size, device)

    # -- requests ---------------------------------------------------------------------------------------------
    def check_request(self, request_id: str, prompt: list[int], params: SamplingParams, prior_output: int = 0):
        """The checks that depend only on the request and the engine's fixed sizes (not on what is live), so a
        server thread can refuse a bad request at once while the engine thread steps. Raises InvalidRequest /
        ContextTooLong. Returns the sequence's compiled response_format matcher (None without one), advanced over
        the prompt's `prior_output` last tokens (add_request), to hand to add_request: grammars are compiled on the
        submitting thread, not the engine's."""
        self._check_sizes(request_id, prompt, params, prior_output)
        if params.response_format is None:
            return None
        if self.grammars is None:
            raise InvalidRequest(f"request {request_id!r}: response_format needs the checkpoint's tokenizer "
                                 "(tokenizer.json or tiktoken.model), which this shard has not loaded")
        matcher = self.grammars.compile(params.response_format, request_id)
        prior = prompt[len(prompt) - prior_output:]
        for i, token in enumerate(prior):
            if not matcher.consume_token(token):
                raise InvalidRequest(f"request {request_id!r}: response_format refuses prior output token {token} "
                                     f"(index {i} of {prior_output}): {matcher.get_error()}", "response_format")
        if prior and matcher.is_stopped():
            raise InvalidRequest(f"request {request_id!r}: response_format is already complete after the "
                                 f"{prior_output} prior output tokens: nothing is left to continue", "response_format")
        return matcher

    def _check_sizes(self, request_id: str, prompt: list[int], params: SamplingParams, prior_output: int) -> None:
        if not prompt:
            raise InvalidRequest(f"request {request_id!r}: empty prompt", "prompt")
        if not 0 <= prior_output < len(prompt):
            raise InvalidRequest(f"request {request_id!r}: prior_output_tokens {prior_output} must be below the "
                                 f"prompt's {len(prompt)} tokens (the original prompt is not empty)",
                                 "prior_output_tokens")
        bad = sampling_rules.token_id_problems("prompt", prompt, self.cfg.vocab_size)
        if bad:
            message, param = sampling_rules.describe(bad)
            raise InvalidRequest(f"request {request_id!r}: {message}", param)
        params.validate(self.cfg.vocab_size)
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ContextTooLong(f"request {request_id!r}: prompt {len(prompt)} + max_tokens {params.max_tokens} "
                                 f"= {total} tokens exceeds the maximum context {self.max_model_len} "
                                 f"({self.context_limits})")

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    keep_prompt_logits: bool = False, matcher=None, prefix: PrefixHints = PrefixHints(),
                    prior_output: int = 0, movable: bool = False,
                    imported: SequenceState | None = None) -> Sequence:
        """Validates and queues a request; raises DuplicateRequest or what check_request raises. `matcher`: what
        check_request returned for it (compiled here when not given). `prefix`: its cache salt and message
        boundaries (InvalidRequest when the boundaries are not increasing offsets inside the prompt).
        `prior_output`: for a continuation, how many of the prompt's last tokens are the sequence's own earlier
        output: penalties count them as output and the response_format has consumed them, so the continuation
        samples from what the uninterrupted sequence would have (its seeded draws are keyed by position already).
        `movable`: move_out may hand it over. `imported`: a state from another shard (engine/handoff.py) whose tokens
        begin the prompt (else InvalidRequest), restored at admission instead of prefilled."""
        if request_id in self.sequences:
            raise DuplicateRequest(f"request id {request_id!r} is already live on this engine")
        if imported is not None:
            check_continues(request_id, prompt, imported)
        if matcher is None:
            matcher = self.check_request(request_id, prompt, params, prior_output)
        else:
            self._check_sizes(request_id, prompt, params, prior_output)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                       else frozenset(self.cfg.eos_token_ids))
        points = PrefixCache.message_points(request_id, list(prefix.boundaries), len(prompt))
        seq = Sequence(request_id, list(prompt), params, make_draws(params, self.device),
                       keep_prompt_logits=keep_prompt_logits, stop_ids=stop_ids, matcher=matcher,
                       prefix=PrefixHints(prefix.salt, points), prior_output=prior_output, movable=movable,
                       imported=imported)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        self.sync.on_add(request_id, prompt, params, keep_prompt_logits, prefix, prior_output)
        return seq

    def cancel(self, request_id: str) -> TokenEvent | None:
        """Stops a sequence and frees its slot and blocks at once. Returns its final event, or None if unknown."""
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        self.sync.on_cancel(request_id)
        return self._finish(seq, "cancelled")

    def move_out(self, request_id: str) -> tuple[TokenEvent, SequenceState | None]:
        """Stops a live sequence to hand it to another shard (engine/handoff.py): its state on the host, when it has
        one that leaves a token to read, and its final event (finish "moved"). Its slot and blocks are freed."""
        seq = self.sequences[request_id]
        state = None
        done = seq.num_computed
        if (seq.slot is not None and 0 < done < seq.num_tokens and seq.request_id not in self.scheduler.offloaded
                and self.sync.world == 1):
            blocks = self.scheduler.blocks.table(request_id)[:self.scheduler.blocks.blocks_for(done)]
            state = SequenceState(seq.tokens[:done], self.copier.save(seq.slot, blocks, done))
        event = self._finish(seq, "moved")
        return replace(event, moved_tokens=len(state.tokens) if state is not None else 0), state

    def has_work(self) -> bool:
        return bool(self.sequences)

    # -- stepping ---------------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        self.sync.begin_step()
        plan = self.scheduler.schedule()
        self.sync.check_plan(plan)
        result = StepResult()
        cached = [s for s in plan.decode if s.cached_logits is not None]
        if cached:  # whole prompts restored from the prefix cache: their first token comes from the cached row
            plan.decode = [s for s in plan.decode if s.cached_logits is None]
            self._emit_cached(cached, result)
        if plan.prefill:
            # weight streaming: the layers fetched ahead during the prefill are for this step's decode pass (none
            # when the plan folded the decodes into the prefill pass)
            self._run_pass("prefill", plan.prefill, result, next_tokens=len(plan.decode) or None)
        decode = [(s, 1) for s in plan.decode if not s.finished]
        if decode:
            self._run_pass("decode", decode, result)
        self.sync.end_step(self, result)  # events leave only once every rank agrees on every sequence
        return result

    def _run_pass(self, kind: str, work: list[tuple[Sequence, int]], result: StepResult,
                  next_tokens: int | None = None) -> None:
        """next_tokens: the size of the pass that follows this one, where the plan says (None: unknown)."""
        start, started = time.perf_counter(), time.monotonic()
        prompt_rows = [seq.is_prefilling for seq, _ in work]  # a prefill pass may carry decode steps too
        if kind == "prefill":
            for (seq, _), prompt_row in zip(work, prompt_rows):
                if prompt_row:
                    seq.first_prefill_at = seq.first_prefill_at or started
                    seq.prefill_passes += 1
        if self.runner.weights is not None:
            self.runner.weights.expect_next_pass(next_tokens)
        claimed = self._claim_points(work) if kind == "prefill" and self.prefix_cache is not None else {}
        try:
            logits = self.runner.forward(work, is_decode=kind == "decode",
                                         points={rid: [(m, slot) for m, slot, _ in c] for rid, c in claimed.items()})
            point_rows = {seq.request_id: rows[:len(claimed.get(seq.request_id, ()))]
                          for (seq, _), rows in zip(work, logits)}
            logits = [rows[len(claimed.get(seq.request_id, ())):] for (seq, _), rows in zip(work, logits)]
            for (seq, _), rows, prompt_row in zip(work, logits, prompt_rows):
                if seq.keep_prompt_logits:
                    (seq.prompt_logits if prompt_row else seq.step_logits).append(rows.cpu())
            emitting = [(seq, rows[-1]) for (seq, _), rows in zip(work, logits) if not seq.is_prefilling]
            drawn = self._draw(emitting)
        except Exception as e:  # noqa: BLE001 - the pass's sequences fail; the engine keeps serving
            if self.sync.world > 1:
                raise  # in a shard group the other ranks cannot know which sequences failed: the group fails
            for points in claimed.values():
                for _, slot, _ in points:
                    self.prefix_cache.release(slot)
            ids = [s.request_id for s, _ in work]
            log.exception("pass failed; failing its sequences", extra={"pass": kind, "request_ids": ids})
            for seq, _ in work:
                result.events.append(self._finish(seq, "error", error=f"{kind} pass of requests {ids} failed: "
                                                                      f"{type(e).__name__}"))
            return
        if claimed:  # before the emits: a sequence finishing there gives its blocks back
            self._add_points(work, claimed, point_rows)
        self._emit_all(kind, emitting, drawn, result)
        if kind == "prefill" and self.prefix_cache is not None:
            self._snapshot_prefixes(work, logits)
        prompts = [(s, n) for (s, n), prompt_row in zip(work, prompt_rows) if prompt_row or kind == "decode"]
        result.passes.append(PassStats(kind, time.perf_counter() - start, len(prompts), sum(n for _, n in prompts),
                                       [s.request_id for s, _ in prompts], started, [n for _, n in prompts],
                                       list(self.runner.chunk_tokens), len(work) - len(prompts),
                                       self.runner.graphed))

    def _claim_points(self, work: list[tuple[Sequence, int]]) -> dict[str, list[tuple[int, int, str]]]:
        """request id -> (m, entry slot, kind) for the prefix cache's snapshot points inside the prompt chunks of
        this pass (m: the chunk's tokens before the point), each with a slot claimed for the pass to write into."""
        claimed = {}
        for seq, n in work:
            if not seq.is_prefilling:
                continue
            done = seq.num_computed
            for p, kind in self.prefix_cache.points_inside(seq, n):
                slot = self.prefix_cache.claim(seq.prompt[:p], seq.prefix.salt)
                if slot is not None:
                    claimed.setdefault(seq.request_id, []).append((p - done, slot, kind))
        return claimed

    def _add_points(self, work: list[tuple[Sequence, int]], claimed: dict[str, list[tuple[int, int, str]]],
                    point_rows: dict[str, torch.Tensor]) -> None:
        """The entries of the points the pass wrote out (_claim_points), each with its logits row; a point whose row
        is not finite gives its slot back (never cache such a state)."""
        for seq, n in work:
            for (m, slot, kind), row in zip(claimed.get(seq.request_id, ()), point_rows.get(seq.request_id, ())):
                if not bool(torch.isfinite(row).all()):
                    self.prefix_cache.release(slot)
                    continue
                p = seq.num_computed - n + m
                self.prefix_cache.add_claimed(seq.prompt[:p], slot, seq.request_id, row, seq.prefix.salt, kind)

    def _snapshot_prefixes(self, work: list[tuple[Sequence, int]], logits: list[torch.Tensor]) -> None:
        """Cache entries where a sequence's pass ended on one of its snapshot points (its prompt's end, a message
        boundary, a multiple of the interval), each with the logits of its last position, under the sequence's
        salt."""
        for (seq, _), rows in zip(work, logits):
            if seq.finished:
                continue  # a normal finish handed its slot to the cache already; an error caches nothing
            kind = self.prefix_cache.snapshot_kind(seq)
            if kind is None:
                continue
            if seq.is_prefilling and not bool(torch.isfinite(rows[-1]).all()):
                continue  # never cache a state whose logits are not finite (a sampled row was checked already)
            done = seq.num_computed
            self.prefix_cache.snapshot(seq.prompt[:done], seq.slot, seq.request_id, rows[-1], seq.prefix.salt, kind)

    def _emit_cached(self, seqs: list[Sequence], result: StepResult) -> None:
        emitting = [(seq, seq.cached_logits) for seq in seqs]
        for seq in seqs:
            seq.cached_logits = None
        self._emit_all("cached", emitting, self._draw(emitting), result)

    def _draw(self, emitting: list[tuple[Sequence, torch.Tensor]]) -> list[Drawn]:
        """In a shard group the leader samples and every rank gets its tokens; alone, this engine samples."""
        return self.sync.draw(len(emitting), lambda: self._sample(emitting))

    def _sample(self, emitting: list[tuple[Sequence, torch.Tensor]]) -> list[Drawn]:
        """Draws a token for each (sequence, logits row): the penalties' counts of sequences about to draw their
        first token are set up, response_format masks computed for the constrained ones, then one batched draw."""
        self.token_counts.start([(seq.slot, seq.prompt, seq.prior_output) for seq, _ in emitting
                                 if seq.params.has_penalties and not seq.output])
        constrained = [seq for seq, _ in emitting if seq.matcher is not None]
        masks = iter(self.grammars.masks([seq.matcher for seq in constrained]) if constrained else ())
        # Each sampled row draws with its generator seeded for the position of the token it draws (num_tokens:
        # prompt + output so far), so a continuation of the sequence draws what it would have.
        return sample_all([SampleRow(row, seq.params, seq.draws.at(seq.num_tokens) if seq.draws else None, seq.slot,
                                     next(masks) if seq.matcher is not None else None, seq.banned_ids)
                           for seq, row in emitting], self.token_counts)

    def _emit_all(self, kind: str, emitting: list[tuple[Sequence, torch.Tensor]], drawn: list[Drawn],
                  result: StepResult) -> None:
        for (seq, row), d in zip(emitting, drawn):
            if d.token == NONFINITE_ROW:
                grammar = (f"; response_format: {seq.matcher.get_error() or 'no token allowed'}"
                           if seq.matcher is not None else "")
                log.error("no token can be drawn; failing the sequence",
                          extra={"request_id": seq.request_id, "pass": kind, "output_index": len(seq.output)})
                result.events.append(self._finish(seq, "error", error=f"request {seq.request_id!r}: the logits at "
                                                  f"output index {len(seq.output)} hold NaN or inf, or allow no "
                                                  f"token{grammar}"))
                continue
            result.events.append(self._emit(seq, row, d))

    def _emit(self, seq: Sequence, logits: torch.Tensor, drawn: Drawn) -> TokenEvent:
        token = drawn.token
        extra = {"logprob": drawn.logprob, "top_logprobs": drawn.top} if seq.params.logprobs else {}
        if seq.keep_prompt_logits and not seq.output and seq.prompt_logits:
            seq.step_logits.append(logits.cpu().unsqueeze(0))
        if not seq.output:
            seq.first_token_at = time.monotonic()
        seq.output.append(token)
        if token in seq.stop_ids:
            return self._finish(seq, "stop", token=token, last_logits=logits, **extra)
        if seq.matcher is not None:
            if not seq.matcher.consume_token(token):  # the mask allowed it, so only a grammar engine fault lands here
                return self._finish(seq, "error", token=token, error=f"request {seq.request_id!r}: response_format "
                                    f"refused token {token}: {seq.matcher.get_error()}", **extra)
            if seq.matcher.is_stopped():  # the format admits no further text: the output is complete
                return self._finish(seq, "stop", token=token, last_logits=logits, **extra)
        if len(seq.output) >= seq.params.max_tokens:
            return self._finish(seq, "length", token=token, last_logits=logits, **extra)
        # A continuation's indices go on from its prior output: the router checks each against what it passed on.
        return TokenEvent(seq.request_id, token, seq.prior_output + len(seq.output) - 1,
                          cached_tokens=seq.cached_tokens, prompt_scores=self._scores(seq), **extra)

    def _finish(self, seq: Sequence, reason: str, token: int | None = None, error: str | None = None,
                logprob: float | None = None, last_logits: torch.Tensor | None = None,
                top_logprobs: tuple[tuple[int, float], ...] = ()) -> TokenEvent:
        """last_logits: the row the last token was drawn from, on a normal finish (the prefix cache keeps it)."""
        self.scheduler.finish(seq, last_logits)
        seq.finish_reason, seq.error, seq.finished_at = reason, error, time.monotonic()
        self.sequences.pop(seq.request_id, None)
        generated = seq.prior_output + len(seq.output)
        index = generated - 1 if token is not None else generated
        return TokenEvent(seq.request_id, token, index, reason, len(seq.prompt) - seq.prior_output, generated, error,
                          logprob, seq.cached_tokens, top_logprobs, self._scores(seq) if token is not None else None)

    @staticmethod
    def _scores(seq: Sequence) -> PromptScores | None:
        """The scored prompt, handed over once, with the first token (a one-token prompt scores nothing; a
        continuation's first leg handed it over)."""
        if seq.params.prompt_logprobs is None or len(seq.output) != 1 or seq.prior_output:
            return None
        return seq.prompt_scores or PromptScores()

    # -- offline ----------------------------------------------------------------------------------------------
    def generate(self, prompt: list[int], params: SamplingParams, request_id: str = "offline-0",
                 keep_prompt_logits: bool = False, prefix: PrefixHints = PrefixHints()) -> Sequence:
        """Runs one request to completion in-process."""
        seq = self.add_request(request_id, prompt, params, keep_prompt_logits, prefix=prefix)
        while not seq.finished:
            self.step()
        return seq
