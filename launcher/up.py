"""`kimiserve up`: the whole stack on localhost as child processes (tokenizer, N shards, router), supervised.

Waits until every service answers SERVING on grpc.health.v1 and prints the router address and metrics URLs. A child
that exits is restarted on the same ports with backoff while the others keep serving (launcher/supervisor.py);
after repeated quick failures `up` stops the stack and exits 1. On Ctrl-C / SIGTERM, also during startup, it stops
the router first (it drains in-flight requests for --drain-timeout), then the shards, then the tokenizer, and exits
0. Children get SIGTERM from the kernel if `up` itself is killed (kimiserve/lifeline.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kimiserve.devices import DEVICE_HELP, shard_devices
from kimiserve.internal_auth import is_loopback, write_token
from kimiserve.lifeline import child_env
from kimiserve.ports import PortInUse, check_free, free_ports
from kimiserve.private_files import private_dir
from kimiserve.security import SecurityConfigError, server_tls_from_args
from launcher.health import is_serving
from launcher.supervisor import GaveUp, RestartPolicy, Supervisor, describe_exit
from router.http.origin import ANY_HOST, LOCAL_HOSTS, allowed_hosts
from router.main import DRAIN_TIMEOUT_S

log = logging.getLogger(__name__)
# The trained Kimi-Linear model committed under models/ (training/train.py), next to this package in a checkout.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "kimi-linear-austen"
# How long a stopping child may take before it is killed. The router: its drain, then closing its shard streams,
# discovery and batch store. A shard: its engine loop's stop (60 s, shard_svc/server/main.py) and server grace (5 s);
# it is idle by then, as the router stopped first. The tokenizer: its --grace-s (5 s).
ROUTER_TEARDOWN_S = 10.0
SHARD_STOP_S = 70.0
TOKENIZER_STOP_S = 15.0
STOP_ORDER = ("router", "shard", "tokenizer")
INTERNAL_HOST = "127.0.0.1"  # where the tokenizer and shards listen: only the router, on this machine, calls them


class StartupInterrupted(Exception):
    """A stop was asked for while the stack was starting; every child already started has been stopped."""


class ChildFailed(RuntimeError):
    """A child exited before it was SERVING."""


class DefaultModelMissing(FileNotFoundError):
    """`up` without --model, where the committed default model is not next to the package (e.g. a wheel install)."""


class NotAServableModel(FileNotFoundError):
    """--model is not a checkpoint directory the stack can serve (no config.json, no tokenizer files)."""


class OpenToTheNetwork(SecurityConfigError):
    """--host beyond loopback without API keys (and without --allow-unauthenticated)."""


@dataclass
class Child:
    name: str  # tokenizer | shard-I | router
    address: str
    metrics_url: str
    proc: subprocess.Popen
    cmd: list[str]
    stop_grace_s: float
    health_address: str = ""  # where grpc.health.v1 answers in plaintext: `address`, or a TLS router's health port

    def __post_init__(self) -> None:
        self.health_address = self.health_address or self.address

    @property
    def role(self) -> str:
        return self.name.split("-", 1)[0]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def restart(self) -> None:
        """Starts the same command again (same ports), e.g. after the process died."""
        self.proc = _popen(self.cmd)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint dir (default: the trained models/kimi-linear-austen of the checkout)")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--device", default="auto",
                   help=f"{DEVICE_HELP}; shard i gets cuda:i (with groups of N ranks, cuda:i*N..) "
                        "(default: %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="each shard is a group: attention heads split tp ways")
    p.add_argument("--ep", type=int, default=1,
                   help="each shard is a group: routed experts split ep ways (max(tp, ep) processes per shard)")
    p.add_argument("--port", type=int, default=50051, help="router port")
    p.add_argument("--host", default="127.0.0.1",
                   help="address of the router's public ports (gRPC and HTTP); the tokenizer and shards always "
                        "listen on 127.0.0.1. Beyond loopback it needs --api-keys-file (or --allow-unauthenticated)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help="on stop, the router's in-flight requests may finish this long (passed to the router)")
    p.add_argument("--max-failovers", type=int, default=None, metavar="N",
                   help="times one stream may move to another shard when its shard dies or leaves (passed to the "
                        "router; unset: the router's default)")
    p.add_argument("--max-restarts", type=_at_least_one, default=RestartPolicy.max_failures,
                   help="a child failing this many times in a row, each soon after its start, stops the stack "
                        "(exit 1)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the router's OpenAI-compatible HTTP API on --host at this port; 0: off")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="where this stack keeps its state (the batch database); default: "
                        "$XDG_CACHE_HOME/kimiserve/stack-HOST-PORT, so two stacks never share one")
    public = p.add_argument_group("the router's public ports (passed to the router)")
    public.add_argument("--api-keys-file", type=Path, default=None,
                        help="API keys, one per line: clients must send `authorization: Bearer <key>`")
    public.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: serve gRPC and HTTP over TLS")
    public.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    public.add_argument("--client-ca", type=Path, default=None,
                        help="PEM CA bundle: require client certificates signed by it (mTLS); needs --tls-cert")
    public.add_argument("--http-allowed-hosts", type=allowed_hosts, default=(), metavar="HOST,...",
                        help="without API keys, the Host / Origin names the HTTP API accepts besides localhost, "
                             "127.0.0.1, ::1 (and --host); `*`: any")
    public.add_argument("--allow-unauthenticated", action="store_true",
                        help="serve a non-loopback --host without --api-keys-file: anyone who can reach it may use it")
    shard = p.add_argument_group("shard capacity (passed to every shard; unset: the shard's own default, see "
                                 "`kimiserve shard --help`)")
    for flag, kind in SHARD_FLAGS:
        shard.add_argument(flag, type=kind, default=None)
    shard.add_argument("--batch-invariant", action="store_true",
                       help="shards whose ops round a token's rows alike in any pass: prefix-cache restores give a "
                            "cold prompt's bits (Triton backend)")


# Shard flags `up` passes through when given.
SHARD_FLAGS = (("--num-state-slots", int), ("--num-kv-blocks", int), ("--kv-block-size", int),
               ("--prefill-token-budget", int), ("--prefill-policy", str), ("--long-prefill-threshold", int),
               ("--long-prefill-floor", int), ("--mixed-prefill-cost", int), ("--max-model-len", int),
               ("--prefix-cache-entries", int), ("--prefix-state-interval", int), ("--prefix-host-entries", int),
               ("--host-kv-gb", str), ("--op-backend", str), ("--gpu-memory-utilization", float))


def shard_flags(args: argparse.Namespace) -> tuple[str, ...]:
    out: list[str] = []
    for flag, _ in SHARD_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [flag, str(value)]
    if args.batch_invariant:
        out.append("--batch-invariant")
    return tuple(out)


def state_dir(args: argparse.Namespace) -> Path:
    if args.state_dir is not None:
        return args.state_dir
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kimiserve" / f"stack-{args.host}-{args.port}"


def ensure_default_model() -> Path:
    """The trained default model of the source checkout; a named error where it is not there."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise DefaultModelMissing(
            f"the default model {DEFAULT_MODEL_DIR} is not there (it comes with a source checkout of kimiserve); "
            "pass --model DIR, or write a random tiny one with `kimiserve make-tiny --family kimi_k3 --out DIR`")
    return DEFAULT_MODEL_DIR


def check_model_dir(model: Path) -> None:
    """Refuses, before any child starts, a --model that cannot be served, naming what is missing (a child's failure
    would say the same only after the stack had half started)."""
    from kimiserve.tokenizer_files.loading import TIKTOKEN_MODEL, TOKENIZER_JSON, has_tokenizer

    if not (model / "config.json").is_file():
        raise NotAServableModel(f"--model {model}: no config.json there, so it is not a checkpoint directory")
    if not has_tokenizer(model):
        raise NotAServableModel(f"--model {model}: neither {TOKENIZER_JSON} nor {TIKTOKEN_MODEL} is there, and the "
                                "stack serves text (`kimiserve generate --prompt-ids` runs a checkpoint without them)")


def _popen(cmd: list[str]) -> subprocess.Popen:
    # A session of its own: a terminal's Ctrl-C reaches only `up`, which stops the router first so it drains.
    # child_env: the child gets SIGTERM if this process dies (kimiserve/lifeline.py).
    return subprocess.Popen(cmd, start_new_session=True, env=child_env())


def _spawn(name: str, args: list[str], host: str, port: int, metrics_port: int, stop_grace_s: float,
           health_port: int | None = None) -> Child:
    cmd = [sys.executable, "-m", "launcher.cli", *args, "--host", host, "--port", str(port),
           "--metrics-port", str(metrics_port), *(("--health-port", str(health_port)) if health_port else ())]
    child = Child(name, f"{host}:{port}", f"http://{host}:{metrics_port}/metrics", _popen(cmd), cmd, stop_grace_s,
                  f"{host}:{health_port}" if health_port else "")
    log.info("child started", extra={"child": name, "pid": child.pid, "address": child.address,
                                     "metrics_url": child.metrics_url})
    return child


def _check_stop(stop: threading.Event, what: str) -> None:
    if stop.is_set():
        raise StartupInterrupted(f"stop requested while {what}")


def _wait_serving(child: Child, timeout: float, stop: threading.Event) -> None:
    end = time.monotonic() + timeout
    while not is_serving(child.health_address):
        _check_stop(stop, f"waiting for {child.name} at {child.address}")
        if child.poll() is not None:
            raise ChildFailed(f"{child.name} (pid {child.pid}, {child.address}) exited before it was SERVING: "
                              f"{describe_exit(child.poll())}")
        if time.monotonic() > end:
            raise TimeoutError(f"{child.name} at {child.address} was not SERVING after {timeout:.0f} s")
        stop.wait(0.2)


def start_stack(model: Path, shards: int, device: str, host: str, port: int, timeout: float,
                shard_args: tuple[str, ...] = (), router_args: tuple[str, ...] = (), tp: int = 1,
                ep: int = 1, drain_timeout_s: float = DRAIN_TIMEOUT_S,
                stop: threading.Event | None = None, internal_token_file: Path | None = None,
                router_health_port: bool = False) -> list[Child]:
    """Starts tokenizer, shards, then the router; returns them with the router last. The router listens on `host`;
    the tokenizer and shards on 127.0.0.1 (only the router calls them), and with `internal_token_file` all four
    share that token, so that no other caller is served there. `router_health_port`: the router also serves
    plaintext health on a port of its own (needed to see it SERVING when its public port speaks TLS).

    `stop` set while starting: every child started so far is stopped and StartupInterrupted raised. Call from a
    thread that outlives the children (see kimiserve/lifeline.py)."""
    stop = stop or threading.Event()
    children: list[Child] = []
    internal = INTERNAL_HOST
    ports = iter(p for p in free_ports(2 * shards + 5, internal) if p != port)
    token_args = ("--internal-token-file", str(internal_token_file)) if internal_token_file else ()
    try:
        _check_stop(stop, "starting the tokenizer")
        children.append(_spawn("tokenizer", ["tokenizer", "--model", str(model), *token_args], internal, next(ports),
                               next(ports), TOKENIZER_STOP_S))
        group = max(tp, ep)  # devices per shard: a shard group of max(tp, ep) ranks (shard_svc/parallel)
        group_args = ("--tp", str(tp), "--ep", str(ep)) if group > 1 else ()
        for i, dev in enumerate(shard_devices(device, shards, group)):
            _check_stop(stop, f"starting shard-{i}")
            children.append(_spawn(f"shard-{i}", ["shard", "--model", str(model), "--device", dev, *group_args,
                                                  "--shard-name", f"shard-{i}", *token_args, *shard_args], internal,
                                   next(ports), next(ports), SHARD_STOP_S))
        for child in children:
            _wait_serving(child, timeout, stop)
        _check_stop(stop, "starting the router")
        router = _spawn_router("router", children, host, port, next(ports), drain_timeout_s,
                               (*token_args, *router_args), next(ports) if router_health_port else None)
        children.append(router)
        _wait_serving(router, timeout, stop)
    except BaseException:
        stop_stack(children)
        raise
    return children


def _spawn_router(name: str, children: list[Child], host: str, port: int, metrics_port: int, drain_timeout_s: float,
                  args: tuple[str, ...], health_port: int | None) -> Child:
    shard_addrs = ",".join(c.address for c in children if c.role == "shard")
    return _spawn(name, ["router", "--tokenizer", children[0].address, "--shards", shard_addrs, "--drain-timeout",
                         str(drain_timeout_s), *args], host, port, metrics_port, drain_timeout_s + ROUTER_TEARDOWN_S,
                  health_port=health_port)


def start_router_replica(children: list[Child], name: str, host: str, port: int, timeout: float,
                         router_args: tuple[str, ...] = ()) -> Child:
    """Another router in front of the tokenizer and shards of a started stack (as the chart runs several replicas),
    once SERVING; the caller stops it (stop_stack)."""
    router = _spawn_router(name, children, host, port, free_ports(1, INTERNAL_HOST)[0], DRAIN_TIMEOUT_S,
                           router_args, None)
    try:
        _wait_serving(router, timeout, threading.Event())
    except BaseException:
        stop_stack([router])
        raise
    return router


def stop_stack(children: list[Child], grace_s: float | None = None) -> None:
    """Router first so it drains, then the shards together, then the tokenizer: SIGTERM, then SIGKILL after each
    child's stop grace (`grace_s`, if given, for every child)."""
    for role in STOP_ORDER:
        group = [c for c in children if c.role == role and c.poll() is None]
        for child in group:
            child.proc.send_signal(signal.SIGTERM)
        for child in group:
            grace = child.stop_grace_s if grace_s is None else grace_s
            try:
                child.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("child did not stop in time; killing", extra={"child": child.name, "pid": child.pid,
                                                                          "grace_s": grace})
                child.proc.kill()
                child.proc.wait()


def check_public_host(args: argparse.Namespace) -> None:
    """Refuses a --host other machines can reach when nothing would tell their callers apart (no API keys)."""
    if is_loopback(args.host) or args.api_keys_file is not None:
        return
    if not args.allow_unauthenticated:
        raise OpenToTheNetwork(f"--host {args.host} serves the router's ports to other machines, and without "
                               "--api-keys-file anyone who reaches them may use the stack; give --api-keys-file FILE, "
                               "or pass --allow-unauthenticated to serve them anyway")
    log.warning("serving the public ports beyond loopback without API keys (--allow-unauthenticated)",
                extra={"host": args.host})


def public_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The router flags of `up`'s public-port options (keys, TLS, the HTTP API's allowed hosts)."""
    out: list[str] = []
    for flag, value in (("--api-keys-file", args.api_keys_file), ("--tls-cert", args.tls_cert),
                        ("--tls-key", args.tls_key), ("--client-ca", args.client_ca)):
        if value is not None:
            out += [flag, str(value)]
    hosts = list(args.http_allowed_hosts)
    if ANY_HOST not in hosts:
        # The address the API is served on is one its clients will name; a wildcard is not.
        extra = [] if args.host in ("0.0.0.0", "::", "") else [args.host]
        hosts = [*LOCAL_HOSTS, *extra, *hosts]
    out += ["--http-allowed-hosts", ",".join(dict.fromkeys(hosts))]
    return tuple(out)


def check_http_port(host: str, port: int) -> None:
    """Refuses at once, before starting anything, when the HTTP API's port is taken (another stack, another server)."""
    try:
        check_free(host, port, "HTTP API")
    except PortInUse:
        raise PortInUse(f"the HTTP API port {host}:{port} is not free; pass --http-port N for another port, or "
                        "--http-port 0 to turn the HTTP API off") from None


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()

    def on_signal(signum: int, _frame) -> None:
        log.info("stop requested", extra={"signal": signal.Signals(signum).name})
        stop.set()

    # Before anything starts: a signal during startup must stop what was started, not kill `up` and orphan it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    check_public_host(args)
    server_tls_from_args(args)  # the router would refuse a half-given TLS pair too, but only after the stack started
    check_free(args.host, args.port, "router")
    if args.http_port:
        check_http_port(args.host, args.http_port)
    model = args.model or ensure_default_model()
    check_model_dir(model)
    state = state_dir(args)
    private_dir(state)  # the batch database (tenants' prompts and outputs) and the internal token
    # A fresh token each run, readable by this user only: no other local user (or process of another user) can
    # call the tokenizer or the shards, whose ports are on 127.0.0.1 like anyone's.
    token = write_token(state / "internal-token")
    try:
        children = start_stack(model, args.shards, args.device, args.host, args.port, args.startup_timeout,
                               shard_args=shard_flags(args),
                               router_args=("--batch-db", str(state / "batches.sqlite3"),
                                            *(("--http-port", str(args.http_port)) if args.http_port else ()),
                                            *(("--max-failovers", str(args.max_failovers))
                                              if args.max_failovers is not None else ()),
                                            *public_flags(args)),
                               tp=args.tp, ep=args.ep, drain_timeout_s=args.drain_timeout, stop=stop,
                               internal_token_file=token, router_health_port=args.tls_cert is not None)
    except StartupInterrupted as e:
        log.info("stopped during startup", extra={"reason": str(e)})
        return 0
    except (ChildFailed, TimeoutError) as e:
        log.error("the stack did not start", extra={"error": str(e)})
        return 1
    router = children[-1]
    lines = [f"kimiserve is up: router at {router.address}  (try: kimiserve chat \"Hello\" --router "
             f"{router.address})"]
    if args.http_port:
        scheme = "https" if args.tls_cert else "http"
        lines.append(f"  OpenAI-compatible HTTP API at {scheme}://{args.host}:{args.http_port}/v1")
    lines += [f"  {c.name:<10} {c.address:<22} metrics {c.metrics_url}" for c in children]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    supervisor = Supervisor(children, RestartPolicy(max_failures=args.max_restarts))
    try:
        while not stop.wait(0.5):
            supervisor.check()
    except GaveUp as e:
        log.error("stopping the stack: a child cannot be kept running", extra={"error": str(e)})
        stop_stack(children)
        return 1
    stop_stack(children)
    log.info("stack stopped", extra={"restarts": supervisor.restarts})
    return 0
