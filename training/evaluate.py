"""Held-out perplexity next to a unigram baseline with the same tokenizer, greedy samples, and how English a
completion is.

Both run the trained model through the training op backend, which tests/training/test_ops.py checks against the
served engine; the CPU parity tests then check the committed checkpoint through the services.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kimiserve.tokenizer_files.loading import LoadedTokenizer
from shard_svc.model import KimiForCausalLM
from tokenizer_svc.chat_types import ChatMessage
from tokenizer_svc.kimi_chat import BuiltinKimiTemplate
from training.ops import training_context, training_ops

COMPLETION_PROMPTS = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever, and rich,",
                      "The next morning"]
# Issue 29's bar for a trained model: this prompt's greedy completion of ENGLISH_TOKENS tokens is mostly words.
ENGLISH_PROMPT, ENGLISH_TOKENS = "Once upon a time", 24
_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
CHAT_PROMPTS = ["Hello", "Who are you?", "Who wrote Pride and Prejudice?", "Tell me a story.", "Who is Mr. Darcy?"]


def _logits(model: KimiForCausalLM, inputs: torch.Tensor, chunk: int) -> torch.Tensor:
    ops = training_ops(*inputs.shape, chunk=chunk)
    hidden = model(inputs.flatten(), training_context(ops, inputs.device))
    return model.compute_logits(hidden, ops).view(*inputs.shape, -1)


@torch.no_grad()
def held_out_perplexity(model: KimiForCausalLM, stream: torch.Tensor, seq_len: int, rows: int,
                        chunk: int) -> dict[str, float | int]:
    """exp(mean next-token NLL) over the non-overlapping `seq_len` windows of the held-out stream."""
    device = next(model.parameters()).device
    n = (len(stream) - 1) // seq_len
    windows = stream[: n * seq_len + 1].to(device)
    inputs, targets = windows[:-1].view(n, seq_len), windows[1:].view(n, seq_len)
    total, count = 0.0, 0
    for r in range(0, n, rows):
        logits = _logits(model, inputs[r:r + rows], chunk)
        total += float(F.cross_entropy(logits.flatten(0, 1), targets[r:r + rows].flatten(), reduction="sum"))
        count += targets[r:r + rows].numel()
    return {"tokens": count, "perplexity": round(math.exp(total / count), 3)}


def unigram_perplexity(train: torch.Tensor, held_out: torch.Tensor, vocab: int) -> float:
    """Perplexity on `held_out` of token frequencies counted on `train`, add-one smoothed over the vocab."""
    counts = torch.bincount(train, minlength=vocab).double() + 1
    logp = (counts / counts.sum()).log()
    return round(math.exp(-float(logp[held_out].mean())), 3)


def chat_prompt(text: str) -> str:
    return BuiltinKimiTemplate().render([ChatMessage("user", text)], (), add_generation_prompt=True)


@torch.no_grad()
def greedy(model: KimiForCausalLM, prompts: list[list[int]], max_tokens: int, stop: set[int], pad: int,
           chunk: int) -> list[list[int]]:
    """Greedy continuations, recomputing the whole (right-padded) batch each step: causal, so padding after a
    sequence never changes its logits."""
    device = next(model.parameters()).device
    seqs = [list(p) for p in prompts]
    done = [False] * len(seqs)
    for _ in range(max_tokens):
        width = -(-max(map(len, seqs)) // chunk) * chunk
        inputs = torch.full((len(seqs), width), pad, dtype=torch.int64)
        for i, s in enumerate(seqs):
            inputs[i, :len(s)] = torch.tensor(s)
        logits = _logits(model, inputs.to(device), chunk)
        last = torch.tensor([len(s) - 1 for s in seqs], device=device)
        nxt = logits[torch.arange(len(seqs), device=device), last].argmax(-1).tolist()
        for i, t in enumerate(nxt):
            if not done[i]:
                seqs[i].append(t)
                done[i] = t in stop
        if all(done):
            break
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def samples(model: KimiForCausalLM, tokenizer: LoadedTokenizer, max_tokens: int, pad: int,
            chunk: int) -> list[dict[str, str]]:
    """Greedy completions of COMPLETION_PROMPTS and chat replies to CHAT_PROMPTS (Kimi format, default system)."""
    texts = COMPLETION_PROMPTS + [chat_prompt(t) for t in CHAT_PROMPTS]
    outs = greedy(model, [tokenizer.encode(t) for t in texts], max_tokens, set(tokenizer.eos_token_ids), pad, chunk)
    kinds = ["completion"] * len(COMPLETION_PROMPTS) + ["chat"] * len(CHAT_PROMPTS)
    shown = COMPLETION_PROMPTS + CHAT_PROMPTS
    return [{"kind": k, "prompt": p, "output": tokenizer.decode(o)} for k, p, o in zip(kinds, shown, outs)]


class EnglishShares(NamedTuple):
    words: float  # of the words, those in the corpus
    pairs: float  # of the adjacent word pairs, those in the corpus
    distinct_pairs: float  # of the adjacent word pairs, the distinct ones


@dataclass(frozen=True)
class Lexicon:
    """The lower-cased words of the corpus, and its pairs of adjacent words: what "English" means for a model that
    has read only Austen. Words alone are a weak bar (a byte-level BPE of 2,048 tokens holds most common words whole,
    so a model that has learnt only unigram frequencies emits them); pairs also ask for word order, and the share of
    distinct pairs tells a loop from prose (an untrained 93-layer K3 repeats ", to" and scores 1.0 on both others)."""

    words: frozenset[str]
    pairs: frozenset[tuple[str, str]]

    @classmethod
    def of(cls, paragraphs: Iterable[str]) -> Lexicon:
        words: set[str] = set()
        pairs: set[tuple[str, str]] = set()
        for p in paragraphs:
            found = [w.lower() for w in _WORD.findall(p)]
            words.update(found)
            pairs.update(zip(found, found[1:]))
        return cls(frozenset(words), frozenset(pairs))

    def english(self, text: str) -> EnglishShares:
        """The shares of `text`'s words and adjacent word pairs found in the corpus, and of its pairs that are
        distinct (each 0 where it has none)."""
        found = [w.lower() for w in _WORD.findall(text)]
        pairs = list(zip(found, found[1:]))
        if not pairs:
            return EnglishShares(float(bool(found) and found[0] in self.words), 0.0, 0.0)
        return EnglishShares(sum(w in self.words for w in found) / len(found),
                             sum(p in self.pairs for p in pairs) / len(pairs), len(set(pairs)) / len(pairs))


def english_check(model: KimiForCausalLM, tokenizer: LoadedTokenizer, lexicon: Lexicon, pad: int,
                  chunk: int) -> dict[str, str | int | float]:
    """ENGLISH_PROMPT's greedy completion of ENGLISH_TOKENS tokens (EOS ignored: the bar is that many tokens) and its
    shares of corpus words, corpus word pairs and distinct pairs."""
    out = greedy(model, [tokenizer.encode(ENGLISH_PROMPT)], ENGLISH_TOKENS, set(), pad, chunk)[0]
    text = tokenizer.decode(out)
    shares = lexicon.english(text)
    return {"prompt": ENGLISH_PROMPT, "tokens": len(out), "output": text, "words": len(_WORD.findall(text)),
            "english_words": round(shares.words, 3), "english_pairs": round(shares.pairs, 3),
            "distinct_pairs": round(shares.distinct_pairs, 3)}
