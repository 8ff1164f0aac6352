"""Prefix-cache isolation: the one salt a request's prefix-cache entries are keyed by, on the shard (Submit's
cache_salt, shard_svc/engine/prefix_cache.py), in the router's prefix index (router/prefix_index.py) and in the
tokenizer's cache of rendered chat pieces (RenderChatRequest.cache_salt, tokenizer_svc/message_ends.py).

Requests share cached prefixes only under the same salt, so `cached_tokens` and timing tell a request nothing about
prompts sent under another. The salt mixes the tenant (requests of different tenants never share) with the request's
own `cache_salt` (vLLM's name; a tenant's requests that set different ones never share either). No tenant and no
request salt give the empty salt: the one shared space of a single-tenant deployment, as before salts existed.
"""

from __future__ import annotations

import hashlib

from router.errors import InvalidArgument

MAX_CACHE_SALT_CHARS = 256


def check_request_salt(request_salt: str) -> str:
    """`request_salt` as it is; InvalidArgument naming `cache_salt` when over MAX_CACHE_SALT_CHARS (flow checks it
    before anything is rendered)."""
    if len(request_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument(f"cache_salt has {len(request_salt)} characters; at most {MAX_CACHE_SALT_CHARS}",
                              "cache_salt")
    return request_salt


def cache_salt_for(tenant: str, request_salt: str) -> str:
    """The salt of a request of `tenant` carrying `request_salt` ('' for none): a SHA-256 hex digest of both, each
    length-prefixed so no two pairs collide by concatenation; '' when both are empty. Raises InvalidArgument for a
    request salt over MAX_CACHE_SALT_CHARS."""
    check_request_salt(request_salt)
    if not tenant and not request_salt:
        return ""
    both = f"{len(tenant)}:{tenant}{len(request_salt)}:{request_salt}"
    return hashlib.sha256(both.encode()).hexdigest()
