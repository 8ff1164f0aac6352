"""The model runner: turns a step plan into packed tensors, runs the model, returns logits. Owns the pools."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from shard_svc.config import ModelConfig
from shard_svc.engine.prompt_logprobs import SCORE_ROWS, PromptScores
from shard_svc.engine.sequence import Sequence
from shard_svc.engine.step_rows import build_rows
from shard_svc.forward_batch import ForwardBatch, ForwardContext
from shard_svc.model import KimiForCausalLM
from shard_svc.model.kimi import pack_weights
from shard_svc.ops import Ops
from shard_svc.ops.host_lengths import HostLengths
from shard_svc.ops.kda.snapshots import StateSnapshots
from shard_svc.state.pools import KDAStatePool, MLAKVCache

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, model: KimiForCausalLM, ops: Ops, device: torch.device,
                 num_slots: int, num_blocks: int, block_size: int, kda_heads: int | None = None,
                 decode_ops: Ops | None = None):
        """kda_heads: this rank's KDA heads in a shard group (None: all of the model's). decode_ops: what
        decode-only passes run (None: `ops`); batch-invariant mode keeps the fast ops there, since only prompt
        rows must round alike in any split (shard_svc/ops/batch_invariant.py)."""
        self.cfg, self.model, self.ops, self.device = cfg, model, ops, device
        self._decode_ops = decode_ops
        # Once, after loading, tensor parallelism and weight streaming have edited the model: the weights of linears
        # that multiply the same input packed, so each such group runs as one product (names and values unchanged).
        log.info("packed %d groups of weights", pack_weights(model))
        dtype = next(model.parameters()).dtype
        self.kda_pool = KDAStatePool(cfg, num_slots, device, conv_dtype=dtype, num_heads=kda_heads)
        self.kv_cache = MLAKVCache(cfg, num_blocks, block_size, device, dtype)
        # -- weight streaming hook (shard_svc/weight_streaming): a WeightStreamer attaches here; None: resident --
        self.weights = None
        # -- decode graph hook (engine/cuda_graphs.py): a CudaGraphRunner attaches itself here. None: eager. --
        self.graphs = None
        # -- prefill graph hook (engine/prefill_graphs.py): a PrefillGraphRunner attaches itself here. None: eager. --
        self.prefill_graphs = None
        # Tokens of each model forward the last pass ran (its micro-batches, for the prefill pass record). A pass is
        # one packed forward today, so this holds one entry; a runner that splits passes appends one per forward.
        self.chunk_tokens: list[int] = []
        self.graphed = False  # whether the last pass replayed CUDA graphs (the pass record)

    @property
    def decode_ops(self) -> Ops:
        """The ops of decode-only passes: `ops` itself (so replacing `ops` replaces both) unless set apart."""
        return self._decode_ops or self.ops

    def map_ops(self, fn: Callable[[Ops], Ops]) -> None:
        """Applies fn to every op set this runner holds (the weight streamer wraps them all)."""
        self.ops = fn(self.ops)
        if self._decode_ops is not None:
            self._decode_ops = fn(self._decode_ops)

    def _batch(self, work: list[tuple[Sequence, int]], is_decode: bool,
               points: dict[str, list[tuple[int, int]]]) -> tuple[torch.Tensor, ForwardBatch]:
        rows = build_rows(work, self.kda_pool, self.kv_cache)
        bs = self.kv_cache.block_size
        ids, cu, slot_mapping = [], [0], []
        for row in rows:
            ids.extend(row.tokens)
            cu.append(cu[-1] + len(row.tokens))
            slot_mapping.extend(row.slot_mapping(bs))
        width = max(len(row.table) for row in rows)
        dev = self.device
        ctx_lens = [row.ctx_len for row in rows]
        batch = ForwardBatch(
            cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=dev),
            ctx_lens=torch.tensor(ctx_lens, dtype=torch.int64, device=dev),
            state_slots=torch.tensor([row.slot for row in rows], dtype=torch.int64, device=dev),
            block_tables=torch.tensor([row.table + [0] * (width - len(row.table)) for row in rows],
                                      dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            is_decode=is_decode,
            host_lengths=HostLengths(cu, ctx_lens),
        )
        if points:
            at = [(b, m, slot) for b, (seq, _) in enumerate(work) for m, slot in points.get(seq.request_id, ())]
            batch.snapshots = StateSnapshots.build(cu, [row.slot for row in rows], at, dev)
        return torch.tensor(ids, dtype=torch.int64, device=dev), batch

    def _score(self, seq: Sequence, hidden: torch.Tensor, start: int, n: int) -> None:
        """Scores the prompt positions of this pass (hidden rows start .. start + n - 1) SCORE_ROWS at a time, so a
        long chunk never holds its [n, vocab] logits at once."""
        seq.prompt_scores = seq.prompt_scores or PromptScores()
        for offset in range(0, n, SCORE_ROWS):
            rows = hidden[start + offset:start + min(n, offset + SCORE_ROWS)]
            seq.prompt_scores.add_chunk(self.model.compute_logits(rows, self.ops), seq.prompt,
                                        seq.num_computed + offset, seq.params.prompt_logprobs)

    @torch.inference_mode()
    def forward(self, work: list[tuple[Sequence, int]], is_decode: bool,
                points: dict[str, list[tuple[int, int]]] | None = None) -> list[torch.Tensor]:
        """Runs one pass; returns per sequence fp32 logits [n_rows, vocab]: every new position for sequences that
        keep prompt logits, else only the last one (prompt_logprobs sequences' positions are scored on the way).
        points: request id -> (m, slot) snapshot points inside its new tokens, m increasing (prefill passes): the
        KDA states after its first m new tokens go into `slot`, and its rows start with one more per point, the
        logits at the position before it. Advances each sequence's num_computed."""
        points = points or {}
        ops = self.decode_ops if is_decode else self.ops
        if is_decode and self.graphs is not None and self.weights is None and self.graphs.fits(len(work)):
            hidden = self.graphs.replay(work)  # -- decode graph hook: one row per sequence --
            self.chunk_tokens, self.graphed = [len(work)], True
        elif (not is_decode and not points and self.prefill_graphs is not None and self.weights is None
              and self.prefill_graphs.fits(work)):
            hidden = self.prefill_graphs.replay(work)  # -- prefill graph hook: small passes without points --
            self.chunk_tokens, self.graphed = [int(hidden.shape[0])], True
        else:
            input_ids, batch = self._batch(work, is_decode, points)
            ctx = ForwardContext(batch, self.kda_pool, self.kv_cache, ops)
            self.chunk_tokens, self.graphed = [int(input_ids.shape[0])], False
            if self.weights is None:
                hidden = self.model(input_ids, ctx)
            else:  # -- weight streaming hook: layers fetched into device slots during the pass --
                with self.weights.pass_scope(batch, int(input_ids.shape[0])):
                    hidden = self.model(input_ids, ctx)
        rows, spans, end = [], [], 0
        for seq, n in work:
            end += n  # host-side offsets: reading cu_seqlens back would sync once per sequence
            first = end - n if seq.keep_prompt_logits and seq.is_prefilling else end - 1
            at = [end - n + m - 1 for m, _ in points.get(seq.request_id, ())]
            spans.append(len(at) + end - first)
            rows.extend(at + list(range(first, end)))
            if seq.params.prompt_logprobs is not None and seq.is_prefilling:
                self._score(seq, hidden, end - n, n)
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)], ops)
        for seq, n in work:
            seq.num_computed += n
        return list(logits.split(spans))
