"""`kimiserve up`: the whole stack on localhost as child processes (tokenizer, N shards, router).

Waits until every service answers SERVING on grpc.health.v1, prints the router address and metrics URLs, and on
Ctrl-C / SIGTERM stops the router first (it drains in-flight requests), then the shards and the tokenizer.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from kimiserve.health import wait_serving
from kimiserve.ports import free_ports

log = logging.getLogger(__name__)
DEFAULT_MODEL_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kimiserve" / "tiny-k3"


@dataclass
class Child:
    name: str
    address: str
    metrics_url: str
    proc: subprocess.Popen
    cmd: list[str]

    def restart(self) -> None:
        """Starts the same command again (same ports), e.g. after the process died."""
        self.proc = subprocess.Popen(self.cmd, start_new_session=True)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the built-in tiny K3)")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu | cuda (shard i gets cuda:i; with groups, cuda:i*N..)")
    p.add_argument("--tp", type=int, default=1, help="each shard is a group: attention heads split tp ways")
    p.add_argument("--ep", type=int, default=1,
                   help="each shard is a group: routed experts split ep ways (max(tp, ep) processes per shard)")
    p.add_argument("--port", type=int, default=50051, help="router port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--startup-timeout", type=float, default=300.0)


def ensure_default_model() -> Path:
    """Builds the default tiny K3 checkpoint once and reuses it afterwards."""
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        from shard_svc.make_tiny import make_tiny

        log.info("building the default tiny K3 checkpoint", extra={"path": str(DEFAULT_MODEL_DIR)})
        tmp = DEFAULT_MODEL_DIR.with_name(DEFAULT_MODEL_DIR.name + ".tmp")
        make_tiny("kimi_k3", tmp, seed=0)
        tmp.rename(DEFAULT_MODEL_DIR)
    return DEFAULT_MODEL_DIR


def _spawn(name: str, args: list[str], host: str, port: int, metrics_port: int) -> Child:
    cmd = [sys.executable, "-m", "kimiserve.cli", *args, "--host", host, "--port", str(port),
           "--metrics-port", str(metrics_port)]
    # A session of its own: a terminal's Ctrl-C reaches only `up`, which stops the router first so it drains.
    proc = subprocess.Popen(cmd, start_new_session=True)
    return Child(name, f"{host}:{port}", f"http://{host}:{metrics_port}/metrics", proc, cmd)


def start_stack(model: Path, shards: int, device: str, host: str, port: int, timeout: float,
                shard_args: tuple[str, ...] = (), router_args: tuple[str, ...] = (), tp: int = 1,
                ep: int = 1) -> list[Child]:
    """Starts tokenizer, shards, then the router; returns them with the router last."""
    children: list[Child] = []
    ports = iter(p for p in free_ports(2 * shards + 4, host) if p != port)
    try:
        children.append(_spawn("tokenizer", ["tokenizer", "--model", str(model)], host, next(ports),
                               next(ports)))
        group = max(tp, ep)  # devices per shard: a shard group of max(tp, ep) ranks (shard_svc/parallel)
        group_args = ("--tp", str(tp), "--ep", str(ep)) if group > 1 else ()
        for i in range(shards):
            dev = f"cuda:{i * group}" if device == "cuda" else device
            children.append(_spawn(f"shard-{i}", ["shard", "--model", str(model), "--device", dev, *group_args,
                                                  "--shard-name", f"shard-{i}", *shard_args], host, next(ports),
                                   next(ports)))
        for child in children:
            wait_serving(child.address, timeout, alive=lambda c=child: c.proc.poll() is None)
        shard_addrs = ",".join(c.address for c in children if c.name.startswith("shard-"))
        router = _spawn("router", ["router", "--tokenizer", children[0].address, "--shards", shard_addrs,
                                   *router_args], host, port, next(ports))
        children.append(router)
        wait_serving(router.address, timeout, alive=lambda: router.proc.poll() is None)
    except BaseException:
        stop_stack(children)
        raise
    return children


def stop_stack(children: list[Child], grace_s: float = 30.0) -> None:
    """Router first so it drains, then the rest; SIGTERM, then SIGKILL after the grace period."""
    for child in sorted(children, key=lambda c: c.name != "router"):
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("child did not stop in time; killing", extra={"child": child.name})
                child.proc.kill()
                child.proc.wait()


def run(args: argparse.Namespace) -> int:
    model = args.model or ensure_default_model()
    children = start_stack(model, args.shards, args.device, args.host, args.port, args.startup_timeout,
                           tp=args.tp, ep=args.ep)
    router = children[-1]
    lines = [f"kimiserve is up: router at {router.address}  (try: kimiserve chat \"Hello\" --router "
             f"{router.address})"]
    lines += [f"  {c.name:<10} {c.address:<22} metrics {c.metrics_url}" for c in children]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):
        dead = [c.name for c in children if c.proc.poll() is not None]
        if dead:
            log.error("a service exited; stopping the stack", extra={"services": dead})
            break
    stop_stack(children)
    return 0
