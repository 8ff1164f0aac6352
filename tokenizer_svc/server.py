"""Build and run the tokenizer gRPC server: the Tokenizer service, grpc.health.v1, reflection and /metrics."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kimiserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tokenizer_svc.chat_template import load_chat_template
from tokenizer_svc.config import TokenizerServerConfig
from tokenizer_svc.registry import load_for_model
from tokenizer_svc.service import ServedTokenizer, TokenizerServicer

log = logging.getLogger(__name__)

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


def load_served(cfg: TokenizerServerConfig) -> ServedTokenizer:
    """Load the tokenizer and chat template of cfg.model_dir (raises a named TokenizerServiceError)."""
    model_type, tokenizer = load_for_model(cfg.model_dir, cfg.model_type)
    template = load_chat_template(cfg.model_dir, tokenizer.config)
    return ServedTokenizer(
        tokenizer=tokenizer,
        template=template,
        model_name=cfg.served_name,
        model_type=model_type,
        max_message_chars=cfg.max_message_chars,
        max_text_chars=cfg.max_text_chars,
    )


def build_server(cfg: TokenizerServerConfig, served: ServedTokenizer) -> tuple[grpc.Server, health.HealthServicer, int]:
    """A started server with all services registered and health SERVING; returns (server, health, bound port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="tokenizer-rpc"))
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(TokenizerServicer(served), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if port == 0:
        raise OSError(f"cannot bind the tokenizer service to {cfg.host}:{cfg.port}")
    server.start()
    for name in ("", SERVICE_NAME):  # "" is the whole server, as probes ask by default
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port


def serve(cfg: TokenizerServerConfig) -> None:
    """Load, serve, and block until SIGTERM / SIGINT; then stop gracefully (in-flight RPCs get cfg.grace_s)."""
    served = load_served(cfg)
    if cfg.metrics_port is not None:
        start_http_server(cfg.metrics_port, addr=cfg.host)
    server, health_servicer, port = build_server(cfg, served)
    stopping = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        if stopping.is_set():
            return
        stopping.set()
        log.info("stopping on signal %s", signal.Signals(signum).name, extra={"grace_s": cfg.grace_s})
        health_servicer.enter_graceful_shutdown()  # probes see NOT_SERVING while in-flight RPCs finish
        server.stop(cfg.grace_s)

    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    log.info(
        "tokenizer service serving on %s:%d",
        cfg.host, port,
        extra={"address": f"{cfg.host}:{port}", "model": served.model_name, "model_type": served.model_type,
               "metrics_port": cfg.metrics_port, "chat_template": served.template.source,
               "tokenizer_source": served.tokenizer.source, "vocab_size": served.tokenizer.vocab_size},
    )
    server.wait_for_termination()
    log.info("tokenizer service stopped")
