"""The router's one error table: its named errors, each carrying the gRPC status it is answered with; what a shard's
refusal and a tokenizer call's status become; what a client is told on gRPC (`refusal`); and the HTTP status and
OpenAI error body (`error_body`) of each gRPC status. Every entry point uses it: the gRPC servicer
(router/service.py), the batch RPCs (router/batch/service.py), batch error lines (router/batch/jobs.py) and the HTTP
API (router/http/errors.py)."""

from __future__ import annotations

import re

import grpc

from kimiserve.v1 import shard_pb2


class RouterError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str = "", param: str | None = None):
        """param: the request field at fault, where one is (OpenAI's error.param on HTTP)."""
        super().__init__(message)
        self.param = param


class InvalidArgument(RouterError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class Overloaded(RouterError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class ShardUnavailable(RouterError):
    code = grpc.StatusCode.UNAVAILABLE


class ShardLost(ShardUnavailable):
    """A sequence's shard went away under it (its stream ended or broke, its probes failed, or it refused the
    sequence as draining): router/generation.py fails the sequence over to another shard, within its bound. `kind`
    is the metric's reason label: stream_ended, stream_broke, probes_failed, refused, removed (by discovery) or
    drained (ShardMoved)."""

    def __init__(self, shard: str, reason: str, kind: str):
        super().__init__(f"shard {shard} lost the sequence: {reason}")
        self.shard, self.reason, self.kind = shard, reason, kind


class ShardMoved(ShardLost):
    """A draining shard handed the sequence over (its Moved event): with `computed_tokens` > 0 its state waits there
    under `leg_id` for ExportState, to be relayed to the next shard (router/failover.py); else the next leg
    recomputes. A planned move, not a loss: it does not count against --max-failovers."""

    def __init__(self, shard: str, leg_id: str, computed_tokens: int, state_bytes: int):
        super().__init__(shard, f"the shard is draining and handed the sequence over ({computed_tokens} tokens of "
                                f"state, {state_bytes} bytes)", "drained")
        self.leg_id, self.computed_tokens, self.state_bytes = leg_id, computed_tokens, state_bytes


class NotFound(RouterError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(RouterError):
    """The caller may see the thing but not change it (an admin key and another tenant's batch or file). Never used
    where the caller may not see it: that is NotFound, so ids say nothing across tenants."""

    code = grpc.StatusCode.PERMISSION_DENIED


class AlreadyExists(RouterError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ToolChoiceNotMet(RouterError):
    """A finished reply broke tool_choice 'required' or a named function although decoding enforced it (a stop
    string or stop token id cut it short): the backstop check of router/tool_choice.py."""

    code = grpc.StatusCode.INTERNAL


# A shard's refusal of a Submit (ShardEvent.Error.code) -> the router error it is answered with.
SHARD_ERRORS: dict[int, type[RouterError]] = {shard_pb2.SHARD_ERROR_CODE_INVALID_ARGUMENT: InvalidArgument,
                                              shard_pb2.SHARD_ERROR_CODE_ALREADY_EXISTS: AlreadyExists,
                                              shard_pb2.SHARD_ERROR_CODE_RESOURCE_EXHAUSTED: Overloaded,
                                              shard_pb2.SHARD_ERROR_CODE_UNAVAILABLE: ShardUnavailable}
# A tokenizer call's final status -> the router error; any other status is the router's INTERNAL.
TOKENIZER_ERRORS: dict[grpc.StatusCode, type[RouterError]] = {grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
                                                              grpc.StatusCode.NOT_FOUND: NotFound,
                                                              grpc.StatusCode.UNAVAILABLE: ShardUnavailable}
# What grpc's core, not the tokenizer, says when the connection under a call breaks (the tokenizer process died):
# INTERNAL with this text. The tokenizer's own INTERNAL says "internal error in RPC: ...".
BROKEN_CONNECTION = (grpc.StatusCode.INTERNAL, "Internal error from Core")
# The tokenizer names the field at fault first in an INVALID_ARGUMENT message ("messages[2]: ...", "tools[0]: ...",
# "text: ..."; tokenizer_svc/chat_types.py, tokenizer_svc/service.py, kimiserve/chat_continuation.py): the request
# field it was given as.
_TOKENIZER_FIELDS = re.compile(r"(messages|tools|text|continue_final_message|add_generation_prompt)\b")
_TOKENIZER_PARAMS = {"messages": "messages", "tools": "tools", "text": "prompt",
                     **{f: f for f in ("continue_final_message", "add_generation_prompt")}}
INTERNAL_MESSAGE = "internal error; the router's log has the details"


def from_shard(error: shard_pb2.ShardEvent.Error) -> RouterError:
    """A shard's refusal of one sequence, with the field it blames (the message names no shard address: clients
    are not told where the shards are)."""
    return SHARD_ERRORS.get(error.code, RouterError)(error.message, error.param or None)


def from_tokenizer(code: grpc.StatusCode, details: str, ended_call: str = "") -> RouterError:
    """The router error for a tokenizer call's final status; a broken connection is the tokenizer being unavailable.
    `ended_call`: the streaming call that ended under us, named in the message with its status."""
    if (code, details) == BROKEN_CONNECTION:
        code, details = grpc.StatusCode.UNAVAILABLE, f"the connection broke ({details})"
    where = f"{ended_call} ended with {code.name}: " if ended_call else ""
    field = _TOKENIZER_FIELDS.match(details) if code == grpc.StatusCode.INVALID_ARGUMENT else None
    return TOKENIZER_ERRORS.get(code, RouterError)(f"tokenizer service: {where}{details}",
                                                   _TOKENIZER_PARAMS[field.group(1)] if field else None)


def refusal(e: Exception) -> tuple[grpc.StatusCode, str]:
    """(gRPC status, message for the client) of any failure: a named error says what was wrong; a bug's text (which
    may quote input, or be huge) goes to the log only."""
    if isinstance(e, RouterError):
        return e.code, str(e)
    return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE


# The one table from the gRPC status of a named error to the HTTP status the HTTP API answers with.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.DATA_LOSS: 500,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.ABORTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# OpenAI's error `type` of each HTTP status; any other is "server_error".
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error",
                415: "invalid_request_error", 429: "rate_limit_error"}


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}; `code` is the gRPC status in lower case
    (the same code a batch error line carries)."""
    return {"error": {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def http_status(code_name: str) -> int:
    """The HTTP status of a gRPC status named in lower case (a batch error line's `code`)."""
    return HTTP_STATUS.get(grpc.StatusCode.__members__.get(code_name.upper()), 500)
