"""Shard discovery: which shard addresses the router talks to, kept current while it runs.

Sources: a static list (`--shards host:port,...`) and/or a DNS name (`--shards-dns NAME:PORT`, e.g. the shards'
headless Service, whose A/AAAA records are the ready shard pods) re-resolved every `interval_s`. A new address gets
a ShardClient at once (it joins rotation when its health poll says SERVING), so scaling the StatefulSet up needs no
router restart. An address missing from `remove_after` resolutions in a row leaves rotation at once and is drained:
its in-flight requests may finish for `drain_timeout_s`, then whatever is left fails with UNAVAILABLE and the
client is closed. A failed lookup (other than "no such name": a Service with no ready pod) changes nothing.

The shard list is the one Generation holds; it is mutated in place, on the event loop, between awaits.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable

from router.shard_client import ShardClient

log = logging.getLogger(__name__)
Resolver = Callable[[], Awaitable[set[str]]]
# getaddrinfo errors meaning "the name has no addresses" (a headless Service with no ready pod), not "DNS failed".
_NO_ADDRESSES = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


class DiscoveryError(Exception):
    """A lookup failed in a way that says nothing about which shards exist (the shard set is left as it was)."""


def split_host_port(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected NAME:PORT, got {target!r}")
    return host.strip("[]"), int(port)


def format_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


def static_resolver(addresses: Iterable[str]) -> Resolver:
    fixed = set(addresses)

    async def resolve() -> set[str]:
        return set(fixed)

    return resolve


def dns_resolver(target: str) -> Resolver:
    """Resolves NAME:PORT to every address of NAME (IPv4 and IPv6), each as an `ip:port` shard address."""
    host, port = split_host_port(target)

    async def resolve() -> set[str]:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno in _NO_ADDRESSES:
                return set()
            raise DiscoveryError(f"resolving {target}: {e}") from e
        return {format_address(info[4][0], port) for info in infos}

    return resolve


class ShardDiscovery:
    def __init__(self, shards: list[ShardClient], resolvers: list[Resolver],
                 make_client: Callable[[str], ShardClient] = ShardClient, interval_s: float = 5.0,
                 remove_after: int = 2, drain_timeout_s: float = 60.0,
                 on_removed: Callable[[str], None] = lambda address: None):
        self.shards, self.resolvers, self.make_client = shards, resolvers, make_client
        self.interval_s, self.remove_after, self.drain_timeout_s = interval_s, max(1, remove_after), drain_timeout_s
        self.on_removed = on_removed
        self._missing: dict[str, int] = {}  # address -> resolutions in a row it was absent from
        self._draining: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None

    @property
    def addresses(self) -> list[str]:
        return [c.address for c in self.shards]

    async def refresh(self) -> None:
        """One resolution: add new addresses, count absences, remove those absent `remove_after` times in a row."""
        found: set[str] = set()
        for resolve in self.resolvers:
            try:
                found |= await resolve()
            except DiscoveryError as e:
                log.warning("shard discovery failed; keeping the current shards", extra={"error": str(e),
                                                                                         "shards": self.addresses})
                return
        current = {c.address: c for c in self.shards}
        for address in sorted(found - current.keys()):
            client = self.make_client(address)
            client.start()
            self.shards.append(client)
            log.info("shard discovered", extra={"shard": address})
        for address, client in current.items():
            if address in found:
                self._missing.pop(address, None)
                continue
            self._missing[address] = self._missing.get(address, 0) + 1
            if self._missing[address] >= self.remove_after:
                del self._missing[address]
                self._remove(client)

    def _remove(self, client: ShardClient) -> None:
        self.shards.remove(client)  # out of rotation: pick_shard never sees it again
        self.on_removed(client.address)
        log.info("shard left discovery; draining", extra={"shard": client.address,
                                                           "in_flight": client.view.in_flight,
                                                           "drain_timeout_s": self.drain_timeout_s})
        task = asyncio.create_task(self._drain(client), name=f"drain {client.address}")
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _drain(self, client: ShardClient) -> None:
        deadline = asyncio.get_running_loop().time() + self.drain_timeout_s
        try:
            while client.view.in_flight > 0 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.1)
        finally:
            left = client.view.in_flight
            client._mark_down("removed by shard discovery")  # what is left fails over
            await client.close()
            log.info("shard drained and closed", extra={"shard": client.address, "failed_in_flight": left})

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - discovery must outlive any one bad round
                log.exception("shard discovery round failed")

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="shard discovery")

    async def stop(self) -> None:
        """Stops resolving and finishes pending drains at once (their leftovers fail with UNAVAILABLE)."""
        tasks = [t for t in (self._task, *self._draining) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
