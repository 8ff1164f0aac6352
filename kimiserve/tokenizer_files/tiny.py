"""A tiny, working Kimi-format tokenizer for tests and the tiny built-in checkpoint.

Layout mirrors the real one at a small scale: 512 base ids (256 single bytes + 256 merges learned from the built-in
text below with the Kimi split pattern), then the 256 reserved Kimi special ids, at the same offsets from the base
as the real ids from 163584 (docs/models.md#special-tokens): [BOS] 512, [EOS] 513, <|im_end|> 514, ..., [PAD] 767.
Both load paths are written:
`tokenizer.json` (built from the learned merges) and `tiktoken.model` + `tokenizer_config.json` (ranks only, so the
loader must rebuild the merges). The seed permutes which rank each single byte gets, as real rank files do not list
bytes in order; the same seed always writes the same bytes.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from tokenizers import Regex, pre_tokenizers

from kimiserve.tokenizer_files.kimi_format import KIMI_PAT_STR
from kimiserve.tokenizer_files.write import write_kimi_tokenizer

NUM_MERGES = 256

TRAINING_TEXT = """\
The river town woke early. Before the sun cleared the hills, the baker had lit his ovens and the ferry had made
its first crossing of the day. People said the water was slower here than anywhere else along the valley, and that
the slowness had shaped the town: nobody hurried, and nothing that was worth doing was ever left half done.
In the market square the stalls opened one by one. There were apples and pears from the orchards on the western
slope, cheese from the farms beyond the bridge, and bread that was still warm when you carried it home. Children
ran between the carts while their parents talked about the weather, the harvest, and the price of everything.
"It's going to rain," said the old woman who sold honey. "I can feel it in my hands." She had said the same thing
every morning for thirty years, and she was right about half of the time, which everyone agreed was better than
the forecast on the radio.
At the school on the hill the teacher wrote a question on the board: how many stones are there in the wall around
the church? The students counted, argued, counted again, and arrived at 1,024, then 998, then 1,013. The teacher
smiled and told them that the answer mattered less than the way they had found it.
The library stayed open late on Thursdays. Its reading room had tall windows, long tables and a clock that was
always four minutes fast. Students came to study, travellers came to rest, and a few regulars came simply because
they liked the quiet. The librarian knew what each of them would ask for before they reached the desk.
When evening came the light turned gold on the water and the boats returned to the harbour. Fishermen sorted their
catch, gulls circled overhead, and the smell of supper drifted out of open kitchen windows. Somebody played a
violin in the square; somebody else sang along, not quite in tune, and nobody minded at all.
Later, when the streets were dark and the last ferry had crossed, the town slept. The river kept moving, slowly,
the way it always had, carrying the day's small stories down toward the sea. Tomorrow they would start again:
ovens, ferries, markets, questions, and the patient work of people who were not in a hurry.
"""


def _words(text: str) -> Counter[tuple[bytes, ...]]:
    """Pre-tokenize with the Kimi pattern (as encoding will) and count each piece as a sequence of single bytes."""
    splitter = pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated")
    pieces = [piece for piece, _ in splitter.pre_tokenize_str(text)]
    return Counter(tuple(bytes([b]) for b in piece.encode("utf-8")) for piece in pieces)


def _merge(word: tuple[bytes, ...], pair: tuple[bytes, bytes]) -> tuple[bytes, ...]:
    out: list[bytes] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def train(seed: int = 0) -> tuple[dict[bytes, int], list[tuple[bytes, bytes]]]:
    """Ranks (bytes -> id) and the ordered merges learned from TRAINING_TEXT; deterministic for a seed."""
    byte_order = list(range(256))
    random.Random(seed).shuffle(byte_order)
    ranks = {bytes([b]): rank for rank, b in enumerate(byte_order)}
    words = _words(TRAINING_TEXT)
    merges: list[tuple[bytes, bytes]] = []
    while len(merges) < NUM_MERGES:
        counts: Counter[tuple[bytes, bytes]] = Counter()
        for word, freq in words.items():
            for pair in zip(word, word[1:]):
                counts[pair] += freq
        # A pair whose bytes are already a token would give one byte string two ids; skip it.
        candidates = [(-n, a + b, a, b) for (a, b), n in counts.items() if a + b not in ranks]
        if not candidates:
            raise RuntimeError(f"training text too small: only {len(merges)} merges of {NUM_MERGES} learned")
        _, token, a, b = min(candidates)  # most frequent; ties by token bytes, so no dependence on dict order
        ranks[token] = len(ranks)
        merges.append((a, b))
        words = Counter({_merge(w, (a, b)): f for w, f in words.items()})
    return ranks, merges


def write_tiny_tokenizer(out_dir: Path, seed: int = 0) -> int:
    """Write tokenizer.json, tiktoken.model and tokenizer_config.json into out_dir; returns the vocab size (768)."""
    ranks, merges = train(seed)
    return write_kimi_tokenizer(out_dir, ranks, merges, tiktoken_model=True)
