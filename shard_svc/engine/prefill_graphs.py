"""CUDA graphs for small prefill passes, captured in pieces around the MLA attention.

Why: a pass launched op by op costs the host ~70 us a kernel, ~500 kernels at 16 of the 48B shape's 27 layers, so a
pass of 16-256 new tokens took 28-47 ms of wall time for 9-16 ms of GPU work (bench/pass_overhead.py, H100). That is
the floor under every small prefill: a chat's new message after a restored system prompt, short prompts admitted
beside a long one. Decode steps replay graphs (engine/cuda_graphs.py); these passes now do too.

What is captured: the whole forward of a pass padded to a token bucket (16, 32, ... up to `max_tokens`) with up to
`MAX_SEQS` sequences, except the MLA attention. Its host-side layout depends on the sequences' lengths (the keys it
gathers and expands, its query blocks), so each MLA attention call is a break: the bucket is captured as a chain of
graphs, and between two replays the attention runs eagerly on the pass's real rows (the op the backend selected,
exactly as an eager pass runs it), writing into a buffer the next graph reads. Passes with snapshot points inside,
more sequences or tokens than captured, and streamed weights run eagerly as before.

Padding: the pass's sequences take the first of MAX_SEQS + 1 sequence entries; unused entries are empty sequences on
the padding slot, and the last entry is a sequence of the padding tokens (ids 0) on the padding slot, writing into
the padding KV block (the decode graphs' own: engine/cuda_graphs.py). Every op but the attention works on each
sequence or each row alone, so the real rows compute what an eager pass of the same sequences does; the attention
leaves the padding rows zero. With `capture=False` (CPU tests) the same buffers, padding and breaks run eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from shard_svc.engine.graph_buffers import CudaGraphError, TableStager, is_graph_safe
from shard_svc.engine.step_rows import build_rows
from shard_svc.forward_batch import ForwardBatch, ForwardContext
from shard_svc.ops.host_lengths import HostLengths

log = logging.getLogger(__name__)

MAX_SEQS = 8  # sequences of a captured pass; MAX_SEQS + 1 entries, never equal to a bucket (conv's decode test)
MIN_BUCKET = 16  # the MoE's fused shared-expert path ends at 16 tokens: a bucket boundary keeps the eager choice
# Prefill-only ops a captured pass calls (the others are the decode graphs' DECODE_OPS, checked there).
PREFILL_OPS = ("kda_prefill",)


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """16, 32, 64, ... up to max_tokens (a power of two at least 16, or 0: none)."""
    if max_tokens == 0:
        return ()
    if max_tokens < MIN_BUCKET or max_tokens & (max_tokens - 1):
        raise ValueError(f"prefill graph tokens must be 0 or a power of two >= {MIN_BUCKET}, got {max_tokens}")
    return tuple(MIN_BUCKET << i for i in range(max_tokens.bit_length() - MIN_BUCKET.bit_length() + 1))


@dataclass
class AttentionBreak:
    """One MLA attention call of a captured forward: the graph before it leaves the queries in q_nope/q_pe, the
    eager attention writes `out`, which the graph after it reads."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_cache: torch.Tensor
    w_kv_b: torch.Tensor
    scale: float
    out: torch.Tensor


@dataclass
class CapturedPass:
    """A bucket's forward: len(breaks) + 1 graphs (CPU: one eager run); `run` returns the hidden states [bucket, D]."""

    run: Callable[[], torch.Tensor]
    breaks: int


class PrefillGraphRunner:
    """Persistent prefill inputs and one chain of graphs per token bucket; attached as `runner.prefill_graphs`."""

    def __init__(self, runner, buckets: tuple[int, ...], width: int, pad_slot: int, pad_block: int,
                 capture: bool = True):
        if not buckets:
            raise CudaGraphError("no prefill token buckets to capture")
        self.runner, self.buckets, self.width, self.capture_graphs = runner, tuple(sorted(buckets)), width, capture
        self.pad_slot, self.pad_block = pad_slot, pad_block
        self.block_size = runner.kv_cache.block_size
        dev, top, entries = runner.device, self.buckets[-1], MAX_SEQS + 1
        # One buffer, one copy a pass: ids [top] | slot mapping [top] | cu_seqlens [entries + 1] | ctx lens | slots
        self.meta = torch.zeros(2 * top + 3 * entries + 1, dtype=torch.int64, device=dev)
        self.ids, self.slot_mapping, self.cu_seqlens, self.ctx_lens, self.slots = self.meta.split(
            [top, top, entries + 1, entries, entries])
        self.tables = torch.full((entries, width), pad_block, dtype=torch.int32, device=dev)
        self.stager = TableStager(entries, width, pad_block)
        self._passes: dict[int, CapturedPass] = {}
        # (tokens, sequences, their lengths) of the pass being replayed: what the attention breaks attend to
        self._real = (0, 0, HostLengths([0], []))
        self.replays = 0  # passes replayed since construction (tests, the pass record)

    def fits(self, work: list[tuple[object, int]]) -> bool:
        return len(work) <= MAX_SEQS and sum(n for _, n in work) <= self.buckets[-1]

    def _batch(self, bucket: int) -> ForwardBatch:
        return ForwardBatch(cu_seqlens=self.cu_seqlens, ctx_lens=self.ctx_lens, state_slots=self.slots,
                            block_tables=self.tables, slot_mapping=self.slot_mapping[:bucket], is_decode=False)

    def _write(self, rows, bucket: int) -> None:
        """The pass's rows into the buffers, padded: one synchronous copy of the metadata, then the changed tables."""
        n = sum(len(r.tokens) for r in rows)
        if n > bucket or len(rows) > MAX_SEQS:
            raise CudaGraphError(f"a prefill pass of {n} tokens in {len(rows)} sequences does not fit the bucket of "
                                 f"{bucket} tokens and {MAX_SEQS} sequences")
        used = max([1] + [len(r.table) for r in rows])
        if used > self.width:
            raise CudaGraphError(f"a block table of {used} blocks exceeds the captured width {self.width}")
        ids, mapping, cu = [], [], [0]
        for r in rows:
            ids.extend(r.tokens)
            mapping.extend(r.slot_mapping(self.block_size))
            cu.append(cu[-1] + len(r.tokens))
        top = self.ids.shape[0]
        ids.extend([0] * (top - n))  # padding tokens up to the bucket, then unread ones
        mapping.extend(self.pad_block * self.block_size + i % self.block_size for i in range(top - n))
        empty = MAX_SEQS - len(rows)
        cu.extend([n] * empty + [bucket])
        ctx = [r.ctx_len for r in rows] + [0] * (empty + 1)
        slots = [r.slot for r in rows] + [self.pad_slot] * (empty + 1)
        self.meta.copy_(torch.tensor(ids + mapping + cu + ctx + slots, dtype=torch.int64))
        self.stager.stage([r.table for r in rows] + [[self.pad_block]] * (empty + 1))
        self.tables[:, :used].copy_(self.stager.host[:, :used])
        self._real = (n, len(rows), HostLengths(cu[:len(rows) + 1], ctx[:len(rows)]))

    def _attend(self, brk: AttentionBreak) -> None:
        """The eager MLA attention of the real rows into brk.out (its padding rows stay zero)."""
        n, seqs, lengths = self._real
        if n == 0:
            return
        o = self.runner.ops.mla_prefill(brk.q_nope[:n], brk.q_pe[:n], brk.kv_cache, brk.w_kv_b,
                                        self.tables[:seqs], self.ctx_lens[:seqs], self.cu_seqlens[:seqs + 1],
                                        brk.scale, lengths=lengths)
        brk.out[:n].copy_(o)

    def _breaking_ops(self, on_break: Callable[[AttentionBreak], None]):
        """The runner's ops with MLA prefill replaced by a break: `on_break` gets the call, whose output buffer is
        returned (zeros: padding rows are never attended)."""

        def mla_prefill(q_nope, q_pe, kv_cache, w_kv_b, block_tables, ctx_lens, cu_seqlens, scale, lengths=None):
            nh, nope = q_nope.shape[1], q_nope.shape[2]
            out = torch.zeros(q_nope.shape[0], nh, w_kv_b.shape[0] // nh - nope, dtype=q_nope.dtype,
                              device=q_nope.device)
            on_break(AttentionBreak(q_nope, q_pe, kv_cache, w_kv_b, scale, out))
            return out

        return dataclasses.replace(self.runner.ops, mla_prefill=mla_prefill)

    def _context(self, bucket: int, ops) -> ForwardContext:
        r = self.runner
        return ForwardContext(self._batch(bucket), r.kda_pool, r.kv_cache, ops)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool; the buffers hold an all-padding pass."""
        pool = torch.cuda.graph_pool_handle() if self.capture_graphs else None
        model = self.runner.model
        for bucket in reversed(self.buckets):
            self._write([], bucket)
            ids = self.ids[:bucket]
            if not self.capture_graphs:
                self._passes[bucket] = self._eager_pass(bucket, ids)
                continue
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton compiles, the allocator settles
                for _ in range(2):
                    model(ids, self._context(bucket, self.runner.ops))
                graphs: list[torch.cuda.CUDAGraph] = []
                breaks: list[AttentionBreak] = []

                def next_graph(brk: AttentionBreak | None = None) -> None:
                    if brk is not None:
                        graphs[-1].capture_end()
                        breaks.append(brk)
                    graphs.append(torch.cuda.CUDAGraph())
                    graphs[-1].capture_begin(pool=pool)

                try:
                    next_graph()
                    out = model(ids, self._context(bucket, self._breaking_ops(next_graph)))
                    graphs[-1].capture_end()
                except RuntimeError as e:
                    raise CudaGraphError(
                        f"capturing the prefill graphs of {bucket} tokens failed ({e}); an op made a host sync or a "
                        "non-capturable call; run with --prefill-graph-tokens 0") from e
            torch.cuda.current_stream().wait_stream(side)

            def run(graphs=graphs, breaks=breaks, out=out) -> torch.Tensor:
                for graph, brk in zip(graphs, breaks + [None]):
                    graph.replay()
                    if brk is not None:
                        self._attend(brk)
                return out

            self._passes[bucket] = CapturedPass(run, len(breaks))
        if self.capture_graphs:
            torch.cuda.synchronize()
        log.info("prefill graphs captured", extra={"buckets": list(self.buckets), "max_seqs": MAX_SEQS,
                                                   "attention_breaks": next(iter(self._passes.values())).breaks})

    def _eager_pass(self, bucket: int, ids: torch.Tensor) -> CapturedPass:
        """CPU stand-in for a captured chain: the same buffers and padding, the breaks attending as they happen."""
        model, ctx = self.runner.model, self._context(bucket, self._breaking_ops(self._attend))
        return CapturedPass(lambda: model(ids, ctx), self.runner.cfg.layer_kinds.count("mla"))

    def replay(self, work) -> torch.Tensor:
        """Run one prefill pass of `work` [(sequence, new tokens)]; returns hidden states [n, D] (valid until the
        next call). Rows come from the eager runner's own builder (step_rows.py); advances nothing."""
        n = sum(k for _, k in work)
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None or len(work) > MAX_SEQS:
            raise CudaGraphError(f"no captured prefill graph for {n} tokens in {len(work)} sequences "
                                 f"(buckets {self.buckets}, at most {MAX_SEQS} sequences)")
        rows = build_rows(work, self.runner.kda_pool, self.runner.kv_cache)
        self._write(rows, bucket)
        hidden = self._passes[bucket].run()
        self.replays += 1
        return hidden[:n]


def enable_prefill_graphs(engine, width: int, pad_slot: int, pad_block: int) -> PrefillGraphRunner | None:
    """Capture prefill graphs beside an engine's decode graphs (their table width, padding slot and block), up to
    `prefill_graph_tokens` tokens a pass; None (and a log line saying why) when that is 0 or an op rules them out."""
    runner, tokens = engine.runner, engine.engine_cfg.prefill_graph_tokens
    if tokens == 0:
        log.info("prefill graphs off: prefill_graph_tokens is 0")
        return None
    unsafe = [name for name in PREFILL_OPS if not is_graph_safe(name, getattr(runner.ops, name))]
    if unsafe:
        log.warning("prefill graphs off: these prefill ops are not graph-safe", extra={"ops": unsafe})
        return None
    graphs = PrefillGraphRunner(runner, token_buckets(tokens), width, pad_slot, pad_block)
    graphs.capture()
    runner.prefill_graphs = graphs
    return graphs
