"""Offsets where a text may be encoded in pieces: encode(text) == encode(text[:at]) + encode(text[at:]).

A `tokenizers` tokenizer first cuts the text at its added tokens (the leftmost-longest matches of their contents on
the raw text, for those not `normalized`), then normalizes, pre-tokenizes and BPE-merges each stretch between two
matches on its own. So `at` is such a cut, and the two sides encode alone as they do together, when:
- an added token's content starts there: the whole text's parse matches one there, as the right side's does at its
  start (given the next condition);
- no added token's content holds the two characters around it: no match of the whole text spans the offset, so the
  left side parses as the whole's left part, and nothing else starts a match between its last match and the offset;
- neither character is whitespace or a word character: an added token's lstrip / rstrip (which take the whitespace
  beside a match) and single_word (which wants no word character beside it) see the same on both sides.
The Kimi chat format ends every turn with a special token and begins the next with one (`<|im_end|><|im_user|>`), so
a chat prompt's turn ends are such offsets: RenderChat builds a prompt's ids from its turns' cached ids
(tokenizer_svc/message_ends.py) instead of encoding a long shared system prompt again for every request.
"""

from __future__ import annotations

from tokenizers import Tokenizer


def _word_or_space(c: str) -> bool:
    return c.isspace() or c.isalnum() or c == "_"


class SplitRule:
    """Whether a text's encoding splits exactly at an offset (module docstring), from a tokenizer's added tokens."""

    def __init__(self, hf: Tokenizer):
        added = list(hf.get_added_tokens_decoder().values())
        self._starts = tuple(sorted({t.content for t in added if t.content and not t.normalized}))
        self._first_chars = frozenset(s[0] for s in self._starts)
        self._pairs = frozenset(t.content[i:i + 2] for t in added for i in range(len(t.content) - 1))

    def splits_at(self, text: str, at: int) -> bool:
        if not 0 < at < len(text):
            return at in (0, len(text))  # an empty side encodes to nothing
        left, right = text[at - 1], text[at]
        if _word_or_space(left) or _word_or_space(right) or left + right in self._pairs:
            return False
        return right in self._first_chars and any(text.startswith(s, at) for s in self._starts)
