"""Request ids: what a client may send, and the form the batch runner gives its own requests.

A client id travels back in gRPC trailing metadata and in every log line, so it must be printable ASCII of bounded
length, checked before any work. The batch runner's ids have a reserved form that no client id may take: a client
could otherwise collide with a batch line on purpose, stall it, or read its tokens.
"""

from __future__ import annotations

import re

from kimiserve.limits import MAX_REQUEST_ID_CHARS
from router.errors import InvalidArgument

_BATCH_FORM = re.compile(r"batch_[0-9a-f]{32}:")


def batch_request_id(batch_id: str, custom_id: str, attempt: int) -> str:
    return f"{batch_id}:{custom_id}:{attempt}"


def check_client_request_id(request_id: str) -> str:
    """Returns the id, or raises InvalidArgument naming what is wrong with it."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request id of {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    bad = next((i for i, c in enumerate(request_id) if not " " <= c <= "~"), None)
    if bad is not None:
        raise InvalidArgument(f"request id holds {request_id[bad]!r} at index {bad}; only printable ASCII "
                              f"(0x20-0x7e) is allowed")
    if _BATCH_FORM.match(request_id):
        raise InvalidArgument("request ids of the form 'batch_<32 hex digits>:...' are reserved for batch requests")
    return request_id
