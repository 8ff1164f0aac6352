"""Token streams and batches: prose windows of the corpus and packed rows of dialogues, each with a loss mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimiserve.tokenizer_files.loading import LoadedTokenizer
from training.dialogues import Dialogue


def token_stream(paragraphs: list[str], tokenizer: LoadedTokenizer) -> torch.Tensor:
    """The paragraphs' ids back to back, a blank line's ids between them (int64, CPU)."""
    sep = tokenizer.encode("\n\n")
    ids: list[int] = []
    for enc in tokenizer.hf.encode_batch(paragraphs, add_special_tokens=False):
        ids += enc.ids + sep
    return torch.tensor(ids, dtype=torch.int64)


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L]; -100 where no loss is taken


class ProseSampler:
    """Random windows of `seq_len + 1` tokens of a stream; next-token targets everywhere."""

    def __init__(self, stream: torch.Tensor, seq_len: int, device: torch.device, seed: int):
        if len(stream) <= seq_len + 1:
            raise ValueError(f"a stream of {len(stream)} tokens has no window of {seq_len + 1}")
        self.stream, self.seq_len = stream.to(device), seq_len
        self.gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(seq_len + 1, device=device)

    def sample(self, rows: int) -> Batch:
        starts = torch.randint(0, len(self.stream) - self.seq_len - 1, (rows, 1), generator=self.gen)
        window = self.stream[starts.to(self.stream.device) + self.offsets]
        return Batch(window[:, :-1], window[:, 1:])


def pack_dialogues(dialogues: list[Dialogue], seq_len: int, pad_id: int) -> Batch:
    """Dialogues packed whole into rows of `seq_len` (a row starts with a dialogue's first token), right-padded;
    targets only where the next token is the assistant's."""
    rows_in: list[list[int]] = []
    rows_tg: list[list[int]] = []
    cur_in: list[int] = []
    cur_tg: list[int] = []
    for d in dialogues:
        if len(d.ids) > seq_len + 1:
            continue  # longer than a row: never cut a reply
        if len(cur_in) + len(d.ids) > seq_len + 1:
            rows_in.append(cur_in)
            rows_tg.append(cur_tg)
            cur_in, cur_tg = [], []
        # Within the row the input is ids[:-1] and the target ids[1:]; dialogues are joined, so each dialogue's last
        # token is the input that predicts the next dialogue's first token (not learned: its mask is 0).
        cur_in += d.ids
        cur_tg += [t if m else -100 for t, m in zip(d.ids, d.mask)]
    if cur_in:
        rows_in.append(cur_in)
        rows_tg.append(cur_tg)
    if not rows_in:
        raise ValueError(f"none of {len(dialogues)} dialogues fits a row of {seq_len} tokens (shortest: "
                         f"{min((len(d.ids) for d in dialogues), default=0)} tokens)")
    inputs = torch.full((len(rows_in), seq_len), pad_id, dtype=torch.int64)
    targets = torch.full((len(rows_in), seq_len), -100, dtype=torch.int64)
    for r, (ids, tg) in enumerate(zip(rows_in, rows_tg)):
        n = min(len(ids), seq_len + 1)
        inputs[r, :n - 1] = torch.tensor(ids[:n - 1])
        targets[r, :n - 1] = torch.tensor(tg[1:n])
    return Batch(inputs, targets)


class DialogueSampler:
    """Random packed dialogue rows."""

    def __init__(self, packed: Batch, device: torch.device, seed: int):
        self.packed = Batch(packed.inputs.to(device), packed.targets.to(device))
        self.gen = torch.Generator().manual_seed(seed)

    def sample(self, rows: int) -> Batch:
        pick = torch.randint(0, len(self.packed.inputs), (rows,), generator=self.gen).to(self.packed.inputs.device)
        return Batch(self.packed.inputs[pick], self.packed.targets[pick])
