"""One sequence's MLA prefill through a fused attention library, in a bounded workspace.

The pass's n new queries of a sequence with ctx cached tokens see every cached key (no mask) and the n new keys
causally. Split that way, the work is calls a fused attention kernel takes at its full rate (cuDNN: 78% of the H200's
matrix rate at the 48B shape, where a lower-right causal mask over all keys runs at half that):

    the context, `workspace` keys at a time:  expand the latents, attend unmasked      -> (o_s, lse_s)
    the new tokens:                             expand the latents, attend causal (square) -> (o_s, lse_s)

and the parts merge by their natural log-sum-exp (`merge`):

    lse' = log(e^lse + e^lse_s),    o' = e^(lse - lse') o + e^(lse_s - lse') o_s

Every part holds at least one key per query, so every lse is finite. The workspace bounds what is expanded at once
(keys [N, nh, nope + rope], values [N, nh, v]) whatever the context.

`Attend` is the seam, token-major as the cache and the queries are: q [M, nh, nope + rope], k [N, nh, nope + rope],
v [N, nh, v] -> (o [M, nh, v], lse [M, nh]), causal meaning the square top-left mask. `math_attend` is the
reference; `shard_svc/ops/mla/cudnn.py` the fast one (which takes these as the usual [1, nh, L, d] views).
"""

from __future__ import annotations

from typing import Callable

import torch

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


def math_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in fp32 with its log-sum-exp: the `Attend` the library ones are tested against."""
    s = torch.einsum("mhd,nhd->hmn", q.float(), k.float()) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)  # [nh, M]
    return torch.einsum("hmn,nhd->mhd", torch.exp(s - lse[..., None]), v.float()), lse.t()


def gather_latents(kv_cache: torch.Tensor, table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Cache rows [hi - lo, kv_lora + rope] of positions lo .. hi-1 of the sequence whose block table is `table`."""
    bs = kv_cache.shape[1]
    pos = torch.arange(lo, hi, device=kv_cache.device)
    return kv_cache.reshape(-1, kv_cache.shape[2])[table[pos // bs].long() * bs + pos % bs]


def expand(latent: torch.Tensor, w_kv_b: torch.Tensor, nh: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head keys [N, nh, nope + rope] (k_pe shared by the heads) and values [N, nh, v], contiguous."""
    kv_lora = w_kv_b.shape[1]
    n, rope = latent.shape[0], latent.shape[1] - kv_lora
    kv = (latent[:, :kv_lora] @ w_kv_b.t()).view(n, nh, -1)  # [N, nh, nope + v]
    k = torch.empty(n, nh, nope + rope, dtype=kv.dtype, device=kv.device)  # written in place: no second copy
    k[..., :nope] = kv[..., :nope]
    k[..., nope:] = latent[:, None, kv_lora:]
    return k, kv[..., nope:].contiguous()


def merge(o: torch.Tensor, lse: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor) -> None:
    """Folds a part (o_part [M, nh, v], lse_part [M, nh]) into the running fp32 o and lse, in place."""
    total = torch.logaddexp(lse, lse_part)
    o.mul_(torch.exp(lse - total)[..., None]).add_(o_part.float() * torch.exp(lse_part - total)[..., None])
    lse.copy_(total)


def prefill_sequence(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
                     table: torch.Tensor, ctx: int, scale: float, attend: Attend, workspace: int) -> torch.Tensor:
    """o [n, nh, v] in q's dtype for one sequence's n new queries (q_nope [n, nh, nope], q_pe [n, nh, rope]) at
    positions ctx .. ctx+n-1, their latents already in the cache; at most max(workspace, n) keys expanded at once."""
    n, nh, nope = q_nope.shape
    q = torch.cat([q_nope, q_pe], -1)  # [n, nh, nope + rope]
    o, lse = None, None
    for lo in [*range(0, ctx, workspace), ctx]:
        hi = min(lo + workspace, ctx) if lo < ctx else ctx + n  # the last part: the new tokens themselves
        k, v = expand(gather_latents(kv_cache, table, lo, hi), w_kv_b, nh, nope)
        o_part, lse_part = attend(q, k, v, lo == ctx, scale)
        del k, v
        if o is None:
            o, lse = o_part.float(), lse_part.float()
        else:
            merge(o, lse, o_part, lse_part)
    return o.to(q_nope.dtype)
