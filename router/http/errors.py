"""Any failure of an HTTP request as (HTTP status, OpenAI error body), by the router's one error table
(router/errors.py: HTTP_STATUS, error_body), plus the errors the HTTP layer finds itself."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from kimiserve import tracing

from router.errors import HTTP_STATUS, RouterError, error_body
from router.openai_body import BodyError

log = logging.getLogger(__name__)


class HttpError(Exception):
    """An error found by the HTTP layer itself (body not JSON, too large, no API key, unknown route)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


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
        return 500, error_body(500, f"internal error (request_id={request_id})", "internal")
    log.info("http request refused", extra={"request_id": request_id, "status": status,
                                            "error": body["error"]["message"]})
    tracing.current().fail(f"{status} {body['error']['code']}: {body['error']['message']}")
    return status, body


def error_response(e: Exception, request_id: str) -> JSONResponse:
    status, body = describe(e, request_id)
    return JSONResponse(body, status_code=status)
