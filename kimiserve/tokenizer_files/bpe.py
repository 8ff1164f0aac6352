"""Byte-level BPE pieces: tiktoken rank files, merges rebuilt from ranks, and the HF `tokenizers` BPE they make.

A tiktoken file lists each token's bytes with its rank; BPE encodes a piece by repeatedly merging the adjacent pair
whose concatenation has the lowest rank. HF's BPE instead takes an ordered merge list. The two agree when every
split (left, right) of a token whose halves are both tokens becomes a merge, ordered by the token's rank (then by
the halves' ranks), which is how tiktoken-to-HF converters rebuild merges.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kimiserve.tokenizer_files.errors import TokenizerLoadError
from kimiserve.tokenizer_files.kimi_format import KIMI_PAT_STR


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


@cache
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def token_str(token: bytes) -> str:
    """Bytes of a token as its byte-level vocabulary string."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def read_tiktoken_model(path: Path) -> dict[bytes, int]:
    """Parse `tiktoken.model`: one `base64(token bytes) rank` per line. Ranks must be exactly 0..N-1."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_text(encoding="ascii").splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (IndexError, ValueError) as exc:
            raise TokenizerLoadError(f"{path}:{lineno}: expected '<base64 token> <rank>', got {line[:80]!r}") from exc
        if token in ranks:
            raise TokenizerLoadError(f"{path}:{lineno}: token {token!r} repeated (ranks {ranks[token]} and {rank})")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerLoadError(f"{path}: ranks are not exactly 0..{len(ranks) - 1} (duplicates or gaps)")
    return ranks


def merges_from_ranks(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Rebuild the ordered merge list from tiktoken ranks (see module docstring)."""
    merges: list[tuple[bytes, bytes]] = []
    for token in sorted(ranks, key=ranks.__getitem__):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        valid = [(left, right) for left, right in splits if left in ranks and right in ranks]
        merges.extend(sorted(valid, key=lambda pair: (ranks[pair[0]], ranks[pair[1]])))
    return merges


def build_bpe_tokenizer(
    ranks: Mapping[bytes, int],
    merges: list[tuple[bytes, bytes]],
    special_tokens: Mapping[int, str],
    pattern: str = KIMI_PAT_STR,
) -> Tokenizer:
    """A byte-level HF BPE: `pattern` splits text (as tiktoken does), then bytes map to GPT-2 characters.

    `special_tokens` (id -> content) must be the ids right after the base vocabulary, without gaps.
    """
    vocab = {token_str(token): rank for token, rank in ranks.items()}
    # ignore_merges: a piece that is itself a token is emitted whole, as tiktoken does before merging.
    model = models.BPE(vocab=vocab, merges=[(token_str(a), token_str(b)) for a, b in merges], ignore_merges=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    expected = list(range(len(vocab), len(vocab) + len(special_tokens)))
    if sorted(special_tokens) != expected:
        raise TokenizerLoadError(
            f"special ids must follow the base vocab of {len(vocab)} without gaps; got ids "
            f"{min(special_tokens, default=None)}..{max(special_tokens, default=None)} ({len(special_tokens)} ids)"
        )
    # Added in id order, so `tokenizers` assigns each the id it has in the checkpoint; checked below.
    tok.add_special_tokens([AddedToken(special_tokens[i], special=True, normalized=False) for i in expected])
    for token_id in expected:
        if tok.token_to_id(special_tokens[token_id]) != token_id:
            raise TokenizerLoadError(
                f"special token {special_tokens[token_id]!r} got id {tok.token_to_id(special_tokens[token_id])}, "
                f"expected {token_id} (its content is probably also a base-vocab token or repeated)"
            )
    return tok
