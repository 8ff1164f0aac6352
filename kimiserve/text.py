"""Text that cannot be encoded as UTF-8, made encodable the way Kimi's own tokenizer (tiktoken) does it.

A Python str may hold surrogate code points (U+D800..U+DFFF): from argv bytes that are not UTF-8
(surrogateescape), or from JSON `\\udXXX` escapes. UTF-8 cannot encode them, so neither protobuf nor the
`tokenizers` library accepts such a string. tiktoken's `encode` fixes such text before encoding by a round trip
through UTF-16: a high + low surrogate pair becomes the character it encodes, and a lone surrogate becomes U+FFFD.
`encodable` does exactly that, so the tokenizer service, the CLI and batch input agree with tiktoken.
"""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def encodable(text: str) -> str:
    """`text` with surrogate pairs joined and lone surrogates replaced by U+FFFD; `text` itself when it has none."""
    if _SURROGATE.search(text) is None:  # the common case: one linear scan, no copy
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def encodable_json(value: Any) -> Any:
    """A parsed JSON value with `encodable` applied to every string in it (keys too): JSON text may spell a lone
    surrogate as an escape (`"\\udcff"`). Recursive, so give it values whose depth is already bounded."""
    if isinstance(value, str):
        return encodable(value)
    if isinstance(value, list):
        return [encodable_json(v) for v in value]
    if isinstance(value, dict):
        return {encodable(k): encodable_json(v) for k, v in value.items()}
    return value


CLIP_CHARS = 64


def clip(value: object, limit: int = CLIP_CHARS, quote: bool = True) -> str:
    """`repr(value)` (a str as it is, with `quote=False`) for an error message that echoes client input, cut to its
    first `limit` characters with the full length named: `'abc...'... (100000 chars)`. Messages travel in gRPC
    trailing metadata (16 KiB at most by default) and in log lines, so a 100,000-character id must not come back
    whole."""
    if isinstance(value, str) and quote:
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} chars)"
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
