"""Restarting the children of `kimiserve up`: a child that exits is started again, on the same ports, after an
exponential backoff, while the others keep serving.

A failure is "quick" when the child ran less than `stable_s` since its last start. After `max_failures` quick
failures in a row `up` gives up (GaveUp): something is wrong that restarting will not fix (a missing checkpoint, a
port taken by another program), and a supervisor above `up` (systemd, a container runtime) must see it exit non-zero.
A child that stayed up `stable_s` has its count reset, so a rare crash after hours is always restarted.

A child that exits 0 stopped cleanly: a service exits 0 only when told to stop (SIGTERM) and done draining, as a
shard does in a rolling restart. It is started again at once and the exit is not a failure: no backoff, and it does
not count towards giving up.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from launcher.health import is_serving

log = logging.getLogger(__name__)


class Supervised(Protocol):
    name: str
    address: str
    health_address: str  # where plaintext grpc.health.v1 answers (a TLS router's health port)

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def restart(self) -> None: ...


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 0.5  # first restart delay, doubled after each quick failure
    max_backoff_s: float = 30.0
    stable_s: float = 60.0  # up this long: earlier failures are forgiven
    max_failures: int = 5  # quick failures in a row before giving up

    def delay(self, failures: int) -> float:
        return min(self.backoff_s * 2 ** (failures - 1), self.max_backoff_s)


class GaveUp(Exception):
    """A child failed `max_failures` times in a row, each soon after its start."""


def describe_exit(returncode: int) -> dict[str, object]:
    """{"exit_code": N} or {"signal": "SIGKILL"} (Popen reports death by signal N as -N)."""
    if returncode < 0:
        try:
            return {"signal": signal.Signals(-returncode).name}
        except ValueError:
            return {"signal": -returncode}
    return {"exit_code": returncode}


@dataclass
class _Watch:
    started_at: float
    failures: int = 0  # quick failures in a row
    restart_at: float | None = None  # set while the child is dead and waiting for its restart
    down_since: float | None = None
    serving: bool = True  # SERVING since its last start (children are handed over SERVING)


class Supervisor:
    """Call `check()` periodically from the thread that started the children (see kimiserve/lifeline.py)."""

    def __init__(self, children: list[Supervised], policy: RestartPolicy = RestartPolicy(),
                 clock: Callable[[], float] = time.monotonic,
                 serving: Callable[[str], bool] = is_serving) -> None:
        self.children, self.policy, self._clock, self._serving = children, policy, clock, serving
        now = clock()
        self._watch = {c.name: _Watch(started_at=now) for c in children}
        self.restarts = 0

    def check(self) -> None:
        """Restarts children that are due; raises GaveUp when one has failed too often."""
        now = self._clock()
        for child in self.children:
            w = self._watch[child.name]
            if w.restart_at is not None:
                if now >= w.restart_at:
                    self._restart(child, w, now)
                continue
            returncode = child.poll()
            if returncode is None:
                self._alive(child, w, now)
            else:
                self._exited(child, w, returncode, now)

    def _alive(self, child: Supervised, w: _Watch, now: float) -> None:
        if not w.serving and self._serving(child.health_address):
            w.serving = True
            log.info("child serving again", extra={"child": child.name, "pid": child.pid,
                                                   "down_s": round(now - w.down_since, 3)})
        if w.failures and now - w.started_at >= self.policy.stable_s:
            w.failures = 0

    def _exited(self, child: Supervised, w: _Watch, returncode: int, now: float) -> None:
        uptime = now - w.started_at
        if returncode == 0:
            w.down_since, w.serving, w.restart_at = now, False, now
            log.info("child stopped cleanly; restarting", extra={"child": child.name, "pid": child.pid,
                                                                  "uptime_s": round(uptime, 3)})
            return
        if uptime >= self.policy.stable_s:
            w.failures = 0
        w.failures += 1
        how = describe_exit(returncode)
        if w.down_since is None or w.serving:
            w.down_since = now
        w.serving = False
        if w.failures >= self.policy.max_failures:
            log.error("child keeps failing; giving up", extra={"child": child.name, "pid": child.pid, **how,
                                                               "failures": w.failures})
            raise GaveUp(f"{child.name} exited {w.failures} times in a row, each within "
                         f"{self.policy.stable_s:g} s of its start (last: {how}); giving up")
        delay = self.policy.delay(w.failures)
        w.restart_at = now + delay
        log.warning("child exited; restarting", extra={"child": child.name, "pid": child.pid, **how,
                                                        "uptime_s": round(uptime, 3), "attempt": w.failures,
                                                        "restart_in_s": delay})

    def _restart(self, child: Supervised, w: _Watch, now: float) -> None:
        child.restart()
        self.restarts += 1
        w.started_at, w.restart_at = now, None
        log.info("child restarted", extra={"child": child.name, "pid": child.pid, "address": child.address,
                                           "attempt": w.failures})
