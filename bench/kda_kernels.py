"""Our Triton KDA kernels beside fla-core's chunk_kda / fused_recurrent_kda, one process, same inputs (one H200).

    python bench/kda_kernels.py [--out DIR] [--sweep] [--quick]

--sweep also times 32- and 64-row chunks beside the default 16 on every shape (`--chunks` picks them), kernel layouts
(B=1 T=16k; with --k3 the 16-row layouts on every K3 shape) and the pipelined token ranges (--k3: of lone and
packed sequences).
--k3 times K3's lower-bound gate (-5) on FlashKDA's shapes (1 x 8k / 16k / 64k, 8 x 1k and 8 x 4k packed) against
fla and FlashKDA (`flash_kda`, built on the GPU from its repository; absent, its columns say so).

Kimi-Linear-48B head shape: H=32, K=V=128, bf16 inputs, fp32 state. Prefill: B=1 x T=4k/16k/64k and B=8 x 4k
(ours packed varlen with cu_seqlens, fla in batch form on the same data; fla gets the gate precomputed as in
docs/anchors.md, ours computes it in the kernel). Decode: N=1..1024 sequences, one token each, state in place.
Agreement (relative L2 error of outputs and final states, ours vs fla) is checked on every shape; the copy
bandwidth is measured in the same run. Prints a table and writes kda_kernels.json to --out (default $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

# fla dispatches chunk_kda to FlashKDA when it is installed; "fla" here means fla's own Triton kernels.
os.environ.setdefault("FLA_FLASH_KDA", "0")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernel_profile import format_profile, kernel_profile  # noqa: E402
from bench.measure import copy_bytes_per_s, gpu_ms, graph_us  # noqa: E402
from shard_svc.ops.kda import eager  # noqa: E402
from shard_svc.ops.triton.kda_chunk import CHUNK, CHUNKS, kda_prefill, kda_prefill_stages  # noqa: E402
from shard_svc.ops.triton.kda_decode import kda_decode  # noqa: E402

H, K, V = 32, 128, 128
DEV = torch.device("cuda")
# Layouts of the intra-chunk kernel timed by --sweep at B=1, T=16k (kda_prefill_stages' intra_* arguments).
INTRA_SWEEP = [dict(intra_warps=warps) for warps in (1, 2, 4)]
PREFILL = [(1, 4096), (1, 16384), (1, 65536), (8, 4096)]
K3_LENS = [[8192], [16384], [65536], [1024] * 8, [4096] * 8]  # FlashKDA's anchor shapes
K3_LOWER_BOUND = -5.0
DECODE = [1, 16, 64, 256, 1024]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float("inf") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()


def inputs(n_tok: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    q, k, v, f = (torch.randn(n_tok, H, d, generator=g, **bf) for d in (K, K, V, K))
    bl = torch.randn(n_tok, H, generator=g, **bf)
    a_log = torch.log(torch.empty(H, device=DEV).uniform_(1, 16, generator=g))
    dt_bias = torch.randn(H * K, device=DEV, generator=g) * 0.1
    return q, k, v, f, bl, a_log, dt_bias


def prefill_rows(fla, sweep: bool, quick: bool, chunks: tuple[int, ...], profile: bool = False):
    from fla.ops.kda.gate import naive_kda_gate

    rows = []
    for b, t in PREFILL[:2] if quick else PREFILL:
        n_tok = b * t
        q, k, v, f, bl, a_log, dt_bias = inputs(n_tok, seed=t + b)
        cu = torch.arange(b + 1, device=DEV, dtype=torch.int64) * t
        slots = torch.arange(b, device=DEV)
        pool0 = torch.randn(b, H, K, V, device=DEV) * 0.1
        args = (q, k, v, f, bl, a_log, dt_bias, None)
        row = {"B": b, "T": t}
        # agreement first, from the same initial state
        pool = pool0.clone()
        o = kda_prefill(*args, pool, slots, cu)
        g4 = naive_kda_gate(f.view(b, t, H, K), a_log, dt_bias)
        beta4 = torch.sigmoid(bl.float()).view(b, t, H).to(torch.bfloat16)
        q4, k4, v4 = q.view(b, t, H, K), k.view(b, t, H, K), v.view(b, t, H, V)
        with torch.inference_mode():
            o_fla, s_fla = fla.chunk_kda(q4, k4, v4, g4, beta4, initial_state=pool0.clone(), output_final_state=True,
                                         use_qk_l2norm_in_kernel=True)
        row["err_o_vs_fla"], row["err_state_vs_fla"] = rel(o, o_fla.view(n_tok, H, V)), rel(pool, s_fla)
        if n_tok <= 4096:
            pool_e = pool0.clone()
            o_e = eager.kda_prefill(*args, pool_e, slots, cu)
            row["err_o_vs_eager"], row["err_state_vs_eager"] = rel(o, o_e), rel(pool, pool_e)
        # timings
        pool = pool0.clone()
        row["ours_ms"] = gpu_ms(lambda: kda_prefill(*args, pool, slots, cu))
        _, intra, state = kda_prefill_stages(*args, pool, slots, cu)
        row["ours_intra_ms"], row["ours_state_ms"] = gpu_ms(intra), gpu_ms(state)
        if b == 1:  # a lone sequence: walk of one token range beside the next one's intra kernel
            row["ours_pieces_ms"] = {p: gpu_ms(lambda p=p: kda_prefill(*args, pool, slots, cu, pieces=p))
                                     for p in (1, 2, 4, 8)}
        # the intra kernel as it was before the one-reference block products (levels everywhere)
        row["ours_intra_levels_only_ms"] = gpu_ms(kda_prefill_stages(*args, pool, slots, cu, block_ref=False)[1])
        if sweep:  # chunk sizes, every shape: FlashKDA's 16 rows trade intra-chunk work for state steps
            row["sweep_chunk"] = {}
            for chunk in [c for c in chunks if c != CHUNK]:
                p_c = pool0.clone()
                o_c = kda_prefill(*args, p_c, slots, cu, chunk=chunk)
                _, it, st = kda_prefill_stages(*args, pool, slots, cu, chunk=chunk)
                row["sweep_chunk"][chunk] = {"err_o_vs_fla": rel(o_c, o_fla.view(n_tok, H, V)),
                                             "err_state_vs_fla": rel(p_c, s_fla), "intra_ms": gpu_ms(it),
                                             "state_ms": gpu_ms(st),
                                             "ms": gpu_ms(lambda c=chunk: kda_prefill(*args, pool, slots, cu,
                                                                                      chunk=c))}
                if b == 1:
                    row["sweep_chunk"][chunk]["pieces4_ms"] = gpu_ms(lambda c=chunk: kda_prefill(
                        *args, pool, slots, cu, chunk=c, pieces=4))
                del o_c, p_c
            print("chunk sweep", b, t, json.dumps(row["sweep_chunk"]), flush=True)
        if sweep and (b, t) == (1, 16384):  # configurations are timed on one representative shape
            row["sweep_intra"] = []
            for cfg in INTRA_SWEEP:
                entry = {"config": cfg}
                try:
                    p_cfg = pool0.clone()
                    entry["err_o_vs_fla"] = rel(kda_prefill(*args, p_cfg, slots, cu, **cfg), o_fla.view(n_tok, H, V))
                    entry["err_state_vs_fla"] = rel(p_cfg, s_fla)
                    _, it, _ = kda_prefill_stages(*args, pool, slots, cu, **cfg)
                    entry["intra_ms"] = gpu_ms(it)
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                    entry["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                print("intra config", json.dumps(entry), flush=True)
                row["sweep_intra"].append(entry)
            row["sweep_state_ms"] = {}
            for bv, stages in ((64, 2), (16, 3)):
                _, _, st = kda_prefill_stages(*args, pool, slots, cu, block_v=bv, state_stages=stages)
                row["sweep_state_ms"][f"bv{bv}_s{stages}"] = gpu_ms(st)
        with torch.inference_mode():
            row["fla_ms"] = gpu_ms(lambda: fla.chunk_kda(q4, k4, v4, g4, beta4, use_qk_l2norm_in_kernel=True,
                                                        output_final_state=True))
            if profile and (b, t) == (1, 16384):  # where fla's time goes, kernel by kernel, beside ours
                row["fla_profile"] = kernel_profile(lambda: fla.chunk_kda(
                    q4, k4, v4, g4, beta4, use_qk_l2norm_in_kernel=True, output_final_state=True), top=12)
        if profile and (b, t) == (1, 16384):
            row["ours_profile"] = kernel_profile(lambda: kda_prefill(*args, pool, slots, cu), top=12)
            print("\n".join(format_profile("fla chunk_kda B=1 T=16k", row["fla_profile"])
                            + format_profile("ours B=1 T=16k", row["ours_profile"])), flush=True)
        row["speedup"] = row["fla_ms"] / row["ours_ms"]
        row["ours_Mtok_s"] = n_tok / (row["ours_ms"] * 1e-3) / 1e6
        row["fla_Mtok_s"] = n_tok / (row["fla_ms"] * 1e-3) / 1e6
        print("prefill", json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, f, pool, o, o_fla, s_fla
        torch.cuda.empty_cache()
    return rows


def graph_ms(call) -> float | str:
    """Milliseconds per replay of `call` captured in a CUDA graph, or why it could not be captured."""
    try:
        return graph_us([call]) / 1e3
    except Exception as e:  # noqa: BLE001 - a call that cannot be captured is reported, the run goes on
        return f"{type(e).__name__}: {str(e)[:160]}"


def k3_rows(fla, chunks: tuple[int, ...], sweep: bool) -> list[dict]:
    """K3's gate on single and packed sequences: ours (each chunk size) vs fla chunk_kda vs FlashKDA, zero state;
    `sweep` adds the 16-row layouts and pipelined ranges."""
    try:
        import flash_kda
    except ImportError as e:
        flash_kda, missing = None, f"flash_kda not importable: {e}"
    rows = []
    for lens in K3_LENS:
        n_tok, n = sum(lens), len(lens)
        q, k, v, f, bl, a_log, dt_bias = inputs(n_tok, seed=n_tok + n)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEV, dtype=torch.int64)
        slots = torch.arange(n, device=DEV)
        pool = torch.zeros(n, H, K, V, device=DEV)
        args = (q, k, v, f, bl, a_log, dt_bias, K3_LOWER_BOUND)
        row = {"lens": f"{n}x{lens[0]}", "T": n_tok}
        varlen = dict(cu_seqlens=cu) if n > 1 else {}
        with torch.inference_mode():
            fla_call = lambda: fla.chunk_kda(  # noqa: E731
                q[None], k[None], v[None], f[None], bl[None], initial_state=torch.zeros(n, H, V, K, device=DEV),
                output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=K3_LOWER_BOUND, A_log=a_log,
                dt_bias=dt_bias, state_v_first=True, **varlen)
            o_fla, s_fla = fla_call()
            o_fla = o_fla[0]
            if flash_kda is not None:
                out = torch.zeros(1, n_tok, H, V, device=DEV, dtype=torch.bfloat16)
                s0 = torch.zeros(n, H, V, K, device=DEV)
                s1 = torch.zeros_like(s0)
                fk_call = lambda: flash_kda.fwd(  # noqa: E731
                    q[None], k[None], v[None], f[None], bl[None], K**-0.5, out, A_log=a_log,
                    dt_bias=dt_bias.view(H, K), lower_bound=K3_LOWER_BOUND, initial_state=s0, final_state=s1,
                    **varlen)
                fk_call()
                o_ref, s_ref, ref = out[0].clone(), s1.transpose(-1, -2).clone(), "flashkda"
                row["err_fla_vs_flashkda"] = rel(o_fla, o_ref)
                row["flashkda_ms"] = gpu_ms(fk_call)
            else:
                o_ref, s_ref, ref = o_fla, s_fla.transpose(-1, -2), "fla"
                row["flashkda_error"] = missing
            row["fla_ms"] = gpu_ms(fla_call)
        for chunk in chunks:
            pool.zero_()
            o = kda_prefill(*args, pool, slots, cu, chunk=chunk)
            _, intra, state = kda_prefill_stages(*args, pool, slots, cu, chunk=chunk)
            row[f"ours_c{chunk}"] = {f"err_o_vs_{ref}": rel(o, o_ref), f"err_state_vs_{ref}": rel(pool, s_ref),
                                     "ms": gpu_ms(lambda c=chunk: kda_prefill(*args, pool, slots, cu, chunk=c)),
                                     "intra_ms": gpu_ms(intra), "state_ms": gpu_ms(state),
                                     "intra_levels_only_ms": gpu_ms(kda_prefill_stages(*args, pool, slots, cu,
                                                                                       chunk=chunk,
                                                                                       block_ref=False)[1])}
            if len(lens) == 1:  # a lone sequence runs in pipelined token ranges by default: without them
                row[f"ours_c{chunk}"]["pieces1_ms"] = gpu_ms(lambda c=chunk: kda_prefill(*args, pool, slots, cu,
                                                                                         chunk=c, pieces=1))
            if chunk == 16 and sweep:  # the 16-row walk: 4x the steps, so its tile matters more
                row["ours_c16"]["state_sweep_ms"] = {
                    f"bv{bv}_w{w}": gpu_ms(kda_prefill_stages(*args, pool, slots, cu, chunk=16, block_v=bv,
                                                              state_warps=w)[2])
                    for bv, w in ((16, 1), (16, 2), (32, 1), (32, 2), (32, 4), (64, 4), (128, 8))}
                row["ours_c16"]["intra_sweep_ms"] = {
                    f"slice{sl}_w{w}_s{st}": gpu_ms(kda_prefill_stages(*args, pool, slots, cu, chunk=16,
                                                                       intra_slice=sl, intra_warps=w,
                                                                       intra_stages=st)[1])
                    for sl, w, st in ((16, 1, 3), (32, 1, 3), (32, 1, 1), (32, 1, 2), (64, 1, 3), (64, 2, 1),
                                      (32, 2, 3))}
                row["ours_c16"]["pieces_ms"] = {
                    p: gpu_ms(lambda p=p: kda_prefill(*args, pool, slots, cu, chunk=16, pieces=p))
                    for p in (1, 2, 4, 8, 16)}
                if len(lens) > 1:  # packed: many walk programs, so the one-warp 32-wide walk beside the ranges too
                    row["ours_c16"]["pieces_bv32_w1_ms"] = {
                        p: gpu_ms(lambda p=p: kda_prefill(*args, pool, slots, cu, chunk=16, pieces=p, block_v=32,
                                                          state_warps=1))
                        for p in (1, 2, 4, 8)}
                # the side stream must not change a bit: pipelined against one piece, same initial state
                pool.zero_()
                o_pp = kda_prefill(*args, pool, slots, cu, chunk=16, pieces=8)
                s_pp = pool.clone()
                pool.zero_()
                o_1 = kda_prefill(*args, pool, slots, cu, chunk=16, pieces=1)
                row["ours_c16"]["pieces8_bit_equal"] = torch.equal(o_pp, o_1) and torch.equal(s_pp, pool)
        # The same calls replayed from a CUDA graph: GPU time alone, where do_bench's figure also holds the host's
        # launches whenever the host is the slower side (one H100 host: 1 x 8k 1.23 ms whole, 0.73 in its stages).
        pool.zero_()
        row["ours_graph_ms"] = graph_ms(lambda: kda_prefill(*args, pool, slots, cu))
        if flash_kda is not None:
            row["flashkda_graph_ms"] = graph_ms(fk_call)
        best = min(chunks, key=lambda c: row[f"ours_c{c}"]["ms"])
        row["ours_best_chunk"], row["ours_ms"] = best, row[f"ours_c{best}"]["ms"]
        row["vs_fla"] = row["fla_ms"] / row["ours_ms"]
        if "flashkda_ms" in row:
            row["vs_flashkda"] = row["flashkda_ms"] / row["ours_ms"]
        print("k3", json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v, f, pool, o_fla, s_fla, o_ref, s_ref
        torch.cuda.empty_cache()
    return rows


def decode_rows(fla, sweep: bool, copy_tbps: float):
    from fla.ops.kda.gate import naive_kda_gate

    rows = []
    for n in DECODE:
        q, k, v, f, bl, a_log, dt_bias = inputs(n, seed=n)
        slots = torch.randperm(n, device=DEV)
        cu = torch.arange(n + 1, device=DEV, dtype=torch.int64)
        pool0 = torch.randn(n, H, K, V, device=DEV) * 0.1
        args = (q, k, v, f, bl, a_log, dt_bias, None)
        g = naive_kda_gate(f, a_log, dt_bias).view(1, n, H, K)
        beta = torch.sigmoid(bl.float()).to(torch.bfloat16).view(1, n, H)
        q1, k1, v1 = q.view(1, n, H, K), k.view(1, n, H, K), v.view(1, n, H, V)
        row = {"N": n}
        pool = pool0.clone()
        o = kda_decode(*args, pool, slots, cu)
        with torch.inference_mode():
            o_fla, s_fla = fla.fused_recurrent_kda(q1, k1, v1, g, beta, initial_state=pool0[slots].clone(),
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                   cu_seqlens=cu)
        row["err_o_vs_fla"], row["err_state_vs_fla"] = rel(o, o_fla.view(n, H, V)), rel(pool[slots], s_fla)
        pool_e = pool0.clone()
        o_e = eager.kda_decode(*args, pool_e, slots, cu)
        row["err_o_vs_eager"], row["err_state_vs_eager"] = rel(o, o_e), rel(pool, pool_e)
        state_bytes = n * H * K * V * 4 * 2
        row["ours_us"] = gpu_ms(lambda: kda_decode(*args, pool, slots, cu)) * 1e3
        # CUDA-graph replay: device time without the Python launch path (how a serving engine runs decode),
        # over distinct pools (>= 3x L2 in total) so the state comes from HBM.
        reps = max(8, min(100, -(-3 * (64 << 20) // (state_bytes // 2))))
        pools = [pool0.clone() for _ in range(reps)]
        fla_states = [pool0[slots].clone() for _ in range(reps)]

        def ours_calls(**cfg):
            return [lambda p=p: kda_decode(*args, p, slots, cu, **cfg) for p in pools]

        row["graph_reps"] = reps
        row["ours_graph_us"] = graph_us(ours_calls())
        if sweep:
            row["sweep_graph_us"] = {}
            for bv in (16, 32, 64):
                for warps in (1, 2, 4, 8):
                    if K * bv // (32 * warps) > 256:  # state tile beyond the register file
                        continue
                    cfg = dict(block_v=bv, num_warps=warps)
                    row["sweep_graph_us"][f"bv{bv}_w{warps}"] = graph_us(ours_calls(**cfg))
        s_in = pool0[slots].clone()

        def fla_step(state=s_in):
            return fla.fused_recurrent_kda(q1, k1, v1, g, beta, initial_state=state, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu)

        with torch.inference_mode():
            row["fla_us"] = gpu_ms(fla_step) * 1e3
            try:
                row["fla_graph_us"] = graph_us([lambda st=st: fla_step(st) for st in fla_states])
            except Exception as e:  # noqa: BLE001 - fla's wrapper may not be capturable; say so
                row["fla_graph_us"] = None
                row["fla_graph_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        row["speedup"] = row["fla_us"] / row["ours_us"]
        row["ours_TBps"] = state_bytes / (row["ours_us"] * 1e-6) / 1e12
        row["fla_TBps"] = state_bytes / (row["fla_us"] * 1e-6) / 1e12
        row["ours_frac_copy"] = row["ours_TBps"] / copy_tbps
        row["ours_graph_TBps"] = state_bytes / (row["ours_graph_us"] * 1e-6) / 1e12
        row["ours_graph_frac_copy"] = row["ours_graph_TBps"] / copy_tbps
        print("decode", json.dumps(row), flush=True)
        rows.append(row)
        del pools, fla_states
        torch.cuda.empty_cache()
    return rows


def table(res) -> str:
    lines = [f"{res['gpu']}  torch {res['torch']}  triton {res['triton']}  fla {res['fla']}  "
             f"copy {res['copy_TBps']:.2f} TB/s", "",
             "prefill (H=32 K=V=128 bf16)   ours ms  (intra+state)      fla ms   speedup  ours Mtok/s  "
             "err o/state vs fla"]
    for r in res["prefill"]:
        lines.append(f"  B={r['B']} T={r['T']:<6}              {r['ours_ms']:7.3f}  ({r['ours_intra_ms']:.3f}+"
                     f"{r['ours_state_ms']:.3f})  {r['fla_ms']:8.3f}  {r['speedup']:6.2f}x  {r['ours_Mtok_s']:9.2f}  "
                     f"{r['err_o_vs_fla']:.1e}/{r['err_state_vs_fla']:.1e}")
        for chunk, c in r.get("sweep_chunk", {}).items():
            lines.append(f"    chunk {chunk:<3}                 {c['ms']:7.3f}  ({c['intra_ms']:.3f}+"
                         f"{c['state_ms']:.3f})  {r['fla_ms']:8.3f}  {r['fla_ms'] / c['ms']:6.2f}x  {'':9}  "
                         f"{c['err_o_vs_fla']:.1e}/{c['err_state_vs_fla']:.1e}")
    if res.get("k3"):
        lines += ["", "K3 gate (lower bound -5), zero state   ours ms (chunk)   fla ms   FlashKDA ms   vs fla  "
                  "vs FlashKDA   graph: ours  FlashKDA"]
        for r in res["k3"]:
            fk = f"{r['flashkda_ms']:11.3f}" if "flashkda_ms" in r else f"{'n/a':>11}"
            vf = f"{r['vs_flashkda']:9.2f}x" if "vs_flashkda" in r else f"{'n/a':>10}"
            graphs = [r.get("ours_graph_ms"), r.get("flashkda_graph_ms")]
            gr = "  ".join(f"{g:7.3f}" if isinstance(g, float) else f"{'n/a':>7}" for g in graphs)
            lines.append(f"  {r['lens']:<10}                        {r['ours_ms']:7.3f} ({r['ours_best_chunk']:>2})  "
                         f"{r['fla_ms']:7.3f}  {fk}  {r['vs_fla']:6.2f}x  {vf}   {gr}")
    lines += ["", "decode (one token/seq)  do_bench: ours us  fla us  speedup | graph: ours us  fla us  "
              "ours TB/s  ours/copy | err o/state vs fla"]
    for r in res["decode"]:
        fg = f"{r['fla_graph_us']:7.1f}" if r.get("fla_graph_us") else "    n/a"
        lines.append(f"  N={r['N']:<5}                   {r['ours_us']:7.1f} {r['fla_us']:7.1f}  {r['speedup']:6.2f}x |"
                     f"        {r['ours_graph_us']:7.1f} {fg}  {r['ours_graph_TBps']:8.2f}  "
                     f"{r['ours_graph_frac_copy']:8.1%} | {r['err_o_vs_fla']:.1e}/{r['err_state_vs_fla']:.1e}")
    return "\n".join(lines)


def plots(res: dict, out: str) -> list[str]:
    """kda_prefill.png: Mtok/s vs sequence length, ours vs fla. kda_decode.png: achieved state bandwidth vs batch,
    ours vs fla, with the copy-bandwidth roofline measured in the same run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    single = [r for r in res["prefill"] if r["B"] == 1]
    if single:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["T"] for r in single], [r["ours_Mtok_s"] for r in single], "o-", label="kimiserve kda_prefill")
        ax.plot([r["T"] for r in single], [r["fla_Mtok_s"] for r in single], "s--", label="fla chunk_kda")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (B=1, H=32, K=V=128, bf16)")
        ax.set_ylabel("M tokens/s")
        ax.legend()
        fig.savefig(os.path.join(out, "kda_prefill.png"), dpi=120, bbox_inches="tight")
        files.append("kda_prefill.png")
    if res["decode"]:
        dec = res["decode"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ns = [r["N"] for r in dec]
        ax.plot(ns, [r["ours_graph_TBps"] for r in dec], "o-", label="kimiserve kda_decode (CUDA graph)")
        ax.plot(ns, [r["ours_TBps"] for r in dec], "o:", label="kimiserve kda_decode (launch incl.)")
        ax.plot(ns, [r["fla_TBps"] for r in dec], "s--", label="fla fused_recurrent_kda (launch incl.)")
        ax.axhline(res["copy_TBps"], color="k", ls="--", label="copy bandwidth (roofline)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences (one token each)")
        ax.set_ylabel("state TB/s (read + write)")
        ax.legend()
        fig.savefig(os.path.join(out, "kda_decode.png"), dpi=120, bbox_inches="tight")
        files.append("kda_decode.png")
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--sweep", action="store_true", help="also time kernel configurations and report the best")
    ap.add_argument("--quick", action="store_true", help="only the two smallest prefill shapes")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of fla and ours at B=1 T=16k")
    ap.add_argument("--k3", action="store_true", help="K3's gate against fla and FlashKDA on FlashKDA's shapes")
    ap.add_argument("--chunks", default="", help="comma list of chunk sizes to time (default: all with --sweep)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: prefill,decode")
    a = ap.parse_args()
    import fla
    import fla.ops.kda as fla_kda

    os.makedirs(a.out, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "fla": getattr(fla, "__version__", "?"), "H": H, "K": K, "V": V}
    res["copy_TBps"] = copy_bytes_per_s(DEV, lambda fn: gpu_ms(fn, warmup=50, rep=200)) / 1e12
    path = os.path.join(a.out, "kda_kernels.json")
    skip = set(a.skip.split(","))
    res["decode"] = [] if "decode" in skip else decode_rows(fla_kda, a.sweep, res["copy_TBps"])
    json.dump(res, open(path, "w"), indent=1)
    chunks = tuple(int(c) for c in a.chunks.split(",")) if a.chunks else (CHUNKS if a.sweep else (CHUNK,))
    res["k3"] = k3_rows(fla_kda, chunks, a.sweep) if a.k3 else []
    json.dump(res, open(path, "w"), indent=1)
    res["prefill"] = [] if "prefill" in skip else prefill_rows(fla_kda, a.sweep, a.quick, chunks, a.profile)
    res["plots"] = plots(res, a.out)
    json.dump(res, open(path, "w"), indent=1)
    print(table(res))


if __name__ == "__main__":
    main()
