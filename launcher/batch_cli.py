"""`kimiserve batch ...`: batch jobs on a running router.

    kimiserve batch submit FILE.jsonl [--router ADDR]      prints the batch id
    kimiserve batch status ID                              prints the batch as JSON
    kimiserve batch results ID -o out.jsonl [--wait]       writes one JSON line per request (see below)
    kimiserve batch cancel ID
    kimiserve batch list

Result lines: {"custom_id", "response": {"text", "token_ids", "finish_reason", "usage": {"prompt_tokens",
"completion_tokens"}, "tool_calls": [...]}} or {"custom_id", "error": {"code", "message"}}, in the order the
results were recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from google.protobuf import json_format

from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from launcher.router_channel import add_router_args, with_router

FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_CANCELLED: "cancelled", common_pb2.FINISH_REASON_ERROR: "error"}
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # the router's gRPC receive limit (grpc default)


def _window(text: str) -> int:
    """'24h', '90m', '30s', '2d' or plain seconds -> seconds."""
    unit = text[-1] if text and text[-1] in WINDOW_UNITS else "s"
    number = text[:-1] if text and text[-1] in WINDOW_UNITS else text
    try:
        return int(float(number) * WINDOW_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"completion window {text!r}: expected e.g. 24h, 90m, 30s") from None


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"metadata {text!r}: expected KEY=VALUE")
    return key, value


def add_args(p: argparse.ArgumentParser) -> None:
    p.epilog = "Each subcommand's --help lists its flags with their defaults (e.g. --router 127.0.0.1:50051)."
    sub = p.add_subparsers(dest="batch_command", required=True)
    submit = sub.add_parser("submit", help="create a batch from an OpenAI-format JSONL file; prints its id")
    submit.add_argument("file", type=Path)
    submit.add_argument("--completion-window", type=_window, default=0,
                        help="e.g. 24h, 90m, 30s; 0: the router's default (24h)")
    submit.add_argument("--max-concurrency", type=int, default=0,
                        help="requests of this batch in flight at once; 0: the router's default")
    submit.add_argument("--metadata", type=_pair, action="append", default=[], help="KEY=VALUE (repeatable)")
    status = sub.add_parser("status", help="print a batch as JSON")
    status.add_argument("batch_id")
    results = sub.add_parser("results", help="write a batch's results as JSONL")
    results.add_argument("batch_id")
    results.add_argument("-o", "--output", type=Path, required=True)
    results.add_argument("--wait", action="store_true", help="wait until the batch is terminal")
    cancel = sub.add_parser("cancel", help="cancel a batch")
    cancel.add_argument("batch_id")
    listing = sub.add_parser("list", help="list batches, newest first")
    listing.add_argument("--limit", type=int, default=20)
    for sp in (submit, status, results, cancel, listing):
        add_router_args(sp)


def batch_json(batch: router_pb2.Batch) -> dict:
    d = json_format.MessageToDict(batch, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    d["status"] = router_pb2.BatchStatus.Name(batch.status).removeprefix("BATCH_STATUS_").lower()
    for key in [k for k in d if k.endswith("_at_ms")]:  # proto JSON writes int64 as strings
        d[key] = int(d[key])
    d["usage"] = {k: int(v) for k, v in d["usage"].items()}
    return d


def result_json(r: router_pb2.BatchResult) -> dict:
    if r.WhichOneof("outcome") == "error":
        return {"custom_id": r.custom_id, "error": {"code": r.error.code, "message": r.error.message}}
    resp = r.response
    return {"custom_id": r.custom_id, "response": {
        "text": resp.text, "token_ids": list(resp.token_ids), "finish_reason": FINISH_NAMES[resp.finish_reason],
        "usage": {"prompt_tokens": resp.usage.prompt_tokens, "completion_tokens": resp.usage.completion_tokens},
        "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in resp.tool_calls]}}


def _submit(stub, args) -> int:
    try:
        text = args.file.read_bytes().decode("utf-8")
    except OSError as e:
        sys.stderr.write(f"kimiserve: cannot read {args.file}: {e.strerror}\n")
        return 2
    except UnicodeDecodeError as e:
        sys.stderr.write(f"kimiserve: {args.file} is not UTF-8 (byte offset {e.start}); JSONL must be UTF-8\n")
        return 2
    if len(text.encode("utf-8")) > MAX_MESSAGE_BYTES - 4096:
        sys.stderr.write(f"kimiserve: {args.file} is {len(text.encode())} bytes; one batch takes at most about "
                         f"{MAX_MESSAGE_BYTES} bytes of JSONL: split it into several batches\n")
        return 2
    batch = stub.CreateBatch(router_pb2.CreateBatchRequest(
        jsonl=text, completion_window_s=args.completion_window, max_concurrency=args.max_concurrency,
        metadata=dict(args.metadata)))
    sys.stdout.write(batch.id + "\n")
    return 0


def _results(stub, args) -> int:
    n = 0
    with args.output.open("w", encoding="utf-8") as out:
        for r in stub.GetBatchResults(router_pb2.GetBatchResultsRequest(batch_id=args.batch_id, follow=args.wait)):
            out.write(json.dumps(result_json(r), ensure_ascii=False) + "\n")
            n += 1
    batch = stub.GetBatch(router_pb2.GetBatchRequest(batch_id=args.batch_id))
    status = batch_json(batch)["status"]
    sys.stderr.write(f"{n} results written to {args.output} (batch {batch.id} is {status}, "
                     f"{batch.request_counts.total} requests)\n")
    return 0


def run(args: argparse.Namespace) -> int:
    return with_router(args, lambda stub: _run(stub, args))


def _run(stub: router_pb2_grpc.RouterStub, args: argparse.Namespace) -> int:
    if args.batch_command == "submit":
        return _submit(stub, args)
    if args.batch_command == "results":
        return _results(stub, args)
    if args.batch_command == "status":
        batch = stub.GetBatch(router_pb2.GetBatchRequest(batch_id=args.batch_id))
    elif args.batch_command == "cancel":
        batch = stub.CancelBatch(router_pb2.CancelBatchRequest(batch_id=args.batch_id))
    else:
        page = stub.ListBatches(router_pb2.ListBatchesRequest(page_size=min(max(args.limit, 1), 100)))
        for b in page.batches:
            c = b.request_counts
            sys.stdout.write(f"{b.id}  {batch_json(b)['status']:<11}  {c.completed + c.failed}/{c.total}"
                             f"  failed={c.failed}\n")
        return 0
    sys.stdout.write(json.dumps(batch_json(batch), indent=2) + "\n")
    return 0
