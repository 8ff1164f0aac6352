"""Incremental detokenization: no split characters, no repeated text, deltas add up to the one-shot decode."""

from __future__ import annotations

import random

import pytest

from kimiserve.tokenizer_files.loading import LoadedTokenizer
from tests.tokenizer.texts import MIXED_TEXT
from tokenizer_svc.detokenizer import IncrementalDetokenizer


def stream(tok: LoadedTokenizer, chunks: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    return [detok.add(chunk) for chunk in chunks] + [detok.flush()]


def test_one_id_at_a_time_over_multibyte_text(tok: LoadedTokenizer) -> None:
    ids = tok.encode(MIXED_TEXT)
    # The tiny vocab learned no Chinese or emoji merges, so those characters arrive one byte-token at a time.
    assert any(len(tok.token_bytes[i]) == 1 and tok.token_bytes[i][0] >= 0x80 for i in ids)
    deltas = stream(tok, [[i] for i in ids], skip_special_tokens=False)
    assert all("\ufffd" not in d for d in deltas), "a delta split a character"
    assert "".join(deltas) == MIXED_TEXT == tok.decode(ids, skip_special_tokens=False)
    held = [d for d in deltas[:-1] if d == ""]
    assert held, "multi-byte characters should have been held back for at least one id"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_chunks_and_padded_vocab_ids(tok: LoadedTokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids: list[int] = []
    for token_id in tok.encode(MIXED_TEXT):
        ids.append(token_id)
        if rng.random() < 0.2:
            ids.append(rng.randrange(tok.vocab_size, 1024))  # the tiny model pads its vocab to 1024
    chunks: list[list[int]] = []
    while ids:
        n = rng.randrange(0, 5)
        chunks.append(ids[:n])
        ids = ids[n:]
    deltas = stream(tok, chunks)
    assert "".join(deltas) == tok.decode([i for c in chunks for i in c]) == MIXED_TEXT.replace("<|im_end|>", "")
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_skipped_by_default(tok: LoadedTokenizer) -> None:
    ids = tok.encode("<|im_assistant|>assistant<|im_middle|>Hi!<|im_end|>")
    assert "".join(stream(tok, [[i] for i in ids])) == "assistantHi!"
    assert "".join(stream(tok, [[i] for i in ids], skip_special_tokens=False)) == (
        "<|im_assistant|>assistant<|im_middle|>Hi!<|im_end|>"
    )


def byte_token(tok: LoadedTokenizer, value: int) -> int:
    return tok.token_bytes.index(bytes([value]))


def test_invalid_bytes_become_one_replacement_and_are_not_repeated(tok: LoadedTokenizer) -> None:
    # A lead byte of a 3-byte character, one continuation, then ASCII: never completes.
    ids = [byte_token(tok, 0xE4), byte_token(tok, 0xB8), *tok.encode("ok")]
    deltas = stream(tok, [[i] for i in ids])
    assert deltas[:2] == ["", ""]
    assert "".join(deltas) == "\ufffdok" == tok.decode(ids)


def test_incomplete_character_at_the_end_is_flushed(tok: LoadedTokenizer) -> None:
    ids = [*tok.encode("a"), byte_token(tok, 0xF0), byte_token(tok, 0x9F)]
    deltas = stream(tok, [ids])
    assert deltas == ["a", "\ufffd"]
    assert "".join(deltas) == tok.decode(ids)
