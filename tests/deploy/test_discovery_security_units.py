"""Shard discovery and security helpers in-process: add / remove with hysteresis, drain then fail leftovers, failed
lookups change nothing, real DNS resolution; API-key parsing, reload and refusal, TLS flag validation."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import time

import pytest

from kimiserve import security
from router.balancer import ShardView
from router.discovery import DiscoveryError, ShardDiscovery, dns_resolver, format_address, split_host_port


class FakeClient:
    def __init__(self, address: str):
        self.address, self.view = address, ShardView(address, healthy=True)
        self.started = self.closed = False
        self.closed_event = asyncio.Event()
        self.down_reason: str | None = None

    def start(self):
        self.started = True

    async def close(self):
        self.closed = True
        self.closed_event.set()

    def _mark_down(self, reason):
        self.down_reason = reason
        self.view.healthy = False


class Found:
    def __init__(self, *addresses):
        self.addresses, self.error = set(addresses), None

    async def __call__(self):
        if self.error:
            raise self.error
        return set(self.addresses)


def run(coro):
    return asyncio.run(coro)


def test_new_addresses_join_and_absent_ones_leave_after_hysteresis():
    async def main():
        shards, found, removed = [], Found("a:1", "b:1"), []
        d = ShardDiscovery(shards, [found], make_client=FakeClient, remove_after=2, drain_timeout_s=1,
                           on_removed=removed.append)
        await d.refresh()
        assert d.addresses == ["a:1", "b:1"] and all(c.started for c in shards)
        first = list(shards)
        found.addresses = {"a:1", "b:1", "c:1"}  # scaled up
        await d.refresh()
        assert d.addresses == ["a:1", "b:1", "c:1"] and shards[:2] == first  # existing clients kept
        found.addresses = {"a:1", "c:1"}  # b left: one miss is tolerated (a DNS blip)
        await d.refresh()
        assert "b:1" in d.addresses
        found.addresses = {"a:1", "b:1", "c:1"}  # back: the miss count resets
        await d.refresh()
        found.addresses = {"a:1", "c:1"}
        await d.refresh()
        assert "b:1" in d.addresses
        await d.refresh()  # second miss in a row: out of rotation, drained, closed
        assert d.addresses == ["a:1", "c:1"] and removed == ["b:1"]
        b = first[1]
        await asyncio.wait_for(b.closed_event.wait(), 10)  # nothing in flight: the drain closes it at once
        assert b.down_reason == "removed by shard discovery"
        await d.stop()

    run(main())


def test_a_leaving_shard_drains_in_flight_then_fails_what_is_left():
    """Event order, not sleeps against the drain timeout: a drain far longer than the test ends as soon as its last
    request does, and a short one closes no earlier than its timeout with the requests still in flight."""
    async def closes(client: FakeClient) -> None:
        await asyncio.wait_for(client.closed_event.wait(), 10)

    async def main():
        shards, found = [], Found("a:1", "b:1")
        d = ShardDiscovery(shards, [found], make_client=FakeClient, remove_after=1, drain_timeout_s=60)
        await d.refresh()
        a, b = shards
        a.view.in_flight, b.view.in_flight = 2, 1
        found.addresses = set()
        await d.refresh()
        assert shards == []
        await asyncio.sleep(0.3)  # the drains poll every 0.1 s: several rounds with requests in flight
        assert not a.closed and not b.closed  # still draining: their requests may finish
        b.view.in_flight = 0  # b's request finished
        await closes(b)
        assert b.down_reason and not a.closed
        await d.stop()  # pending drains end at once: a's leftovers fail (UNAVAILABLE via _mark_down)
        assert a.closed and a.down_reason

        shards, found = [], Found("c:1")
        d = ShardDiscovery(shards, [found], make_client=FakeClient, remove_after=1, drain_timeout_s=0.3)
        await d.refresh()
        c, = shards
        c.view.in_flight = 1
        found.addresses = set()
        start = asyncio.get_running_loop().time()
        await d.refresh()
        await closes(c)  # past the drain timeout: the request still in flight fails
        assert asyncio.get_running_loop().time() - start >= 0.3 and c.view.in_flight == 1 and c.down_reason
        await d.stop()

    run(main())


def test_failed_lookup_keeps_shards_and_unknown_name_empties():
    async def main():
        shards, found = [], Found("a:1")
        d = ShardDiscovery(shards, [found], make_client=FakeClient, remove_after=1)
        await d.refresh()
        found.error = DiscoveryError("SERVFAIL")
        await d.refresh()
        assert d.addresses == ["a:1"]
        await d.stop()

    run(main())


def test_background_loop_picks_up_scaling():
    async def main():
        shards, found = [], Found("a:1")
        d = ShardDiscovery(shards, [found], make_client=FakeClient, interval_s=0.05, remove_after=1)
        await d.refresh()
        d.start()
        found.addresses = {"a:1", "b:1"}
        await asyncio.sleep(0.2)
        assert d.addresses == ["a:1", "b:1"]
        await d.stop()

    run(main())


def test_dns_resolver_resolves_real_names():
    async def main():
        assert await dns_resolver("localhost:50061")() >= {"127.0.0.1:50061"} or \
            await dns_resolver("localhost:50061")() >= {"[::1]:50061"}
        assert await dns_resolver("127.0.0.1:7")() == {"127.0.0.1:7"}
        assert await dns_resolver("no-such-shard.invalid:1")() == set()  # NXDOMAIN: no ready shard

    run(main())
    assert split_host_port("svc.ns.svc.cluster.local:50061") == ("svc.ns.svc.cluster.local", 50061)
    assert format_address("::1", 5) == "[::1]:5" and format_address("10.0.0.1", 5) == "10.0.0.1:5"
    with pytest.raises(ValueError):
        split_host_port("no-port")


def test_dns_resolver_raises_on_a_failure_that_is_not_no_such_name(monkeypatch):
    """Only "no such name" means no ready shard; a resolver outage (EAI_AGAIN) must not empty the shard set."""
    async def outage(self, host, port, **kw):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", outage)
    with pytest.raises(DiscoveryError, match="shard.ns:50061"):
        run(dns_resolver("shard.ns:50061")())


# -- security ---------------------------------------------------------------------------------------------------
def _args(**kw):
    base = dict(tls_cert=None, tls_key=None, client_ca=None, health_port=None, upstream_ca=None, upstream_cert=None,
                upstream_key=None, upstream_server_name=None)
    return argparse.Namespace(**{**base, **kw})


def test_tls_flags_are_validated():
    assert security.server_tls_from_args(_args()) is None
    with pytest.raises(security.SecurityConfigError, match="go together"):
        security.server_tls_from_args(_args(tls_cert="c.pem"))
    with pytest.raises(security.SecurityConfigError, match="--client-ca needs"):
        security.server_tls_from_args(_args(client_ca="ca.pem"))
    assert security.server_tls_from_args(_args(tls_cert="c", tls_key="k", client_ca="ca")).client_ca == "ca"
    with pytest.raises(security.SecurityConfigError, match="need --upstream-ca"):
        security.upstream_tls_from_args(_args(upstream_cert="c"))
    with pytest.raises(security.SecurityConfigError, match="go together"):
        security.upstream_tls_from_args(_args(upstream_ca="ca", upstream_cert="c"))
    with pytest.raises(security.SecurityConfigError, match="cannot read the TLS key"):
        security.ServerTls("/nonexistent/c.pem", "/nonexistent/k.pem").credentials()


def test_api_keys_file_parsing_reload_and_refusals(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# operators\nkey-one  # alice\n\n key-two\n")
    keys = security.ApiKeys(path, recheck_s=0)
    assert keys.valid("key-one") and keys.valid("key-two")
    assert not keys.valid("key-on") and not keys.valid("") and not keys.valid("key-one ")
    path.write_text("key-three\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a rotated Secret: new mtime
    assert keys.valid("key-three") and not keys.valid("key-one")
    with pytest.raises(security.SecurityConfigError, match="cannot read the API keys file"):
        security.ApiKeys(tmp_path / "absent")


def test_an_emptied_keys_file_revokes_every_key(tmp_path, caplog):
    """Emptying the file locks everyone out (it never turns auth off), loudly; a key written again is accepted.
    Files are rewritten in place without touching the mtime by hand: a change within one mtime tick is still seen."""
    path = tmp_path / "keys"
    path.write_text("key-one\n")
    keys = security.ApiKeys(path, recheck_s=0)
    assert keys.valid("key-one")
    with caplog.at_level(logging.ERROR):
        path.write_bytes(b"# nothing\n")
        assert not keys.valid("key-one") and not keys.valid("")
    assert "NO key is valid" in caplog.text and "holds no key" in caplog.text
    path.write_bytes(b"key-two\n")
    assert keys.valid("key-two") and not keys.valid("key-one")
    path.write_text("")
    with pytest.raises(security.SecurityConfigError, match="holds no key"):
        security.ApiKeys(path)  # at startup an empty file is refused: the router could admit nobody


@pytest.mark.parametrize("data, fragment", [
    (b"key-one\n\xffkey\n", "is not UTF-8: byte 0xff at byte offset 8 (line 2)"),
    (b"key-one\nk\xc3\xa9y\n", "line 2: a key must be printable ASCII"),
])
def test_an_invalid_keys_file_is_a_named_error_and_fails_closed_on_reload(tmp_path, caplog, data, fragment):
    path = tmp_path / "keys"
    path.write_bytes(data)
    with pytest.raises(security.SecurityConfigError) as e:
        security.ApiKeys(path)
    assert str(path) in str(e.value) and fragment in str(e.value)
    path.write_text("key-one\n")
    keys = security.ApiKeys(path, recheck_s=0)
    with caplog.at_level(logging.ERROR):
        path.write_bytes(data)
        assert not keys.valid("key-one")  # the keys loaded before are not kept: they may be the revoked ones
    assert fragment in caplog.text


def test_a_deleted_keys_file_leaves_no_key_valid(tmp_path):
    path = tmp_path / "keys"
    path.write_text("key-one\n")
    keys = security.ApiKeys(path, recheck_s=0)
    path.unlink()
    assert not keys.valid("key-one")
    path.write_text("key-one\n")
    assert keys.valid("key-one")


def test_bearer_token_parsing():
    assert security.bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert security.bearer_token([("authorization", "bearer  abc ")]) == "abc"
    assert security.bearer_token([("authorization", "Basic abc")]) == ""
    assert security.bearer_token([("x-request-id", "r")]) is None
    assert security.bearer_token(None) is None
    assert len(security.key_fingerprint("secret")) == 12 and "secret" not in security.key_fingerprint("secret")


# -- the internal token and the HTTP API's guard without keys (kimiserve/internal_auth.py, router/http/origin.py) --
@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True),
                                            ("::1", True), ("[::1]", True), ("0.0.0.0", False), ("::", False),
                                            ("10.0.0.5", False), ("shard-0.svc", False), ("", False)])
def test_only_loopback_addresses_count_as_loopback(host, loopback):
    from kimiserve.internal_auth import is_loopback

    assert is_loopback(host) is loopback


def test_internal_token_files_are_written_private_and_read_strictly(tmp_path):
    from kimiserve.internal_auth import MIN_TOKEN_CHARS, read_token, write_token

    path = write_token(tmp_path / "state" / "internal-token")
    assert oct(path.stat().st_mode & 0o777) == oct(0o600) and oct(path.parent.stat().st_mode & 0o777) == oct(0o700)
    token = read_token(path)
    assert len(token) >= MIN_TOKEN_CHARS and write_token(path) and read_token(path) != token  # fresh each time
    for content, fragment in ((b"short\n", "has 5 characters; at least 32"),
                              (b"a" * 40 + b" b" * 5, "printable ASCII characters without spaces"),
                              ("é".encode() * 40, "printable ASCII")):
        bad = tmp_path / "bad"
        bad.write_bytes(content)
        with pytest.raises(security.SecurityConfigError, match=fragment):
            read_token(bad)
    with pytest.raises(security.SecurityConfigError, match="cannot read the internal token file"):
        read_token(tmp_path / "absent")


def test_http_allowed_hosts_parse_and_refuse_what_is_not_a_host():
    from router.http.origin import allowed_hosts

    assert allowed_hosts("llm.example.com, [::1] ,LOCALHOST") == ("llm.example.com", "::1", "localhost")
    assert allowed_hosts("*") == ("*",)
    for bad, fragment in (("", "at least one host"), ("*,a", "goes alone"), ("http://a", "not a host name")):
        with pytest.raises(argparse.ArgumentTypeError, match=fragment):
            allowed_hosts(bad)


@pytest.mark.parametrize("headers, status", [
    ({"host": "127.0.0.1:8000", "content-type": "application/json", "content-length": "2"}, None),
    ({"host": "[::1]:8000", "origin": "http://localhost:3000", "content-type": "application/json; charset=utf-8",
      "content-length": "2"}, None),
    ({"host": "llm.example.com", "content-type": "application/vnd.api+json", "content-length": "2"}, None),
    ({"host": "127.0.0.1.evil.example", "content-length": "0"}, 403),
    ({"host": "localhost", "origin": "https://localhost.evil.example"}, 403),
    ({"host": "localhost", "origin": "file://"}, 403),
    ({"host": "localhost", "content-type": "text/plain", "transfer-encoding": "chunked"}, 415),
    ({"host": "localhost", "content-length": "0"}, None),  # a POST with no body (cancel) needs no type
])
def test_local_guard_on_a_post(headers, status):
    from starlette.datastructures import Headers

    from router.http.errors import HttpError
    from router.http.origin import LOCAL_HOSTS, LocalGuard

    guard = LocalGuard((*LOCAL_HOSTS, "llm.example.com"))
    if status is None:
        guard.check("POST", "/v1/chat/completions", Headers(headers))
        return
    with pytest.raises(HttpError) as e:
        guard.check("POST", "/v1/chat/completions", Headers(headers))
    assert e.value.status == status
