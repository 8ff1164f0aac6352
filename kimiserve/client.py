"""Client commands against a running router: `kimiserve chat` (streams text) and `kimiserve complete`."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from kimiserve.router_channel import add_router_args, router_channel
from kimiserve.sampling_args import add_sampling_args
from kimiserve.security import SecurityConfigError
from kimiserve.text import encodable
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc

FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_CANCELLED: "cancelled", common_pb2.FINISH_REASON_ERROR: "error"}


def _sampling(args: argparse.Namespace) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                  top_k=args.top_k, stop=[encodable(stop) for stop in args.stop],
                                  stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos)
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


def _fail(e: grpc.RpcError) -> int:
    sys.stderr.write(f"kimiserve: {e.code().name}: {e.details()}\n")
    return 2


def _channel(args: argparse.Namespace) -> grpc.Channel | None:
    try:
        return router_channel(args)
    except SecurityConfigError as e:
        sys.stderr.write(f"kimiserve: {e}\n")
        return None


def run_complete(args: argparse.Namespace) -> int:
    req = router_pb2.GenerateRequest(sampling=_sampling(args))
    if args.prompt is not None:
        req.text = encodable(args.prompt)  # argv bytes that are not UTF-8 arrive as lone surrogates
    else:
        req.prompt_token_ids.ids.extend(args.prompt_ids)
    ids, text, last = [], [], None
    channel = _channel(args)
    if channel is None:
        return 2
    with channel:
        try:
            for chunk in router_pb2_grpc.RouterStub(channel).Generate(req):
                ids.extend(chunk.token_ids)
                text.append(chunk.text)
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                last = chunk
        except grpc.RpcError as e:
            return _fail(e)
    result = {"token_ids": ids, "text": "".join(text), "finish_reason": FINISH_NAMES[last.finish_reason],
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
    channel = _channel(args)
    if channel is None:
        return 2
    with channel:
        try:
            for chunk in router_pb2_grpc.RouterStub(channel).Chat(req):
                sys.stdout.write(chunk.text)
                for call in chunk.tool_calls:
                    sys.stdout.write(f"\n[tool call {call.id}: {call.name}({call.arguments})]")
                sys.stdout.flush()
        except grpc.RpcError as e:
            return _fail(e)
    sys.stdout.write("\n")
    return 0
