"""A byte-level BPE learned from the corpus by `tokenizers`' BPE trainer, written in the Kimi format.

Pieces are split with Kimi's pre-tokenizer pattern, as encoding will split them; the trainer learns `base_vocab - 256`
merges over the 256 single bytes. The learned vocabulary and ordered merges are then rebuilt through the project's
own `build_bpe_tokenizer` (kimiserve/tokenizer_files/bpe.py) with the 256 reserved Kimi special ids after the base
vocabulary, so training, the tokenizer service and the shard see one tokenizer. Only `tokenizer.json` is written: a
merge list learned by frequency is not the one `merges_from_ranks` would rebuild from a rank file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from kimiserve.tokenizer_files.bpe import unicode_to_bytes
from kimiserve.tokenizer_files.kimi_format import KIMI_PAT_STR
from kimiserve.tokenizer_files.loading import LoadedTokenizer, load_tokenizer
from kimiserve.tokenizer_files.write import write_kimi_tokenizer


class TokenizerTrainingError(RuntimeError):
    """The trainer did not produce the vocabulary asked for."""


def learn_bpe(texts: Iterable[str], base_vocab: int) -> tuple[dict[bytes, int], list[tuple[bytes, bytes]]]:
    """(ranks: token bytes -> id, ordered merges) of a byte-level BPE with exactly `base_vocab` tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=base_vocab, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    model = json.loads(tok.to_str())["model"]
    byte_of = unicode_to_bytes()
    to_bytes = lambda s: bytes(byte_of[c] for c in s)  # noqa: E731
    ranks = {to_bytes(token): i for token, i in model["vocab"].items()}
    merges = [tuple(to_bytes(part) for part in (m.split(" ") if isinstance(m, str) else m)) for m in model["merges"]]
    if len(ranks) != base_vocab or sorted(ranks.values()) != list(range(base_vocab)):
        raise TokenizerTrainingError(f"BPE trainer gave {len(ranks)} tokens with ids {min(ranks.values())}.."
                                     f"{max(ranks.values())}, wanted exactly 0..{base_vocab - 1}")
    return ranks, merges  # type: ignore[return-value]


def train_tokenizer(texts: Iterable[str], base_vocab: int, out_dir: Path) -> LoadedTokenizer:
    """Learn, write tokenizer.json + tokenizer_config.json into `out_dir`, and load them back as the services do."""
    ranks, merges = learn_bpe(texts, base_vocab)
    write_kimi_tokenizer(out_dir, ranks, merges, tiktoken_model=False)
    return load_tokenizer(out_dir)
