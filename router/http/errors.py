"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, from the router's named errors.

The HTTP status comes from the one gRPC -> HTTP table (router/errors.py HTTP_STATUS); `code` is the gRPC status in
lower case, the same code a batch error result carries.
"""

from __future__ import annotations

import logging

import grpc
from fastapi.responses import JSONResponse

from kimiserve import tracing

from router.errors import HTTP_STATUS, RouterError
from router.openai_body import BodyError

log = logging.getLogger(__name__)
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 415: "invalid_request_error",
         429: "rate_limit_error"}


class HttpError(Exception):
    """An error found by the HTTP layer itself (body not JSON, too large, no API key, unknown route)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"), "param": param, "code": code}}


def describe(e: Exception, request_id: str) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) for any exception, logged: refusals in one line, unexpected failures whole
    (and answered 500 without their text); the request's span is marked failed, as a refused RPC's is."""
    if isinstance(e, HttpError):
        status, body = e.status, error_body(e.status, str(e), e.code, e.param)
    elif isinstance(e, BodyError):
        status, body = 400, error_body(400, str(e), "invalid_argument", e.param)
    elif isinstance(e, RouterError):
        status = HTTP_STATUS.get(e.code, 500)
        body = error_body(status, f"{e} (request_id={request_id})", e.code.name.lower(), e.param)
    else:
        log.exception("http request failed", extra={"request_id": request_id})
        tracing.current().fail(f"500 {type(e).__name__}")
        return 500, error_body(500, f"internal error (request_id={request_id})",
                               grpc.StatusCode.INTERNAL.name.lower())
    log.info("http request refused", extra={"request_id": request_id, "status": status,
                                            "error": body["error"]["message"]})
    tracing.current().fail(f"{status} {body['error']['code']}: {body['error']['message']}")
    return status, body


def error_response(e: Exception, request_id: str) -> JSONResponse:
    status, body = describe(e, request_id)
    return JSONResponse(body, status_code=status)
