"""The HTTP API's guard against web pages, on a router without API keys.

Without keys nothing but the network stands between the API and a caller, and a browser on the same machine is a
caller any web page can drive: a cross-site `<form>` or `fetch` POST with `Content-Type: text/plain` needs no CORS
preflight (CSRF), and a page whose DNS name is re-pointed at 127.0.0.1 (DNS rebinding) can even read the replies.
Three checks close both, before any route runs:

- `Host` must name an allowed host (default: localhost, 127.0.0.1, ::1; any port): a rebound page sends its own
  name;
- `Origin`, when present, must be an http(s) URL of an allowed host: browsers send it on every cross-origin and
  every POST request, so a page elsewhere is refused (`Origin: null`, from sandboxed frames and files, too);
- a POST with a body must say what it is: `application/json` (or `application/*+json`), or `multipart/form-data`
  for a file upload; a form's `text/plain` or url-encoded body is refused 415.

With API keys none of this is needed (a page cannot attach the key to a request it makes the browser send) and the
checks are off. `/health` is exempt: load balancers probe it by pod address, and it tells nothing beyond up/down.
"""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

from starlette.datastructures import Headers

from router.http.errors import HttpError

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"
UPLOAD_PATHS = frozenset({"/v1/files"})  # multipart/form-data, as OpenAI's file upload


def allowed_hosts(text: str) -> tuple[str, ...]:
    """`--http-allowed-hosts a,b,...`: host names or addresses (no ports, no schemes), or `*` alone."""
    hosts = tuple(h.strip().lower().strip("[]") for h in text.split(",") if h.strip())
    if not hosts:
        raise argparse.ArgumentTypeError("give at least one host, or `*` for any")
    if ANY_HOST in hosts and len(hosts) > 1:
        raise argparse.ArgumentTypeError(f"`*` accepts any host and goes alone, got {text!r}")
    for h in hosts:
        if h != ANY_HOST and ("/" in h or " " in h):
            raise argparse.ArgumentTypeError(f"{h!r} is not a host name or address (no scheme, path or port)")
    return hosts


def _host_part(netloc: str) -> str:
    """`example.com:8000` -> example.com, `[::1]:8000` -> ::1 (lower case)."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:].split("]", 1)[0]
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


class LocalGuard:
    def __init__(self, hosts: tuple[str, ...]):
        self.hosts = frozenset(hosts)

    def check(self, method: str, path: str, headers: Headers) -> None:
        """Raises HttpError (403 / 415, OpenAI's error shape) for a request a web page could have made."""
        if ANY_HOST not in self.hosts:
            host = headers.get("host")
            if host is not None and _host_part(host) not in self.hosts:
                raise HttpError(403, f"Host {host[:200]!r} is not allowed: this API has no API keys and answers "
                                     f"only {', '.join(sorted(self.hosts))} (router flag --http-allowed-hosts)",
                                "host_not_allowed")
            origin = headers.get("origin")
            if origin is not None:
                parts = urlsplit(origin)
                if parts.scheme not in ("http", "https") or _host_part(parts.netloc) not in self.hosts:
                    raise HttpError(403, f"Origin {origin[:200]!r} is not allowed: a web page of another site "
                                         "may not call this API (router flag --http-allowed-hosts)",
                                    "origin_not_allowed")
        if method == "POST" and _has_body(headers):
            self._check_type(path, headers.get("content-type", ""))

    @staticmethod
    def _check_type(path: str, content_type: str) -> None:
        media = content_type.split(";", 1)[0].strip().lower()
        if path in UPLOAD_PATHS:
            if media != "multipart/form-data":
                raise HttpError(415, f"POST {path} takes multipart/form-data, got Content-Type "
                                     f"{content_type[:100]!r}", "unsupported_media_type")
            return
        if not (media == "application/json" or (media.startswith("application/") and media.endswith("+json"))):
            raise HttpError(415, f"POST {path} takes a JSON body: send Content-Type: application/json, got "
                                 f"{content_type[:100]!r}", "unsupported_media_type")


def _has_body(headers: Headers) -> bool:
    length = headers.get("content-length")
    return "transfer-encoding" in headers or (length is not None and length.strip() not in ("", "0"))
