"""Prompt scoring (SamplingParams.prompt_logprobs): each prompt token's log-probability given the tokens before it,
gathered chunk by chunk during the prefill so that only one chunk's [rows, vocab] log-softmax ever exists (a long
prompt's whole [prompt, vocab] would not fit)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Prompt positions whose logits exist at once while scoring, whatever the prefill chunk: [SCORE_ROWS, vocab] fp32 and
# its log-softmax, 320 MiB each at a 163,840-token vocabulary.
SCORE_ROWS = 512

@dataclass
class PromptScores:
    """What a sequence's prefill chunks gathered so far; entry i scores prompt position i + 1."""

    logprobs: list[torch.Tensor] = field(default_factory=list)  # float32 [rows] per chunk, on the host
    top_ids: list[torch.Tensor] = field(default_factory=list)  # int64 [rows, k] per chunk (k = 0: empty)
    top_logprobs: list[torch.Tensor] = field(default_factory=list)  # float32 [rows, k] per chunk
    ranks: list[torch.Tensor] = field(default_factory=list)  # int64 [rows] per chunk: 1 + tokens likelier

    def add_chunk(self, rows: torch.Tensor, prompt: list[int], start: int, k: int) -> None:
        """rows: the fp32 logits [n, vocab] of prompt positions start .. start + n - 1 of `prompt`. Row j predicts
        the token at start + j + 1; a row past the prompt's last token (the one the first output is drawn from)
        scores nothing."""
        n = min(rows.shape[0], len(prompt) - 1 - start)
        if n <= 0:
            return
        lp = torch.log_softmax(rows[:n].float(), dim=-1)
        targets = torch.tensor(prompt[start + 1:start + 1 + n], dtype=torch.int64, device=rows.device)
        chosen = lp.gather(1, targets[:, None])
        self.logprobs.append(chosen.squeeze(1).cpu())
        self.ranks.append(((lp > chosen).sum(dim=-1) + 1).cpu())
        values, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        self.top_ids.append(ids.cpu())
        self.top_logprobs.append(values.cpu())

    def entries(self) -> tuple[list[float], list[list[tuple[int, float]]], list[int]]:
        """(logprob per scored position, (id, logprob) alternatives per position, most likely first, the prompt
        token's rank per position)."""
        if not self.logprobs:
            return [], [], []
        ids, values = torch.cat(self.top_ids).tolist(), torch.cat(self.top_logprobs).tolist()
        return (torch.cat(self.logprobs).tolist(), [list(zip(i, v)) for i, v in zip(ids, values)],
                torch.cat(self.ranks).tolist())
