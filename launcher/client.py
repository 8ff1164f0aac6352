"""Client commands against a running router: `kimiserve chat` (streams text) and `kimiserve complete`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from typing import TypeVar

from kimiserve.sampling_args import add_sampling_args
from kimiserve.text import encodable
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from launcher.router_channel import add_router_args, with_router

FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_CANCELLED: "cancelled", common_pb2.FINISH_REASON_ERROR: "error"}
Reply = TypeVar("Reply", router_pb2.GenerateResponse, router_pb2.ChatResponse)


def _sampling(args: argparse.Namespace) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, min_p=args.min_p, stop=[encodable(stop) for stop in args.stop],
                                  stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
                                  min_tokens=args.min_tokens)
    if args.seed is not None:
        s.seed = args.seed
    s.presence_penalty, s.frequency_penalty = args.presence_penalty, args.frequency_penalty
    s.repetition_penalty = args.repetition_penalty
    if args.json_schema is not None:
        s.response_format.json_schema.schema = args.json_schema
    return s


def add_complete_args(p: argparse.ArgumentParser) -> None:
    add_sampling_args(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_router_args(p)


def add_chat_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("message", help="the user message")
    p.add_argument("--system", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=None)
    add_router_args(p)


def _stream(args: argparse.Namespace, call: Callable[[router_pb2_grpc.RouterStub], Iterable[Reply]],
            show: Callable[[Reply], None]) -> int:
    """Makes one streaming call to the router and shows each reply chunk as it comes; the exit code."""

    def work(stub: router_pb2_grpc.RouterStub) -> int:
        for chunk in call(stub):
            show(chunk)
        return 0

    return with_router(args, work)


def run_complete(args: argparse.Namespace) -> int:
    req = router_pb2.GenerateRequest(sampling=_sampling(args))
    if args.prompt is not None:
        req.text = encodable(args.prompt)  # argv bytes that are not UTF-8 arrive as lone surrogates
    else:
        req.prompt_token_ids.ids.extend(args.prompt_ids)
    chunks: list[router_pb2.GenerateResponse] = []

    def show(chunk: router_pb2.GenerateResponse) -> None:
        chunks.append(chunk)
        if not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()

    code = _stream(args, lambda stub: stub.Generate(req), show)
    if code:
        return code
    last = chunks[-1]
    result = {"token_ids": [t for c in chunks for t in c.token_ids], "text": "".join(c.text for c in chunks),
              "finish_reason": FINISH_NAMES[last.finish_reason],
              "usage": {"prompt_tokens": last.usage.prompt_tokens, "completion_tokens": last.usage.completion_tokens}}
    sys.stdout.write((json.dumps(result) if args.json else "") + "\n")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    messages = [common_pb2.ChatMessage(role="system", content=encodable(args.system))] if args.system else []
    messages.append(common_pb2.ChatMessage(role="user", content=encodable(args.message)))
    req = router_pb2.ChatRequest(messages=messages, sampling=common_pb2.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature))
    if args.seed is not None:
        req.sampling.seed = args.seed

    thought = False

    def show(chunk: router_pb2.ChatResponse) -> None:
        # The reasoning goes to stderr: the terminal shows it, and stdout stays the answer alone for a pipe.
        nonlocal thought
        if chunk.reasoning_text:
            sys.stderr.write(chunk.reasoning_text)
            sys.stderr.flush()
            thought = True
        if thought and (chunk.text or chunk.tool_calls):
            sys.stderr.write("\n")
            thought = False
        sys.stdout.write(chunk.text)
        for call in chunk.tool_calls:
            sys.stdout.write(f"\n[tool call {call.id}: {call.name}({call.arguments})]")
        sys.stdout.flush()

    code = _stream(args, lambda stub: stub.Chat(req), show)
    if code == 0:
        sys.stdout.write("\n")
    return code
