"""The model runner: turns a step plan into packed tensors, runs the model, returns logits. Owns the pools."""

from __future__ import annotations

import logging

import torch

from shard_svc.config import ModelConfig
from shard_svc.engine.sequence import Sequence
from shard_svc.forward_batch import ForwardBatch, ForwardContext
from shard_svc.model import KimiForCausalLM
from shard_svc.model.kimi import pack_weights
from shard_svc.ops import Ops
from shard_svc.state.pools import KDAStatePool, MLAKVCache

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, model: KimiForCausalLM, ops: Ops, device: torch.device,
                 num_slots: int, num_blocks: int, block_size: int, kda_heads: int | None = None):
        """kda_heads: this rank's KDA heads in a shard group (None: all of the model's)."""
        self.cfg, self.model, self.ops, self.device = cfg, model, ops, device
        # Once, after loading, tensor parallelism and weight streaming have edited the model: the weights of linears
        # that multiply the same input packed, so each such group runs as one product (names and values unchanged).
        log.info("packed %d groups of weights", pack_weights(model))
        dtype = next(model.parameters()).dtype
        self.kda_pool = KDAStatePool(cfg, num_slots, device, conv_dtype=dtype, num_heads=kda_heads)
        self.kv_cache = MLAKVCache(cfg, num_blocks, block_size, device, dtype)
        # -- weight streaming hook (shard_svc/streaming): a WeightStreamer attaches itself here. None: resident. --
        self.weights = None
        # -- decode graph hook (engine/cuda_graphs.py): a CudaGraphRunner attaches itself here. None: eager. --
        self.graphs = None
        # Tokens of each model forward the last pass ran (its micro-batches, for the prefill pass record). A pass is
        # one packed forward today, so this holds one entry; a runner that splits passes appends one per forward.
        self.chunk_tokens: list[int] = []

    def _batch(self, work: list[tuple[Sequence, int]], is_decode: bool) -> tuple[torch.Tensor, ForwardBatch]:
        bs = self.kv_cache.block_size
        ids: list[int] = []
        cu, ctx, slots, slot_mapping, tables = [0], [], [], [], []
        for seq, n in work:
            if seq.num_computed == 0:
                self.kda_pool.zero_slot(seq.slot)
            start = seq.num_computed
            self.kv_cache.reserve(seq.request_id, start + n)
            table = self.kv_cache.blocks.table(seq.request_id)
            # slices of prompt and output: `seq.tokens` would copy the whole context for every sequence, every step
            ids.extend(seq.prompt[start:start + n] + seq.output[max(0, start - len(seq.prompt)):
                                                                max(0, start + n - len(seq.prompt))])
            cu.append(cu[-1] + n)
            ctx.append(start)
            slots.append(seq.slot)
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            tables.append(table)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        batch = ForwardBatch(
            cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=dev),
            ctx_lens=torch.tensor(ctx, dtype=torch.int64, device=dev),
            state_slots=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            is_decode=is_decode,
        )
        return torch.tensor(ids, dtype=torch.int64, device=dev), batch

    @torch.inference_mode()
    def forward(self, work: list[tuple[Sequence, int]], is_decode: bool) -> list[torch.Tensor]:
        """Runs one pass; returns per sequence fp32 logits [n_rows, vocab]: every new position for sequences that
        keep prompt logits, else only the last one. Advances each sequence's num_computed."""
        if is_decode and self.graphs is not None and self.weights is None and self.graphs.fits(len(work)):
            hidden = self.graphs.replay(work)  # -- decode graph hook: one row per sequence --
            self.chunk_tokens = [len(work)]
        else:
            input_ids, batch = self._batch(work, is_decode)
            ctx = ForwardContext(batch, self.kda_pool, self.kv_cache, self.ops)
            self.chunk_tokens = [int(input_ids.shape[0])]
            if self.weights is None:
                hidden = self.model(input_ids, ctx)
            else:  # -- weight streaming hook: layers fetched into device slots during the pass --
                with self.weights.pass_scope(batch, int(input_ids.shape[0])):
                    hidden = self.model(input_ids, ctx)
        rows, spans, end = [], [], 0
        for seq, n in work:
            end += n  # host-side offsets: reading cu_seqlens back would sync once per sequence
            first = end - n if seq.keep_prompt_logits and seq.is_prefilling else end - 1
            spans.append(end - first)
            rows.extend(range(first, end))
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)], self.ops)
        for seq, n in work:
            seq.num_computed += n
        return list(logits.split(spans))
