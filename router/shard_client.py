"""One shard as the router sees it: a long-lived Stream multiplexing sequences by request id, a poller for Load
and health, and the shard's slice of the balancer's view.

A shard whose health answers NOT_SERVING, or that sends a Moved event, is draining (SIGTERM, a rolling restart): it
leaves rotation for new sequences and hands the ones it runs over (ShardMoved; router/failover.py moves their states
with `export_state` and the next shard's `import_state`). When the stream ends or breaks, or the probes fail
PROBES_TO_FAIL times in a row (a hung or unreachable shard), the shard leaves rotation and every sequence still on it
gets ShardLost, which router/generation.py answers by failing the sequence over to another shard. The poller keeps
probing and puts the shard back once it is SERVING again.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kimiserve.v1 import shard_pb2, shard_pb2_grpc
from router.balancer import ShardView
from router.errors import ShardLost, ShardMoved, ShardUnavailable, from_shard

log = logging.getLogger(__name__)
# A busy shard can answer a probe late; only several misses in a row (or a broken stream) take it out of rotation.
PROBE_TIMEOUT_S = 5.0
PROBES_TO_FAIL = 3


class ShardClient:
    def __init__(self, address: str, poll_interval_s: float = 0.5, channel: grpc.aio.Channel | None = None):
        self.address = address
        self.view = ShardView(address)
        self.info: shard_pb2.ShardInfoResponse | None = None
        self._poll_interval = poll_interval_s
        self._channel = channel or grpc.aio.insecure_channel(address)  # a TLS channel: kimiserve.security
        self._stub = shard_pb2_grpc.ShardStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._outbox: asyncio.Queue[shard_pb2.ShardRequest] | None = None
        self._inflight: dict[str, asyncio.Queue] = {}
        # Sequences sent after the Load request behind the view was asked and still running: the ones that answer
        # does not count (view.sent_since_poll is their number). One that finishes before the next answer leaves the
        # set, or a burst of short sequences would make an idle shard look full until the next poll.
        self._unreported: set[str] = set()
        self._stream_task: asyncio.Task | None = None
        self._poll_task: asyncio.Task | None = None
        self._failed_probes = 0
        self._refused_logged = False  # an UNAUTHENTICATED probe is logged once, at ERROR
        # The shard said it drains (_leave_rotation): out of rotation whatever a probe in flight says, until its
        # stream ends.
        self._handing_over = False

    def start(self) -> None:
        self._poll_task = asyncio.create_task(self._poll(), name=f"poll {self.address}")

    async def close(self) -> None:
        for task in (self._poll_task, self._stream_task):
            if task:
                task.cancel()
        await self._channel.close()

    # -- sequences ---------------------------------------------------------------------------------------------
    async def submit(self, submit: shard_pb2.ShardRequest.Submit) -> asyncio.Queue:
        """Sends a sequence; its ShardEvents (or a RouterError) arrive on the returned queue. Its id is unique among
        this router's live ids: Generation.run runs only ids claimed in router/request_ids.py LiveIds."""
        if not self.view.healthy or self._outbox is None:
            raise ShardUnavailable(f"shard {self.address} is not in rotation")
        events: asyncio.Queue = asyncio.Queue()
        self._inflight[submit.request_id] = events
        self.view.in_flight += 1
        self._unreported.add(submit.request_id)
        self.view.sent_since_poll = len(self._unreported)
        await self._outbox.put(shard_pb2.ShardRequest(submit=submit))
        return events

    async def cancel(self, request_id: str) -> None:
        if self._outbox is not None and request_id in self._inflight:
            await self._outbox.put(shard_pb2.ShardRequest(cancel=shard_pb2.ShardRequest.Cancel(request_id=request_id)))

    def forget(self, request_id: str) -> None:
        if self._inflight.pop(request_id, None) is not None:
            self.view.in_flight -= 1
        self._unreported.discard(request_id)
        self.view.sent_since_poll = len(self._unreported)

    # -- moving sequence states (router/failover.py) ------------------------------------------------------------
    def export_state(self, request_id: str, timeout_s: float):
        """The chunks of a state this (draining) shard holds for a moved sequence."""
        return self._stub.ExportState(shard_pb2.ExportStateRequest(request_id=request_id), timeout=timeout_s)

    async def import_state(self, chunks, timeout_s: float) -> shard_pb2.ImportStateResponse:
        return await self._stub.ImportState(chunks, timeout=timeout_s)

    # -- stream ------------------------------------------------------------------------------------------------
    async def _write(self, call, outbox: asyncio.Queue) -> None:
        """Requests go out through the call's write(), not an async generator handed to gRPC: gRPC would close
        such a generator from its own task when the stream breaks while it waits on the outbox, and log errors."""
        try:
            while True:
                await call.write(await outbox.get())
        except (asyncio.CancelledError, grpc.aio.AioRpcError, grpc.aio.UsageError):
            return  # the reading side sees the broken stream and reports it

    async def _run_stream(self, outbox: asyncio.Queue) -> None:
        call = self._stub.Stream()
        writer = asyncio.create_task(self._write(call, outbox), name=f"stream writer {self.address}")
        try:
            async for event in call:
                self._dispatch(event)
            reason, kind = "the shard closed its stream", "stream_ended"
        except grpc.aio.AioRpcError as e:
            reason, kind = f"stream broke: {e.code().name} {e.details()}", "stream_broke"
        except asyncio.CancelledError:
            call.cancel()
            return
        finally:
            writer.cancel()
        self._mark_down(reason, kind)

    def _dispatch(self, event: shard_pb2.ShardEvent) -> None:
        events = self._inflight.get(event.request_id)
        if events is None:
            log.error("shard event for an unknown request id", extra={"shard": self.address,
                                                                     "request_id": event.request_id,
                                                                     "kind": event.WhichOneof("kind")})
            return
        if event.WhichOneof("kind") == "error":
            refusal = from_shard(event.error)
            if event.error.code == shard_pb2.SHARD_ERROR_CODE_UNAVAILABLE:  # another shard can take it
                refusal = ShardLost(self.address, f"the shard refused it: {event.error.message}", "refused")
                if event.error.param != "imported_state":  # draining or failed, whatever a probe in flight says
                    self._leave_rotation("it refused a sequence as unavailable")
            events.put_nowait(refusal)
            self.forget(event.request_id)
            return
        if event.WhichOneof("kind") == "moved":
            self._leave_rotation("it hands its sequences over")
            events.put_nowait(ShardMoved(self.address, event.request_id, event.moved.computed_tokens,
                                         event.moved.state_bytes))
            self.forget(event.request_id)
            return
        events.put_nowait(event)
        if event.WhichOneof("kind") == "finished":
            self.forget(event.request_id)

    def _leave_rotation(self, why: str) -> None:
        """The shard said it drains (a Moved event, an UNAVAILABLE refusal): out of rotation before the next poll
        sees NOT_SERVING, and kept out until its stream ends, so no sequence is sent back to it meanwhile."""
        self._handing_over = True
        if self.view.healthy:
            self.view.healthy = False
            log.warning("shard draining: out of rotation", extra={"shard": self.address,
                                                                   "why": f"{why}; until its stream ends"})

    def _mark_down(self, reason: str, kind: str = "removed") -> None:
        """The shard's stream is gone: out of rotation, and each sequence on it told so (ShardLost), once. Its id
        is forgotten first, so nothing the old stream still delivers can reach the sequence after that."""
        if self._outbox is not None:
            log.warning("shard left rotation", extra={"shard": self.address, "reason": reason,
                                                      "lost_request_ids": list(self._inflight)})
        self.view.healthy = False
        self._handing_over = False  # the next stream is to a shard that serves again
        self._outbox = None
        self._stream_task = None
        for rid, events in list(self._inflight.items()):
            self.forget(rid)
            events.put_nowait(ShardLost(self.address, reason, kind))

    # -- polling -----------------------------------------------------------------------------------------------
    async def _probe(self) -> bool:
        """True: SERVING and the device op answered; False: the shard says NOT_SERVING (draining). Raises the
        AioRpcError of a probe that got no answer."""
        reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return False
        # grpc.health answers from its own thread whatever the engine and device do; the device op proves both.
        await self._stub.Health(shard_pb2.ShardHealthRequest(), timeout=PROBE_TIMEOUT_S)
        if self.info is None:
            self.info = await self._stub.Info(shard_pb2.ShardInfoRequest(), timeout=PROBE_TIMEOUT_S)
        asked = set(self._unreported)  # the answer is taken to count every sequence sent before it was asked
        load = await self._stub.Load(shard_pb2.ShardLoadRequest(), timeout=PROBE_TIMEOUT_S)
        self._unreported -= asked
        self.view.free_slots, self.view.queued, self.view.sent_since_poll = (
            load.free_state_slots, load.queued_seqs, len(self._unreported))
        return True

    async def _poll(self) -> None:
        while True:
            draining = False
            try:
                ok = await self._probe()
                draining = not ok
            except grpc.aio.AioRpcError as e:
                ok, reason = False, f"{e.code().name} {e.details()}"
                if e.code() == grpc.StatusCode.UNAUTHENTICATED and not self._refused_logged:
                    # Not a fault that time heals: the shard wants a token or certificate this router lacks.
                    self._refused_logged = True
                    log.error("shard refuses the router's calls: give the router the shards' --internal-token-file "
                              "(or a client certificate they accept)", extra={"shard": self.address,
                                                                               "reason": reason})
            self._failed_probes = 0 if ok or draining else self._failed_probes + 1
            if ok and not self.view.healthy and not self._handing_over:
                if self._outbox is None:  # no stream (a first start, a restart): a new one; a drain undone: the same
                    self._outbox = asyncio.Queue()
                    self._stream_task = asyncio.create_task(self._run_stream(self._outbox))
                self.view.healthy = True
                log.info("shard in rotation", extra={"shard": self.address})
            elif draining and self.view.healthy:
                self.view.healthy = False
                log.warning("shard draining: out of rotation", extra={
                    "shard": self.address, "why": "its health is NOT_SERVING; its running sequences go on there or "
                    "are handed over", "running_request_ids": list(self._inflight)})
            elif self._failed_probes >= PROBES_TO_FAIL and self._outbox is not None:
                if self._stream_task:
                    self._stream_task.cancel()
                self._mark_down(reason, "probes_failed")
            await asyncio.sleep(self._poll_interval)
