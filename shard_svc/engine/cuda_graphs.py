"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed instead of launching every kernel.

A decode step of B sequences is padded to the smallest captured bucket >= B. Each graph was captured against
persistent input buffers (token ids, context lengths, KDA state slots, MLA slot mapping, block tables padded to a
fixed width) and the fixed-address pools, so a step only copies its rows into the buffers and replays.

Padding rows must not touch anybody's state: they read and write one KDA state slot and one KV block reserved for
them (`PAD_OWNER`), so the engine is built with one slot and one block more than it advertises
(`graph_engine_config`). Graphs are used only when every decode op of the selected backend declares itself
graph-safe (`graph_safe = True` on the implementation: no host sync, buffers and grids from shapes alone);
otherwise the runner stays eager and says why. `--enforce-eager` keeps it eager. The bucketing and padding below
are plain Python; with `capture=False` (CPU tests) the same buffers are run eagerly instead of replayed.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from shard_svc.engine.graph_buffers import CudaGraphError, TableStager, is_graph_safe
from shard_svc.engine.prefill_graphs import enable_prefill_graphs
from shard_svc.engine.step_rows import StepRow, build_rows
from shard_svc.forward_batch import ForwardBatch, ForwardContext
from shard_svc.ops import Ops

log = logging.getLogger(__name__)

PAD_OWNER = "<cuda-graph padding>"
# Every op a decode step calls through the seam (prefill-only ops excluded).
DECODE_OPS = ("linear", "rms_norm", "add_rms_norm", "gated_rms_norm", "glu", "short_conv", "kda_decode",
              "mla_cache_write", "mla_decode", "moe_route", "moe_experts", "moe_experts_shared")


def unsafe_decode_ops(ops: Ops) -> list[str]:
    """Decode ops whose implementation is not declared graph-safe (empty: graphs may be used). A fused op the backend
    does not provide (None) is composed of the others, which are checked themselves."""
    return [name for name in DECODE_OPS
            if getattr(ops, name) is not None and not is_graph_safe(name, getattr(ops, name))]


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch, and max_batch itself."""
    if max_batch < 1:
        return ()
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch} | set(range(16, max_batch + 1, 16)) | {max_batch}
    return tuple(sorted(sizes))


def pick_bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n rows; None when n is above every bucket."""
    return next((b for b in buckets if b >= n), None)


def graph_engine_config(engine_cfg, device: torch.device, enforce_eager: bool):
    """The engine config to build with: one extra state slot and KV block for padding rows when graphs may run."""
    if enforce_eager or device.type != "cuda":
        return engine_cfg
    return dataclasses.replace(engine_cfg, num_state_slots=engine_cfg.num_state_slots + 1,
                               num_kv_blocks=engine_cfg.num_kv_blocks + 1)


@dataclass(frozen=True)
class PaddedRows:
    """One decode step's rows padded to a bucket, as host lists."""

    meta: list[list[int]]  # [4][bucket]: token ids, ctx lens, state slots, slot mapping
    tables: list[list[int]]  # [bucket] each row's block table (the padding rows': [pad block]), not copied
    used: int  # columns in use: the longest table (at least 1)


def pad_rows(rows: list[StepRow], bucket: int, width: int, block_size: int, pad_slot: int,
             pad_block: int) -> PaddedRows:
    """Real rows (one token each) first, then padding rows (token 0, empty context, the padding slot and block). A
    table longer than the captured `width` is refused."""
    if len(rows) > bucket:
        raise CudaGraphError(f"{len(rows)} decode rows do not fit the bucket of {bucket}")
    used = max([1] + [len(r.table) for r in rows])
    if used > width:
        raise CudaGraphError(f"a block table of {used} blocks exceeds the captured width {width}")
    meta: list[list[int]] = [[], [], [], []]
    for r in rows:
        if len(r.tokens) != 1:
            raise CudaGraphError(f"decode graphs take one token per sequence; a row has {len(r.tokens)}")
        if r.ctx_len // block_size >= len(r.table):
            raise CudaGraphError(f"position {r.ctx_len} is past the sequence's {len(r.table)} blocks")
        for column, value in zip(meta, (r.tokens[0], r.ctx_len, r.slot, *r.slot_mapping(block_size))):
            column.append(value)
    for _ in range(bucket - len(rows)):
        for column, value in zip(meta, (0, 0, pad_slot, pad_block * block_size)):
            column.append(value)
    pad_table = [pad_block]
    return PaddedRows(meta, [r.table for r in rows] + [pad_table] * (bucket - len(rows)), used)


class CudaGraphRunner:
    """Persistent decode inputs and one captured graph per bucket; attached to a ModelRunner as `runner.graphs`."""

    def __init__(self, runner, buckets: tuple[int, ...], max_blocks_per_seq: int, capture: bool = True):
        if not buckets:
            raise CudaGraphError("no decode batch sizes to capture")
        self.runner, self.buckets, self.capture_graphs = runner, tuple(sorted(buckets)), capture
        self.width = max_blocks_per_seq
        self.block_size = runner.kv_cache.block_size
        self.pad_slot = runner.kda_pool.slots.allocate(PAD_OWNER)
        runner.kv_cache.reserve(PAD_OWNER, 1)  # a zeroed block
        self.pad_block = runner.kv_cache.blocks.table(PAD_OWNER)[0]
        runner.kda_pool.zero_slot(self.pad_slot)
        dev, top = runner.device, self.buckets[-1]
        self.meta = torch.zeros(4, top, dtype=torch.int64, device=dev)  # ids, ctx lens, slots, slot mapping
        self.tables = torch.full((top, self.width), self.pad_block, dtype=torch.int32, device=dev)
        self.stager = TableStager(top, self.width, self.pad_block)
        self.cu_seqlens = torch.arange(top + 1, dtype=torch.int64, device=dev)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        log.info("decode graphs: padding rows use a reserved slot and KV block",
                 extra={"buckets": list(self.buckets), "pad_slot": self.pad_slot, "pad_block": self.pad_block,
                        "table_width": self.width, "capture": capture})

    def fits(self, n: int) -> bool:
        return pick_bucket(n, self.buckets) is not None

    def _context(self, bucket: int) -> tuple[torch.Tensor, ForwardContext]:
        batch = ForwardBatch(cu_seqlens=self.cu_seqlens[: bucket + 1], ctx_lens=self.meta[1, :bucket],
                             state_slots=self.meta[2, :bucket], block_tables=self.tables[:bucket],
                             slot_mapping=self.meta[3, :bucket], is_decode=True)
        r = self.runner
        return self.meta[0, :bucket], ForwardContext(batch, r.kda_pool, r.kv_cache, r.decode_ops)

    def _write(self, padded: PaddedRows) -> None:
        """Synchronous copies: the host buffers may be rewritten as soon as they return."""
        bucket, used = len(padded.meta[0]), padded.used
        self.meta[:, :bucket].copy_(torch.tensor(padded.meta, dtype=torch.int64))
        self.stager.stage(padded.tables)
        self.tables[:bucket, :used].copy_(self.stager.host[:bucket, :used])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool. Inputs are all padding rows meanwhile."""
        pool = torch.cuda.graph_pool_handle() if self.capture_graphs else None
        for bucket in reversed(self.buckets):
            self._write(pad_rows([], bucket, self.width, self.block_size, self.pad_slot, self.pad_block))
            ids, ctx = self._context(bucket)
            model = self.runner.model
            if not self.capture_graphs:
                out = model(ids, ctx)
                self._graphs[bucket] = (lambda out=out, ids=ids, ctx=ctx: out.copy_(model(ids, ctx)), out)
                continue
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton compiles, the allocator settles
                for _ in range(2):
                    model(ids, ctx)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=pool):
                    out = model(ids, ctx)
            except RuntimeError as e:
                raise CudaGraphError(f"capturing the decode graph of batch {bucket} failed ({e}); an op made a "
                                     "host sync or a non-capturable call; run with --enforce-eager") from e
            self._graphs[bucket] = (graph.replay, out)
        if self.capture_graphs:
            torch.cuda.synchronize()
        log.info("decode graphs captured", extra={"buckets": list(self.buckets)})

    def replay(self, work) -> torch.Tensor:
        """Run one decode step of `work` [(sequence, 1)]; returns hidden states [B, D] (valid until the next call).
        Its rows come from the eager runner's own builder (shard_svc/engine/step_rows.py); advances nothing."""
        bucket = pick_bucket(len(work), self.buckets)
        if bucket is None or bucket not in self._graphs:
            raise CudaGraphError(f"no captured graph for a decode batch of {len(work)} (buckets {self.buckets})")
        multi = [(seq.request_id, n) for seq, n in work if n != 1]
        if multi:  # checked before build_rows reserves cache room for them
            raise CudaGraphError(f"decode graphs take one token per sequence; {multi[0][0]!r} has {multi[0][1]}")
        rows = build_rows(work, self.runner.kda_pool, self.runner.kv_cache)
        self._write(pad_rows(rows, bucket, self.width, self.block_size, self.pad_slot, self.pad_block))
        run, out = self._graphs[bucket]
        run()
        return out[: len(work)]


def enable_cuda_graphs(engine, buckets: tuple[int, ...] | None = None) -> CudaGraphRunner | None:
    """Capture decode graphs for an engine built with `graph_engine_config`; None (and a log line saying why) when
    the device, the op backend or weight streaming rules them out."""
    runner = engine.runner
    if engine.device.type != "cuda":
        log.info("decode graphs off: not a CUDA device", extra={"device": str(engine.device)})
        return None
    unsafe = unsafe_decode_ops(runner.decode_ops)
    if unsafe:
        log.warning("decode graphs off: these decode ops are not graph-safe", extra={"ops": unsafe})
        return None
    if runner.weights is not None:
        log.warning("decode graphs off: weights are streamed per layer")
        return None
    # The padding rows take the extra slot graph_engine_config added: one sequence fewer may run. Prefix cache
    # entries hold slots that never decode.
    engine.scheduler.max_running -= 1
    max_batch = min(runner.kda_pool.slots.num_free - 1, engine.scheduler.max_running)
    bs = runner.kv_cache.block_size
    width = min(runner.kv_cache.blocks.num_blocks, -(-engine.max_model_len // bs))
    graphs = CudaGraphRunner(runner, buckets or bucket_sizes(max_batch), width)
    # The padding block is gone from the cache for good: the longest sequence shrinks to what the rest holds.
    engine.max_model_len = min(engine.max_model_len, (runner.kv_cache.blocks.num_blocks - 1) * bs)
    graphs.capture()
    runner.graphs = graphs
    enable_prefill_graphs(engine, graphs.width, graphs.pad_slot, graphs.pad_block)
    return graphs
