"""The HTTP/1.1 connection protocol of the HTTP API: uvicorn's h11 protocol with two fixes.

- TCP_NODELAY on every connection. h11 writes a response's head and its body in separate sends. asyncio turns
  Nagle's algorithm off only on sockets whose `proto` is IPPROTO_TCP, and a socket from `socket.create_server` (ours:
  bound up front, see server.py) has proto 0, as do the connections it accepts. So the body waited for the client's
  ACK of the head, which a kept-alive connection's client delays up to 40 ms: every request after a connection's
  first took ~44 ms instead of ~1 ms.
- A deadline for a request's head. uvicorn times out only idle kept-alive connections (`timeout_keep_alive`), and
  the first byte of a request cancels even that: a client that opens connections and sends their headers a byte at
  a time (slowloris) held each one open forever. A connection whose request head is not complete `head_timeout_s`
  after it opened (or after the first byte of a later request on it) is closed.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def protocol_class(head_timeout_s: float) -> type[H11Protocol]:
    """The protocol class for uvicorn's `http=` setting, with this head deadline."""

    class Protocol(_ApiProtocol):
        pass

    Protocol.head_timeout_s = head_timeout_s
    return Protocol


class _ApiProtocol(H11Protocol):
    head_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm_head_timer()  # a new request's first bytes: its head must be complete in time
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:  # never re-armed by later bytes: trickling them buys no time
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("http connection closed: no complete request head in time",
                     extra={"client": "%s:%d" % self.client if self.client else None,
                            "head_timeout_s": self.head_timeout_s})
            self.transport.close()
