"""Build and run the tokenizer gRPC server (asyncio): the Tokenizer service, grpc.health.v1, reflection, /metrics."""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import Executor, ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kimiserve import internal_auth, security
from kimiserve.decode_guard import AioDecodeGuard
from kimiserve.ports import SERVER_OPTIONS, serve_metrics
from kimiserve.tokenizer_files.loading import LoadedTokenizer
from kimiserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.chat_template import load_chat_template, render_chat
from tokenizer_svc.chat_types import ChatMessage
from tokenizer_svc.config import TokenizerServerConfig
from tokenizer_svc.detokenizer import IncrementalDetokenizer
from tokenizer_svc.errors import TokenizerServiceError
from tokenizer_svc.registry import load_for_model
from tokenizer_svc.service import ServedTokenizer, TokenizerServicer

log = logging.getLogger(__name__)

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


def keep_no_words(tokenizer: LoadedTokenizer) -> None:
    """Turns off the word cache of `tokenizers`' BPE model. It keeps every distinct pre-tokenized word it encodes
    (up to 10,000 of them, each up to 256 characters, with one 32-byte symbol per byte: a long word costs ~10 KB), so
    the service's memory followed what clients sent: 10,000 words of 50-250 letters hold 48 MiB (issue 33). Without
    it nothing outlives a request; the trained model encodes Austen's text as fast either way (~1 M chars/s)."""
    tokenizer.hf.model._resize_cache(0)


def load_served(cfg: TokenizerServerConfig) -> ServedTokenizer:
    """Load the tokenizer and chat template of cfg.model_dir (raises a named TokenizerServiceError)."""
    model_type, tokenizer = load_for_model(cfg.model_dir, cfg.model_type)
    keep_no_words(tokenizer)
    template = load_chat_template(cfg.model_dir, tokenizer.config)
    return ServedTokenizer(
        tokenizer=tokenizer,
        template=template,
        model_name=cfg.served_name,
        model_type=model_type,
        max_message_chars=cfg.max_message_chars,
        max_text_chars=cfg.max_text_chars,
    )


def warm(served: ServedTokenizer) -> None:
    """One chat rendered, encoded and detokenized incrementally before SERVING, on the work threads the RPCs use,
    so the first request pays for none of it (issue 25: first-request TTFT). A template that cannot render a plain
    user turn is logged, not fatal: each request's own rendering reports its error."""
    try:
        text = render_chat(served.template, [ChatMessage(role="user", content="Hello")], [], True,
                           served.max_message_chars)
    except TokenizerServiceError as e:
        log.warning("chat template warm-up failed; requests will report their own rendering errors",
                    extra={"error": str(e), "chat_template": served.template.source})
        text = "Hello"
    ids = served.tokenizer.encode(text)
    detok = IncrementalDetokenizer(served.tokenizer)
    detok.add(ids)
    detok.flush()


def work_pool(cfg: TokenizerServerConfig) -> ThreadPoolExecutor:
    """The threads the RPCs run their CPU work on: cfg.work_threads of them at most, whatever the load."""
    return ThreadPoolExecutor(cfg.work_threads, thread_name_prefix="tokenizer-work")


async def start_server(
    cfg: TokenizerServerConfig, served: ServedTokenizer, work: Executor
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A started server with every service registered and health SERVING, its CPU work on `work` (work_pool);
    returns (server, health, bound port)."""
    await asyncio.get_running_loop().run_in_executor(work, warm, served)
    # Callers without the internal token are refused first; a corrupt request body: INVALID_ARGUMENT. No
    # SO_REUSEPORT: a taken port fails here.
    token_check = ([internal_auth.AioTokenInterceptor(internal_auth.read_token(cfg.internal_token_file))]
                   if cfg.internal_token_file else [])
    server = grpc.aio.server(interceptors=[*token_check, AioDecodeGuard()], options=SERVER_OPTIONS)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(served, work), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = security.bind(server, f"{cfg.host}:{cfg.port}", cfg.tls)  # raises OSError if it cannot bind
    await server.start()
    for name in ("", SERVICE_NAME):  # "" is the whole server, as probes ask by default
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port


async def serve_async(cfg: TokenizerServerConfig, served: ServedTokenizer) -> None:
    """Serve until SIGTERM / SIGINT, then stop gracefully: NOT_SERVING, in-flight RPCs get cfg.grace_s."""
    with work_pool(cfg) as work:
        await _serve_on(cfg, served, work)


async def _serve_on(cfg: TokenizerServerConfig, served: ServedTokenizer, work: Executor) -> None:
    server, health_servicer, port = await start_server(cfg, served, work)
    health_server = (security.health_only_server_aio(health_servicer, cfg.host, cfg.health_port)
                     if cfg.health_port is not None else None)
    if health_server is not None:
        await health_server.start()
    stop_requested = asyncio.Event()

    def request_stop(sig: signal.Signals) -> None:
        log.info("stopping on signal %s", sig.name, extra={"grace_s": cfg.grace_s})
        stop_requested.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, request_stop, sig)
    log.info(
        "tokenizer service serving on %s:%d",
        cfg.host, port,
        extra={"address": f"{cfg.host}:{port}", "model": served.model_name, "model_type": served.model_type,
               "metrics_port": cfg.metrics_port, "chat_template": served.template.source,
               "tokenizer_source": served.tokenizer.source, "vocab_size": served.tokenizer.vocab_size,
               "tls": cfg.tls is not None, "mtls": bool(cfg.tls and cfg.tls.client_ca),
               "internal_token": cfg.internal_token_file is not None, "health_port": cfg.health_port,
               "work_threads": cfg.work_threads},
    )
    await stop_requested.wait()
    await health_servicer.enter_graceful_shutdown()  # probes see NOT_SERVING while in-flight RPCs finish
    await server.stop(cfg.grace_s)
    if health_server is not None:
        await health_server.stop(None)
    log.info("tokenizer service stopped")


def serve(cfg: TokenizerServerConfig) -> None:
    """Load, start /metrics, serve; blocks until a stop signal."""
    served = load_served(cfg)
    if cfg.metrics_port is not None:
        serve_metrics(cfg.host, cfg.metrics_port)
    asyncio.run(serve_async(cfg, served))
