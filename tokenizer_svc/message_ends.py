"""Where a rendered chat prompt's messages end, as token offsets: the points the shard's prefix cache snapshots at, so
requests that share a system prompt, tool declarations or earlier turns restore them (RenderChatResponse
.message_ends, README "Prefix cache").

Text first: the built-in Kimi format renders turn by turn, so its ends are known exactly; a checkpoint's Jinja
template is rendered again for the first and last few starts of the conversation (every one would be quadratic in
the message count), keeping those whose rendering begins the whole prompt (and skipping those it refuses to render).
Then tokens: the text between two ends is encoded on its own, and an end is reported only while those pieces,
concatenated, equal the whole prompt's ids up to it, so an offset is never reported where the tokenizer merges
across the end (the Kimi format ends every turn with a special token, where encoding always splits).

Where every end is a split the tokenizer is known to make (kimiserve/tokenizer_files/splits.py), the whole prompt's
ids are its pieces' ids (`ids_by_pieces`): requests that share a long system prompt take its ids from the piece
cache instead of encoding it again (3.3 ms a request for 3,700 tokens on one core).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from kimiserve.tokenizer_files.splits import SplitRule
from tokenizer_svc import metrics
from tokenizer_svc.chat_template import ChatTemplate
from tokenizer_svc.errors import RenderError
from tokenizer_svc.kimi_chat import BuiltinKimiTemplate, Messages, Tools

# RenderChat's pieces by where their ids came from (bound once: this runs for every piece of every chat).
PIECES_FROM_CACHE, PIECES_ENCODED = (metrics.CHAT_PIECES.labels(cached=c) for c in ("true", "false"))
JINJA_STARTS = 4  # a Jinja template is rendered again for this many first and this many last starts


def char_ends(template: ChatTemplate, messages: Messages, tools: Tools, add_generation_prompt: bool,
              prompt: str, continue_final_message: bool = False) -> list[int]:
    """Increasing offsets into `prompt` (the whole rendering) where a start of the conversation's rendering ends,
    each inside (0, len(prompt)). A final message left open (continue_final_message) ends nowhere but at the
    prompt's end: its closed rendering is longer than the prompt, so no start that holds it is reported."""
    if isinstance(template, BuiltinKimiTemplate):
        ends, at = [], 0
        for part in template.render_parts(messages, tools, add_generation_prompt, continue_final_message):
            at += len(part)
            ends.append(at)
    else:
        n = len(messages)
        starts = sorted({k for k in (*range(1, JINJA_STARTS + 1), *range(n - JINJA_STARTS + 1, n + 1)) if 0 < k <= n})
        ends = []
        for k in starts:
            try:
                text = template.render(messages[:k], tools, False)
            except RenderError:  # a template may refuse a conversation cut short (say, not ending on a user turn)
                continue
            if prompt.startswith(text):
                ends.append(len(text))
    return sorted({e for e in ends if 0 < e < len(prompt)})


def token_ends(encode: Callable[[str], list[int]], prompt: str, ids: list[int], ends: list[int]) -> list[int]:
    """The token offsets of `ends` (char offsets into `prompt`, whose ids are `ids`), up to the first end no token
    edge falls on."""
    out, start, at = [], 0, 0
    for end in ends:
        piece = encode(prompt[start:end])
        if ids[at:at + len(piece)] != piece:
            break
        at += len(piece)
        start = end
        if 0 < at < len(ids) and (not out or at > out[-1]):
            out.append(at)
    return out


def ids_by_pieces(rule: SplitRule, encode: Callable[[str], list[int]], prompt: str,
                  ends: list[int]) -> tuple[list[int], list[int]] | None:
    """`prompt`'s ids and the token offsets of `ends` (increasing char offsets inside it), from the ids of the pieces
    between the ends, when the tokenizer splits at every end (`rule`); None when it may merge across one."""
    if not all(rule.splits_at(prompt, end) for end in ends):
        return None
    ids, offsets, start = [], [], 0
    for end in (*ends, len(prompt)):
        ids += encode(prompt[start:end])
        offsets.append(len(ids))
        start = end
    offsets.pop()  # the prompt's own end
    return ids, sorted({at for at in offsets if 0 < at < len(ids)})


class PieceEncoder:
    """`encode` with the ids of recent pieces kept: requests that share a system prompt or earlier turns render the
    same pieces. Exact (encoding is deterministic); keyed by the request's cache salt as well as the text, so a piece
    is only ever found again under the salt it was encoded for; bounded by the characters it holds, least recently
    used dropped first (salts count in the bound). `for_salt` gives the encode function of one request."""

    def __init__(self, encode: Callable[[str], list[int]], max_chars: int):
        self._encode, self._max_chars = encode, max_chars
        self._ids: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # the service's work threads share one encoder
        self.misses = 0

    def for_salt(self, salt: str) -> Callable[[str], list[int]]:
        return lambda piece: self(piece, salt)

    def __call__(self, piece: str, salt: str = "") -> list[int]:
        key = (salt, piece)
        with self._lock:
            ids = self._ids.get(key)
            if ids is not None:
                self._ids.move_to_end(key)
                PIECES_FROM_CACHE.inc()
                return list(ids)
        ids = tuple(self._encode(piece))
        PIECES_ENCODED.inc()
        with self._lock:
            self.misses += 1
            if len(salt) + len(piece) <= self._max_chars and key not in self._ids:
                self._ids[key] = ids
                self._chars += len(salt) + len(piece)
                while self._chars > self._max_chars:
                    (old_salt, old), _ = self._ids.popitem(last=False)
                    self._chars -= len(old_salt) + len(old)
        return list(ids)
