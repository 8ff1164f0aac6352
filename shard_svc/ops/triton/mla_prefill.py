"""MLA prefill: flash-style causal attention over each sequence's latent cache (no rotary), variable lengths, with
the cached prefix of chunked prefill.

Reference: `shard_svc/ops/mla/eager.py::mla_attention` (the new tokens already written to the cache; query i of
sequence b sits at position ctx_lens[b] + i and sees keys 0 .. that position). Not absorbed: for prefill the
per-head form costs nope + rope + v = 320 multiply-adds per (query, key, head) against 2 x 512 + 64 for the latent
form, so the latents are gathered from the paged cache and expanded by `kv_b_proj` in one GEMM:

    k_nope | v = c_kv W_kv_b^T       [L, nh, nope + v]   (torch.mm over the gathered latents, packed)
    s_ij = scale * (q_nope_i . k_nope_j + q_pe_i . k_pe_j)   with k_pe shared by the heads
    o_i  = softmax_j<=i(s) v                               (`_mla_prefill_kernel`)

A bounded workspace. Expanded keys and values take nh * (nope + v) elements a key (16 KiB at the 48B shape), so a
pass late in a million-token prompt would need ~17 GB for them if expanded at once, and more each pass. The pass's
keys (every sequence's positions 0 .. ctx + new, packed) are therefore cut into segments of at most
`workspace_tokens`; each segment is gathered, expanded and attended to by the query blocks that see any of its keys,
which fold their part into a running output and log-sum-exp per (query, head): the online softmax, carried across
launches. A pass whose keys fit in one segment (every pass of a prompt shorter than the workspace) is one launch
that writes the output directly.

Long sequences go to a fused attention library instead (`shard_svc/ops/mla/long_context.py`; cuDNN on CUDA, which
ran 1.8x this kernel at the 48B shape on the H200, 1.3x on an H100 once the kernel pipelined three key tiles): a
sequence whose new queries times cached keys reach `long_pairs`, with the same bounded workspace. The rest (prompts
without a long context, decodes folded into the pass) stay packed in this kernel: per-sequence library calls would
cost more than they save there, and cuDNN builds an execution plan for every new shape, which only a pass over a long
context repays.

One program per (query block of one sequence, head) and segment: first the key tiles that every query of the block
sees (positions before its first query: no mask), then the tiles at the causal edge. The segments and blocks are
laid out on the host from the sequences' lengths (the caller's `lengths`, else read back from the device: a sync)
and reach the device by asynchronous copies from pinned memory, so with `lengths` the op makes no host sync. It is
not captured in a CUDA graph (it does not declare `graph_safe`): the prefill graphs run it between their pieces
(shard_svc/engine/prefill_graphs.py). The op declares `context_workspace_tokens` (and, where it has a library,
`long_context_pairs`), which the memory probe reads to profile a pass past them (shard_svc/engine/memory_profile.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.host_lengths import HostLengths
from shard_svc.ops.mla.long_context import Attend, prefill_sequence
from shard_svc.ops.triton.common import (TritonKernelError, check_mla_layer, dot_precision, interpreting,
                                         pow2_at_least, to_device)
from shard_svc.ops.triton.jit_helpers import LOG2E, online_softmax_step

# Keys expanded at once per pass: ~560 MiB of workspace at the 48B shape, the same for every pass however long the
# context. A multiple of the key tile, and well above the prefill budget so that ordinary prompts take one launch.
CONTEXT_WORKSPACE_TOKENS = 32768
# New queries x cached keys of one sequence's pass from which it goes to `long_attend`: an 8,192-token chunk at 128k
# of context, or 4,096 at 256k. Such a pass's attention takes ~50 ms a layer in this kernel, so the library's rate
# (1.1-1.3x there) pays for its fixed costs (expansion, layout copies, merge, a plan per new shape: 70-94 ms the
# first time) over the passes of a long prompt.
LONG_PAIRS = 1 << 30
BLOCK_FIELDS = 6  # a query block's entries in the layout (`_layout`)
# Keys of one sequence in a segment from which the kernel pipelines three key tiles instead of two. Measured on an
# H100 (bench/results/mla_prefill_layouts_h100_2026-12-07{,b}.json, one sequence, 48B heads): three stages were
# 18-23% faster from 8,192 to 131,072 keys and 6-9% at 4,608-8,192; at 2,048 keys (a prompt's first chunk) one run
# had them 76% slower and the other 5% faster, so below this they stay at two, as before.
DEEP_PIPELINE_KEYS = 4096


@triton.jit
def _key_tile(b_qn, b_qp, kv, k_pe, krow, m_n, o_dn, o_dr, o_dv, m_dn, m_dr, m_dv, head, stride_kv, stride_kp,
              NOPE: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Scores [BM, BN] (unscaled) and values [BN, V_P] of the keys at workspace rows krow (m_n: rows that exist)."""
    b_kn = tl.load(kv + krow[:, None] * stride_kv + head + o_dn[None, :], mask=m_n[:, None] & m_dn[None, :],
                   other=0.0)
    b_kp = tl.load(k_pe + krow[:, None] * stride_kp + o_dr[None, :], mask=m_n[:, None] & m_dr[None, :], other=0.0)
    b_v = tl.load(kv + krow[:, None] * stride_kv + head + NOPE + o_dv[None, :], mask=m_n[:, None] & m_dv[None, :],
                  other=0.0)
    if DOT_FP32:  # the interpreter multiplies bf16 dot operands wrongly
        b_kn, b_kp, b_v = b_kn.to(tl.float32), b_kp.to(tl.float32), b_v.to(tl.float32)
    return (tl.dot(b_qn, tl.trans(b_kn), input_precision=PRECISION)
            + tl.dot(b_qp, tl.trans(b_kp), input_precision=PRECISION)), b_v


@triton.jit
def _mla_prefill_kernel(
    q_nope, q_pe, kv, k_pe, out, lse, blocks,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_kv, stride_kp, stride_o_t, stride_o_h, stride_lse_t,
    scale_log2,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr, NOPE_P: tl.constexpr, ROPE_P: tl.constexpr,
    V_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, FIELDS: tl.constexpr, MERGE: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    i_blk = tl.program_id(0)
    i_h = tl.program_id(1)
    # the block's first query row, queries left in its sequence from there, position of its first query; the
    # sequence's key positions [k_lo, k_hi) in this segment, the first of them at workspace row kv_row
    p_blk = blocks + i_blk * FIELDS
    q_row = tl.load(p_blk).to(tl.int64)
    n_q = tl.load(p_blk + 1)
    pos0 = tl.load(p_blk + 2)
    kv_row = tl.load(p_blk + 3).to(tl.int64)
    k_lo = tl.load(p_blk + 4)
    k_hi = tl.load(p_blk + 5)

    o_m = tl.arange(0, BM)
    m_m = o_m < n_q
    pos_q = pos0 + o_m
    k_end = tl.minimum(k_hi, pos0 + tl.minimum(n_q, BM))  # no key after the block's last query is seen
    # Keys up to pos0 are seen by every row (rows past n_q sit later still): whole tiles of them need no mask.
    k_open = k_lo + tl.maximum(tl.minimum(k_end, pos0 + 1) - k_lo, 0) // BN * BN
    o_n = tl.arange(0, BN)
    o_dn = tl.arange(0, NOPE_P)
    o_dr = tl.arange(0, ROPE_P)
    o_dv = tl.arange(0, V_P)
    m_dn = o_dn < NOPE
    m_dr = o_dr < ROPE
    m_dv = o_dv < V
    rows = q_row + o_m
    b_qn = tl.load(q_nope + rows[:, None] * stride_qn_t + i_h * stride_qn_h + o_dn[None, :],
                   mask=m_m[:, None] & m_dn[None, :], other=0.0)
    b_qp = tl.load(q_pe + rows[:, None] * stride_qp_t + i_h * stride_qp_h + o_dr[None, :],
                   mask=m_m[:, None] & m_dr[None, :], other=0.0)
    if DOT_FP32:
        b_qn, b_qp = b_qn.to(tl.float32), b_qp.to(tl.float32)

    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, V_P], dtype=tl.float32)
    head = i_h * (NOPE + V)
    every = o_n < BN
    for n0 in range(k_lo, k_open, BN):
        s, b_v = _key_tile(b_qn, b_qp, kv, k_pe, kv_row + (n0 - k_lo) + o_n, every, o_dn, o_dr, o_dv, m_dn, m_dr,
                           m_dv, head, stride_kv, stride_kp, NOPE, DOT_FP32, PRECISION)
        m_i, l_i, acc = online_softmax_step(s * scale_log2, m_i, l_i, acc, b_v, PRECISION)
    for n0 in range(k_open, k_end, BN):
        keys = n0 + o_n
        m_n = keys < k_end
        s, b_v = _key_tile(b_qn, b_qp, kv, k_pe, kv_row + (n0 - k_lo) + o_n, m_n, o_dn, o_dr, o_dv, m_dn, m_dr,
                           m_dv, head, stride_kv, stride_kp, NOPE, DOT_FP32, PRECISION)
        s = tl.where(m_n[None, :] & (keys[None, :] <= pos_q[:, None]), s * scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, b_v, PRECISION)

    p_o = out + rows[:, None] * stride_o_t + i_h * stride_o_h + o_dv[None, :]
    m_o = m_m[:, None] & m_dv[None, :]
    if MERGE:
        # Fold this segment into the running output (fp32, normalised) and base-2 log-sum-exp of the segments
        # before it. A row that saw no key yet (lse -inf) or sees none here (l_i 0) adds nothing.
        p_lse = lse + rows * stride_lse_t + i_h
        lse_prev = tl.load(p_lse, mask=m_m, other=float("-inf"))
        o_prev = tl.load(p_o, mask=m_o, other=0.0)
        m_new = tl.maximum(lse_prev, m_i)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        w_prev = tl.exp2(lse_prev - m_ref)
        w_seg = tl.exp2(m_i - m_ref)
        total = w_prev + l_i * w_seg
        seen = total > 0
        o = (o_prev * w_prev[:, None] + acc * w_seg[:, None]) / tl.where(seen, total, 1.0)[:, None]
        tl.store(p_o, o, mask=m_o)
        tl.store(p_lse, tl.where(seen, m_ref + tl.log2(tl.where(seen, total, 1.0)), float("-inf")), mask=m_m)
    else:
        # One segment holds every key: each valid query sees at least its own, so l_i > 0 on the stored rows.
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(p_o, o.to(out.dtype.element_ty), mask=m_o)


def _segments(ctx: list[int], lens: list[int], workspace: int) -> list[list[tuple[int, int, int]]]:
    """The pass's key positions, sequence after sequence, cut into segments of at most `workspace` keys: each a list
    of (sequence, first position, end position). A sequence without new tokens has no query, so no keys."""
    segments, current, room = [], [], workspace
    for b, (c, n) in enumerate(zip(ctx, lens)):
        lo, total = 0, c + n if n else 0
        while lo < total:
            take = min(room, total - lo)
            current.append((b, lo, lo + take))
            lo, room = lo + take, room - take
            if room == 0:
                segments.append(current)
                current, room = [], workspace
    if current:
        segments.append(current)
    return segments


def _layout(pieces: list[tuple[int, int, int]], ctx: list[int], bounds: list[int], block_m: int
            ) -> tuple[list[int], list[int]]:
    """One segment's query blocks as (first query row, queries left, first query position, workspace row of the
    piece's first key, k_lo, k_hi), flattened, those with the most keys to read first (fewer stragglers); blocks
    whose queries all sit before the piece see none of it and are left out. Also each piece's first workspace row."""
    blocks, starts, at = [], [], 0
    for b, lo, hi in pieces:
        start, n, c = bounds[b], bounds[b + 1] - bounds[b], ctx[b]
        starts.append(at)
        blocks.extend((start + i, n - i, c + i, at, lo, hi) for i in range(0, n, block_m)
                      if c + i + min(n - i, block_m) > lo)
        at += hi - lo
    blocks.sort(key=lambda blk: -(min(blk[5], blk[2] + min(blk[1], block_m)) - blk[4]))
    return [v for blk in blocks for v in blk], starts


def pipeline_stages(pieces: list[tuple[int, int, int]]) -> int:
    """Key tiles in flight for one segment: 3 where a sequence has DEEP_PIPELINE_KEYS keys in it, else 2."""
    return 3 if max(hi - lo for _, lo, hi in pieces) >= DEEP_PIPELINE_KEYS else 2


def _expand(pieces: list[tuple[int, int, int]], starts: list[int], kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
            block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment's keys gathered from the paged cache, packed: (k_nope | v per head [L, nh * (nope + v)],
    k_pe [L, rope])."""
    dev, bs, width = kv_cache.device, kv_cache.shape[1], kv_cache.shape[2]
    kv_lora = w_kv_b.shape[1]
    lens = [hi - lo for _, lo, hi in pieces]
    piece = torch.repeat_interleave(torch.arange(len(pieces), device=dev), to_device(lens, torch.int64, dev),
                                    output_size=sum(lens))
    # workspace row r of piece p holds position r - starts[p] + lo_p of sequence b_p
    meta = to_device([(b, lo - at) for (b, lo, _), at in zip(pieces, starts)], torch.int64, dev)
    seq = meta[piece, 0]
    pos = torch.arange(piece.shape[0], device=dev) + meta[piece, 1]
    rows = block_tables[seq, pos // bs].long() * bs + pos % bs
    latent = kv_cache.reshape(-1, width)[rows]  # [L, kv_lora + rope]
    return latent[:, :kv_lora] @ w_kv_b.t(), latent[:, kv_lora:]


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
                block_tables: torch.Tensor, ctx_lens: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                block_m: int = 128, block_n: int = 64, workspace_tokens: int = CONTEXT_WORKSPACE_TOKENS,
                long_attend: Attend | None = None, long_pairs: int = LONG_PAIRS, num_stages: int | None = None,
                lengths: HostLengths | None = None) -> torch.Tensor:
    """Same contract as `ops.mla.eager.mla_attention`; returns o [T, nh, v] in q's dtype. workspace_tokens: the most
    keys expanded at once; long_attend: the library attention for sequences whose new tokens times cached tokens
    reach long_pairs (None: every sequence in this kernel); block_m, block_n, num_stages: the kernel's tiles and
    pipeline depth (bench/mla_prefill_long.py sweeps them; num_stages None: 3 for a segment where a sequence has
    DEEP_PIPELINE_KEYS keys or more, else 2). Module docstring."""
    op = "mla_prefill"
    t, nh, nope, rope, _, v_dim, bs, _ = check_mla_layer(
        op, q_nope, q_pe, kv_cache, w_kv_b, block_tables, ctx_lens, cu_seqlens)
    n_seq = block_tables.shape[0]
    if max(nope, rope, v_dim) > 256:
        raise TritonKernelError(f"{op}: head dims nope {nope}, rope {rope}, v {v_dim} above 256 are not supported")
    if workspace_tokens < 1:
        raise TritonKernelError(f"{op}: workspace_tokens must be at least 1, got {workspace_tokens}")
    out = torch.empty(t, nh, v_dim, dtype=q_nope.dtype, device=q_nope.device)
    if t == 0 or n_seq == 0:
        return out
    if lengths is None:
        ctx, bounds = ctx_lens.tolist(), cu_seqlens.tolist()  # a host sync: the caller did not send them
    else:
        ctx, bounds = lengths.ctx_lens, lengths.cu_seqlens
        if len(ctx) != n_seq or len(bounds) != n_seq + 1:
            raise TritonKernelError(f"{op}: host lengths of {len(ctx)} contexts and {len(bounds)} offsets for "
                                    f"{n_seq} sequences")
    if bounds[-1] != t:
        raise TritonKernelError(f"{op}: cu_seqlens ends at {bounds[-1]} for {t} query tokens")
    lens = [bounds[b + 1] - bounds[b] for b in range(n_seq)]
    longest = max(c + n for c, n in zip(ctx, lens))
    if -(-longest // bs) > block_tables.shape[1]:
        raise TritonKernelError(f"{op}: a sequence of {longest} tokens needs more than the "
                                f"{block_tables.shape[1]} blocks of its table")
    long = {b for b, (c, n) in enumerate(zip(ctx, lens)) if n and long_attend and n * c >= long_pairs}
    segments = _segments(ctx, [0 if b in long else n for b, n in enumerate(lens)], workspace_tokens)
    _packed(segments, out, q_nope, q_pe, kv_cache, w_kv_b, block_tables, ctx, bounds, scale, block_m, block_n,
            num_stages)
    for b in sorted(long):
        s, e = bounds[b], bounds[b + 1]
        out[s:e] = prefill_sequence(q_nope[s:e], q_pe[s:e], kv_cache, w_kv_b, block_tables[b], ctx[b], scale,
                                    long_attend, workspace_tokens)
    return out


def _packed(segments: list[list[tuple[int, int, int]]], out: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
            kv_cache: torch.Tensor, w_kv_b: torch.Tensor, block_tables: torch.Tensor, ctx: list[int],
            bounds: list[int], scale: float, block_m: int, block_n: int, num_stages: int | None) -> None:
    """This kernel over the segments' sequences, writing their rows of `out` (and, with several segments, zeros on
    the rest)."""
    t, nh, v_dim = out.shape
    nope, rope = q_nope.shape[2], q_pe.shape[2]
    merge = len(segments) > 1
    # Across segments: the running output in fp32 and its base-2 log-sum-exp (-inf: no key seen yet).
    target = torch.zeros(t, nh, v_dim, dtype=torch.float32, device=out.device) if merge else out
    lse = torch.full((t, nh), float("-inf"), dtype=torch.float32, device=out.device) if merge else target
    for pieces in segments:
        blocks, starts = _layout(pieces, ctx, bounds, block_m)
        kv, k_pe = _expand(pieces, starts, kv_cache, w_kv_b, block_tables)
        _mla_prefill_kernel[(len(blocks) // BLOCK_FIELDS, nh)](
            q_nope, q_pe, kv, k_pe, target, lse, to_device(blocks, torch.int32, out.device),
            q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), k_pe.stride(0),
            target.stride(0), target.stride(1), lse.stride(0), scale * LOG2E,
            NOPE=nope, ROPE=rope, V=v_dim, NOPE_P=pow2_at_least(nope, 16), ROPE_P=pow2_at_least(rope, 16),
            V_P=pow2_at_least(v_dim, 16), BM=block_m, BN=block_n, FIELDS=BLOCK_FIELDS, MERGE=merge,
            DOT_FP32=interpreting(), PRECISION=dot_precision(q_nope.dtype), num_warps=8 if block_m >= 128 else 4,
            num_stages=num_stages or pipeline_stages(pieces))
    if merge:
        out.copy_(target)  # the library's sequences' rows too: they are written after this


mla_prefill.context_workspace_tokens = CONTEXT_WORKSPACE_TOKENS
