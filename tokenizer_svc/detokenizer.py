"""Incremental detokenization of one generated sequence: feed ids as they come, get text deltas.

Works on bytes: each id maps to its exact token bytes, and an incremental UTF-8 decoder turns the byte stream into
text. Bytes of a character that is not complete yet are held back until a later id completes it, so a delta never
splits a multi-byte character and no text is ever emitted twice; the concatenation of all deltas (with `flush`) is
exactly the one-shot decode of all the ids. Byte sequences that can never be valid become U+FFFD, as in a one-shot
decode.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from kimiserve.tokenizer_files.loading import LoadedTokenizer


class IncrementalDetokenizer:
    """Not thread-safe: one instance per sequence."""

    def __init__(self, tokenizer: LoadedTokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, ids: Iterable[int]) -> str:
        """Text completed by `ids`. Ids past the tokenizer's vocab (padded model vocab) add nothing."""
        return self._utf8.decode(self._tokenizer.decode_bytes(ids, self._skip_special))

    def flush(self) -> str:
        """End of sequence: held-back bytes that never completed a character, as U+FFFD (else "")."""
        return self._utf8.decode(b"", final=True)
