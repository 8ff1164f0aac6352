"""`kimiserve shard`: load a checkpoint onto one device and serve it over gRPC, with Prometheus metrics."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kimiserve import internal_auth, security, tracing
from kimiserve.decode_guard import DecodeGuard
from kimiserve.devices import DEVICE_HELP, resolve_device
from kimiserve.ports import SERVER_OPTIONS, serve_metrics
from kimiserve.v1 import shard_pb2, shard_pb2_grpc
from shard_svc.build import EngineOptions, build_engine
from shard_svc.checkpoint import LOAD_FORMATS
from shard_svc.engine.capacity import (
    CPU_KV_BLOCK_SIZE, CPU_KV_BLOCKS, CPU_PREFILL_TOKEN_BUDGET, CPU_PREFIX_CACHE_ENTRIES, CPU_STATE_SLOTS,
    DEFAULT_GPU_MEMORY_UTILIZATION, ENTRY_EVERY, GPU_KV_BLOCK_SIZE, GPU_PREFILL_TOKEN_BUDGET, HOST_KV_SHARE,
    MIN_AUTO_PREFIX_ENTRIES, CapacityDoesNotFit, CapacityRequest)
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.handoff import STATE_HOLD_SECONDS
from shard_svc.engine.late_kernels import LateKernels
from shard_svc.engine.prefill_graphs import token_buckets
from shard_svc.engine.prefill_share import POLICIES, PrefillShare
from shard_svc.engine.prefix_cache import DEFAULT_PREFIX_STATE_INTERVAL
from shard_svc.engine.warmup import warm_request_paths
from shard_svc.errors import SchedulingConfigError
from shard_svc.parallel.launch import add_group_args
from shard_svc.server.engine_loop import EngineLoop
from shard_svc.server.group_loop import GroupEngineLoop
from shard_svc.server.metrics import ShardMetrics
from shard_svc.server.service import ShardService
from shard_svc.weight_streaming.metrics import StreamingMetrics  # --weights and --host-kv-gb
from shard_svc.weight_streaming.mode import add_weights_args, weights_args

log = logging.getLogger(__name__)
SERVICE_NAME = shard_pb2.DESCRIPTOR.services_by_name["Shard"].full_name


@dataclass(frozen=True)
class ShardServerConfig:
    shard_name: str
    host: str
    port: int
    metrics_port: int
    engine: EngineOptions  # model, device, capacity, weights, shard group: what build_engine builds
    tls: security.ServerTls | None = None  # TLS on the gRPC port; with a client CA, mTLS (router certs only)
    health_port: int | None = None  # plaintext grpc.health.v1-only port (kubelet probes when TLS is on)
    internal_token_file: Path | None = None  # its token is required on every call but health / reflection


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--shard-name", default="shard-0")
    p.add_argument("--device", default="auto", help=f"{DEVICE_HELP} (default: %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    p.add_argument("--metrics-port", type=int, default=9101)
    p.add_argument("--num-state-slots", type=int, default=None,
                   help="concurrent sequences (one KDA state slot each). Default: sized from memory on a GPU (see "
                        f"--gpu-memory-utilization), {CPU_STATE_SLOTS} on the CPU")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help=f"MLA KV cache blocks. Default: sized from memory on a GPU, {CPU_KV_BLOCKS} on the CPU")
    p.add_argument("--kv-block-size", type=int, default=None,
                   help=f"tokens per KV block. Default: {GPU_KV_BLOCK_SIZE} on a GPU, {CPU_KV_BLOCK_SIZE} on the CPU")
    p.add_argument("--prefill-token-budget", type=int, default=None,
                   help=f"new prompt tokens per prefill pass. Default: {GPU_PREFILL_TOKEN_BUDGET} on a GPU, "
                        f"{CPU_PREFILL_TOKEN_BUDGET} on the CPU")
    p.add_argument("--prefill-policy", choices=POLICIES, default="fair",
                   help="how a pass's budget is shared (docs/scheduling.md). fair: short prompts go into the next "
                        "pass whole, a long prompt takes what is left but at least --long-prefill-floor, and its "
                        "chunk is cut so a pass stays within --mixed-prefill-cost while others run; fcfs: the "
                        "running prompts in arrival order, each as much as the budget has left")
    p.add_argument("--long-prefill-threshold", type=int, default=None,
                   help="a prompt with more tokens left than this is long (default: half the budget)")
    p.add_argument("--long-prefill-floor", type=int, default=None,
                   help="tokens the oldest long prompt gets in every pass, whatever else waits (default: a "
                        "quarter of the budget)")
    p.add_argument("--mixed-prefill-cost", type=int, default=None,
                   help="the most a pass with a long prompt may cost while other sequences run, in "
                        "token-equivalents (a token at position p costs 1 + p / C, C from the model's shape); "
                        "bounds the decodes' inter-token latency (default: twice the budget)")
    p.add_argument("--fold-decodes", action="store_true",
                   help="while a long prompt prefills, run the step's decodes in its prefill pass (one pass per "
                        "step). Off by default: today's MLA prefill pads every row to the pass's longest context, "
                        "which makes such passes several times slower at long context (docs/scheduling.md)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (prompt + max_tokens) served. Default: the model's own maximum, capped by "
                        "what the KV cache holds for one sequence")
    p.add_argument("--host-kv-gb", type=_host_kv_gb, default=0.0,
                   help="host memory (GiB, pinned on a GPU) for the MLA KV cache of sequences moved off the device. "
                        "With it, admission may promise more KV than the device's blocks hold (up to device + host "
                        "minus one sequence's promise); when a step's blocks run short, whole sequences' KV pages "
                        "move to the host, the most recently admitted first, and those sequences wait until blocks "
                        "free up and their pages come back. 0: off, every promise stays on the device; auto: "
                        f"{HOST_KV_SHARE:g} of the host's available memory once the weights are placed")
    p.add_argument("--prefix-cache-entries", type=int, default=None,
                   help="cached prompt prefixes kept for reuse: each holds one KDA state slot (beside the "
                        "--num-state-slots of running sequences; about 41 MiB at the 48B shape), so this x a slot "
                        "bounds the cache's state memory (allocated at startup); each shares its prefix's KV blocks, "
                        "which admissions reclaim when they need them. The least valuable entry (hits x tokens, "
                        "aged) goes first. 0: no prefix cache. "
                        f"Default: one per {ENTRY_EVERY} state slots (at least {MIN_AUTO_PREFIX_ENTRIES} while "
                        "they fit in KDA state's share of the memory) when sized from memory on a GPU, "
                        f"{CPU_PREFIX_CACHE_ENTRIES} on the CPU")
    p.add_argument("--prefix-state-interval", type=int, default=None,
                   help="also snapshot the state every this many prompt tokens up to 16 of them, then twice as far "
                        "apart with every doubling of the position (the pass reaching a point copies the state "
                        "there into an entry slot), so a prompt sharing only the start of a cached one restores all "
                        "but less than this many or 1/16 of the shared tokens. A multiple of --kv-block-size; 0: only "
                        "at prompt ends, chat message boundaries and finishes. Default: "
                        f"{DEFAULT_PREFIX_STATE_INTERVAL}, rounded up to a multiple of the KV block size")
    p.add_argument("--prefix-host-entries", type=int, default=0,
                   help="host tier of the prefix cache: entries evicted from the device (their KDA state slot, KV "
                        "blocks and logits row) are copied to host memory (pinned on a GPU) instead of dropped, at "
                        "most this many (least recently used dropped first), and a hit there is copied back before "
                        "the request's prefill. Each holds a state slot's bytes plus its prefix's KV. 0: off")
    p.add_argument("--op-backend", default="auto", help="auto | eager | triton")
    p.add_argument("--batch-invariant", action="store_true",
                   help="ops that compute a token's rows alike whatever shares its pass (Triton backend): a prompt "
                        "restored from the prefix cache or prefilled in other chunks gives one pass's bits, at some "
                        "cost in speed (shard_svc/ops/batch_invariant.py)")
    p.add_argument("--load-format", choices=sorted(LOAD_FORMATS), default="safetensors",
                   help="dummy: random weights from config.json alone (benchmarks)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps or small prefill passes (default on CUDA when every op "
                        "they call is graph-safe)")
    p.add_argument("--prefill-graph-tokens", type=int, default=256,
                   help="prefill passes of at most this many tokens (and 8 sequences, without prefix-cache points "
                        "inside) replay CUDA graphs captured in pieces around the MLA attention, which runs eagerly "
                        "between them: a small pass costs its GPU time instead of the host's launches. A power of "
                        "two >= 16; 0: every prefill pass launched op by op")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch intra-op threads on a CPU device (tiny models run fastest single-threaded)")
    security.add_server_tls_args(p)
    internal_auth.add_server_args(p)
    add_group_args(p)
    add_weights_args(p)  # --weights resident|stream|auto, --prefetch-depth, --weight-slots, --pinned-memory-gb
    add_memory_args(p)


# -- capacity from memory (issue 25; shard_svc/engine/capacity.py) ---------------------------------------------------
def add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                   help="share of the GPU's total memory the shard may use: what the weights, the profiled "
                        "activation peak and the decode graphs leave of it goes to state slots, prefix-cache entries "
                        "and KV blocks (capacity flags that are set are taken as they are). Not used on the CPU "
                        "(default: %(default)s)")


def _host_kv_gb(text: str) -> float | None:
    """--host-kv-gb: GiB, or `auto` (None: sized from the host's memory)."""
    return None if text == "auto" else float(text)


def capacity_from_args(args: argparse.Namespace) -> CapacityRequest:
    host_kv = None if args.host_kv_gb is None else int(args.host_kv_gb * (1 << 30))
    request = CapacityRequest(args.num_state_slots, args.num_kv_blocks, args.prefix_cache_entries,
                              args.prefill_token_budget, args.max_model_len, args.gpu_memory_utilization, host_kv,
                              args.kv_block_size)
    try:
        request.check()
    except CapacityDoesNotFit as e:
        raise SystemExit(f"shard: {e}") from e
    return request
# -- end of capacity from memory ---------------------------------------------------------------------------------------


def config_from_args(args: argparse.Namespace) -> ShardServerConfig:
    device = resolve_device(args.device)
    on_gpu = device.startswith("cuda")
    block_size = args.kv_block_size or (GPU_KV_BLOCK_SIZE if on_gpu else CPU_KV_BLOCK_SIZE)
    interval = args.prefix_state_interval
    if interval is None:
        interval = -(-DEFAULT_PREFIX_STATE_INTERVAL // block_size) * block_size
    if (args.prefix_cache_entries or 0) < 0 or interval < 0 or interval % block_size:
        raise SystemExit(f"--prefix-cache-entries must be >= 0 (got {args.prefix_cache_entries}) and "
                         f"--prefix-state-interval >= 0 and a multiple of the KV block size {block_size} "
                         f"(got {interval})")
    if args.prefix_host_entries < 0 or (args.prefix_host_entries and args.prefix_cache_entries == 0):
        raise SystemExit(f"--prefix-host-entries must be >= 0 (got {args.prefix_host_entries}) and needs "
                         f"--prefix-cache-entries > 0 (got {args.prefix_cache_entries}): the host tier keeps entries "
                         "evicted from the device cache")
    try:
        PrefillShare(args.prefill_token_budget or (GPU_PREFILL_TOKEN_BUDGET if on_gpu else CPU_PREFILL_TOKEN_BUDGET),
                     args.prefill_policy, args.long_prefill_threshold, args.long_prefill_floor,
                     args.mixed_prefill_cost)
    except SchedulingConfigError as e:
        raise SystemExit(f"shard: {e}") from None
    try:
        token_buckets(args.prefill_graph_tokens)
    except ValueError as e:
        raise SystemExit(f"shard: --prefill-graph-tokens: {e}") from None
    request = capacity_from_args(args)
    # Only what is not sized once the weights are placed (shard_svc/engine/sizing.py) is read from this config.
    capacity = EngineConfig(max_model_len=args.max_model_len,
                            host_kv_bytes=request.host_kv_bytes or 0,
                            prefix_state_interval=interval,
                            prefix_host_entries=args.prefix_host_entries, prefill_policy=args.prefill_policy,
                            long_prefill_threshold=args.long_prefill_threshold,
                            long_prefill_floor=args.long_prefill_floor, mixed_prefill_cost=args.mixed_prefill_cost,
                            fold_decodes=args.fold_decodes, prefill_graph_tokens=args.prefill_graph_tokens)
    engine = EngineOptions(args.model, device, args.dtype, args.op_backend, args.load_format,
                           capacity, weights_args(args), args.enforce_eager, warm_up=True, tp=args.tp, ep=args.ep,
                           batch_invariant=args.batch_invariant,
                           group_timeout_s=args.group_timeout, cpu_threads=args.cpu_threads, capacity=request)
    tls = security.server_tls_from_args(args)
    token_file = internal_auth.check_server_args(args, args.host, tls, "shard")
    return ShardServerConfig(args.shard_name, args.host, args.port, args.metrics_port, engine, tls,
                             args.health_port, token_file)


def build_server(cfg: ShardServerConfig) -> tuple[grpc.Server, EngineLoop, health.HealthServicer]:
    # Read before the checkpoint loads: a bad token file fails at once (kimiserve/internal_auth.py).
    token = internal_auth.read_token(cfg.internal_token_file) if cfg.internal_token_file else None
    device = torch.device(cfg.engine.device)
    metrics = ShardMetrics(cfg.shard_name)
    # Weight streaming and host KV pages report on the shard's registry (one process; a group streams nothing).
    built = build_engine(cfg.engine, StreamingMetrics(metrics.registry, cfg.shard_name))
    engine, model_cfg = built.engine, built.engine.cfg
    capacity = engine.advertised_cfg  # as sized once the weights were placed (shard_svc/engine/sizing.py)
    # A shard group's rank 0 faces the router and keeps the followers in step (shard_svc/server/group_loop.py).
    loop = EngineLoop(engine, metrics) if built.leader is None else GroupEngineLoop(built.leader, metrics)
    if cfg.engine.warm_up and built.leader is None and engine.device.type == "cuda":
        late = LateKernels(metrics.kernel_after_warmup)
        late.install()

        def warm_then_watch(engine: Engine) -> None:
            warm_request_paths(engine)  # the first request's paths, on the thread that will serve it
            late.watch()

        loop.before_serving = warm_then_watch
    info = shard_pb2.ShardInfoResponse(
        model_name=Path(cfg.engine.model_dir).name, model_type=model_cfg.model_type, vocab_size=model_cfg.vocab_size,
        eos_token_ids=list(model_cfg.eos_token_ids), shard_id=cfg.shard_name, device=str(device),
        capacity=shard_pb2.ShardCapacity(
            state_slots=capacity.num_state_slots, kv_blocks=capacity.num_kv_blocks,
            kv_block_size=capacity.kv_block_size, max_context_tokens=engine.max_model_len,
            max_step_tokens=capacity.prefill_token_budget + capacity.num_state_slots))
    health_servicer = health.HealthServicer()

    def on_device_fault(detail: str) -> None:
        log.error("device fault; reporting NOT_SERVING", extra={"device": str(device), "detail": detail})
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    loop.fatal_hooks.append(on_device_fault)  # a failed engine loop or group reports NOT_SERVING, like a device fault
    # The token check first, so an unauthenticated caller learns nothing; then a corrupt body: INVALID_ARGUMENT.
    interceptors = [internal_auth.TokenInterceptor(token)] if token else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=SERVER_OPTIONS,
                         interceptors=[*interceptors, DecodeGuard()])
    shard_pb2_grpc.add_ShardServicer_to_server(ShardService(loop, info, device, on_device_fault), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    serve_metrics(cfg.host, cfg.metrics_port, metrics.registry)
    security.bind(server, f"{cfg.host}:{cfg.port}", cfg.tls)
    return server, loop, health_servicer


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    tracing.setup_or_exit("shard")
    server, loop, health_servicer = build_server(cfg)
    loop.start()
    loop.ready.wait()  # its warm-up done (or failed: then the fatal hook below stops the shard)
    server.start()
    health_server = (security.health_only_server(health_servicer, cfg.host, cfg.health_port)
                     if cfg.health_port is not None else None)
    if health_server is not None:
        health_server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("shard serving", extra={"address": f"{cfg.host}:{cfg.port}", "shard": cfg.shard_name,
                                     "device": cfg.engine.device, "metrics_port": cfg.metrics_port,
                                     "tls": cfg.tls is not None, "mtls": bool(cfg.tls and cfg.tls.client_ca),
                                     "internal_token": cfg.internal_token_file is not None,
                                     "health_port": cfg.health_port})
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    loop.fatal_hooks.append(lambda _: stop.set())  # a failed engine loop or shard group stops the server: exit 1
    if loop.failure is not None:
        stop.set()
    stop.wait()
    log.info("shard draining", extra={"shard": cfg.shard_name})
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    # Movable sequences go to a peer (shard_svc/engine/handoff.py): their states wait here until the router has
    # fetched them, within the hold time; what is not movable (another caller's, a shard group's) finishes here.
    loop.stop(timeout=60, move=True)
    unclaimed = loop.exports.wait_empty(STATE_HOLD_SECONDS)
    if unclaimed:
        log.warning("states of moved sequences never fetched; dropped", extra={"request_ids": unclaimed})
    if hasattr(loop, "close_group"):
        loop.close_group()
    server.stop(grace=5).wait()
    if health_server is not None:
        health_server.stop(None)
    if loop.failure is not None:
        log.error("shard stopped after a failure", extra={"shard": cfg.shard_name, "error": loop.failure})
        return 1
    return 0
