"""Children of `kimiserve up` stop when `up` dies, even when it is SIGKILLed (Linux: PR_SET_PDEATHSIG).

`up` puts its pid into each child's environment (KIMISERVE_PARENT_PID); the child, first thing in
kimiserve/command.py, asks the kernel to send it SIGTERM when that parent dies, so a killed `up` leaves no orphan
holding its ports.

Why in the child at startup and not in a Popen `preexec_fn`: preexec_fn runs Python between fork and exec, which
can deadlock a process that has threads, and `up` has gRPC's. Why SIGTERM and not SIGKILL: the child stops as on any
stop (the router drains and releases its batch leases). The kernel sends the signal when the *thread* that started
the child exits, so children must be started from a thread that lives as long as they should (up's main thread).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)
PARENT_PID_ENV = "KIMISERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def child_env() -> dict[str, str]:
    """The environment for a child that should stop when this process dies."""
    return {**os.environ, PARENT_PID_ENV: str(os.getpid())}


def follow_parent() -> None:
    """Called once at startup: if started by `up`, get SIGTERM when it dies. Exits at once if it already has."""
    parent = os.environ.pop(PARENT_PID_ENV, None)  # popped: this process's own children are not up's
    if parent is None:
        return
    if not sys.platform.startswith("linux"):
        log.warning("this child keeps running if `kimiserve up` is killed (no PR_SET_PDEATHSIG on %s)",
                    sys.platform)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != int(parent):  # `up` died between our fork and the prctl: no one would signal us
        raise SystemExit(f"kimiserve: the parent `kimiserve up` (pid {parent}) exited before this child started")
