"""The FastAPI application: the routes, behind the gate (gate.py: request id, API key, body size, a log line)."""

from __future__ import annotations

import inspect
import json
import logging
from typing import Literal

from fastapi import FastAPI, File, Form, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from kimiserve import security
from kimiserve.limits import JsonTooDeep, loads_json
from kimiserve.tenants import http_tenant
from kimiserve.text import encodable_json
from router.generation import Generation
from router.http import chat, completions, responses, schemas, tokens
from router.http.batches import Batches
from router.errors import error_body
from router.http.errors import HttpError, describe
from router.http.gate import Gate
from router.http.origin import LOCAL_HOSTS
from router.http.streaming import ClientGone

log = logging.getLogger(__name__)


def build_app(gen: Generation, batches: Batches | None, api_keys: security.ApiKeys | None,
              max_body_bytes: int, allowed_hosts: tuple[str, ...] = LOCAL_HOSTS) -> ASGIApp:
    app = FastAPI(title="kimiserve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "invalid_request")
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(error_body(e.status_code, message, code), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return JSONResponse(error_body(400, f"{param}: {first['msg']}", "invalid_argument", param), 400)

    async def answer(request: Request, method: str, work) -> Response:
        """Runs `work()` (awaited when it returns an awaitable); pydantic results become JSON, every failure OpenAI's
        error shape, and the outcome is counted in the router's request metrics under `method`."""
        rid = request_id(request)
        try:
            result = work()
            if inspect.isawaitable(result):
                result = await result
        except ClientGone:
            log.info("client disconnected; its sequences were cancelled", extra={"request_id": rid})
            gen.metrics.requests.labels(method, "CANCELLED").inc()
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - every failure is answered in one shape
            status, body = describe(e, rid)
            gen.metrics.requests.labels(method, body["error"]["code"].upper()).inc()
            return JSONResponse(body, status_code=status)
        gen.metrics.requests.labels(method, "OK").inc()
        return JSONResponse(result.model_dump()) if isinstance(result, BaseModel) else result

    async def json_body(request: Request) -> dict:
        raw = await request.body()
        try:  # as batch lines are read: bounded nesting, lone surrogate escapes become U+FFFD
            body = encodable_json(loads_json(raw.decode("utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError, JsonTooDeep) as e:
            raise HttpError(400, f"the request body is not JSON: {e}", "invalid_json") from None
        if not isinstance(body, dict):
            raise HttpError(400, f"the request body must be a JSON object, got {type(body).__name__}", "invalid_json")
        return body

    def json_route(path: str, method: str, handle) -> None:
        """POST `path` with a JSON body, answered by `handle` (router/http/chat.py, completions.py, responses.py,
        tokens.py) and counted under `method`."""

        async def route(request: Request) -> Response:
            async def work():
                return await handle(gen, await json_body(request), request_id(request), http_tenant(request),
                                    request.receive)
            return await answer(request, method, work)

        app.add_api_route(path, route, methods=["POST"], name=method)

    for path, endpoint in (("/v1/chat/completions", chat), ("/v1/completions", completions),
                           ("/v1/responses", responses)):
        json_route(path, endpoint.METHOD, endpoint.handle)
    json_route("/tokenize", tokens.TOKENIZE_METHOD, tokens.tokenize)  # vLLM's, at the root as vLLM serves them
    json_route("/detokenize", tokens.DETOKENIZE_METHOD, tokens.detokenize)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await answer(request, "HttpModels", lambda: _models(gen))

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        return await answer(request, "HttpModels", lambda: _model(gen, model_id))

    @app.get("/health")
    async def health() -> JSONResponse:
        # Open to anyone (probes send no key), so it names no internal address: a shard's address is where a caller
        # would go to reach around the router. Which shards are up is in the router's log and metrics.
        healthy = sum(1 for s in gen.shards if s.view.healthy)
        return JSONResponse({"status": "ok" if healthy else "unavailable", "shards_in_rotation": healthy},
                            status_code=200 if healthy else 503)

    if batches is not None:
        _batch_routes(app, answer, json_body, batches)
    return Gate(app, api_keys, max_body_bytes, allowed_hosts)


def request_id(request: Request) -> str:
    return request.scope["state"]["request_id"]  # set by the gate


async def _models(gen: Generation) -> schemas.ModelList:
    info = gen.model_info()
    return schemas.ModelList(data=[schemas.ModelCard(
        id=info.model_name, created=0, model_type=info.model_type,
        max_model_len=gen.max_context_tokens(), vocab_size=info.vocab_size)])


async def _model(gen: Generation, model_id: str) -> schemas.ModelCard:
    from router.prompts import check_model

    check_model(gen, model_id)
    return (await _models(gen)).data[0]


def _batch_routes(app: FastAPI, answer, json_body, batches: Batches) -> None:
    """Every route acts as the request's tenant (http_tenant): another tenant's file or batch is a 404."""

    def by_id(verb: str, path: str, method: str, action) -> None:
        """`verb path`, whose one path parameter (a file or batch id) is handed to `action` with the tenant."""

        async def route(request: Request) -> Response:
            (key,) = request.path_params.values()
            return await answer(request, method, lambda: action(key, http_tenant(request)))

        app.add_api_route(path, route, methods=[verb], name=action.__name__)

    by_id("GET", "/v1/files/{file_id}", "HttpFiles", batches.file)
    by_id("DELETE", "/v1/files/{file_id}", "HttpFiles", batches.delete)
    by_id("GET", "/v1/batches/{batch_id}", "HttpBatches", batches.batch)
    by_id("POST", "/v1/batches/{batch_id}/cancel", "HttpBatches", batches.cancel)

    @app.post("/v1/files")
    async def upload(request: Request, file: UploadFile = File(...), purpose: str = Form(...)) -> Response:
        content = await file.read()
        return await answer(request, "HttpFiles", lambda: batches.upload(purpose, file.filename or "", content,
                                                                       http_tenant(request)))

    @app.get("/v1/files")
    async def files(request: Request, limit: int = Query(10000, ge=1, le=10000), after: str | None = None,
                    order: Literal["asc", "desc"] = "desc", purpose: str | None = None) -> Response:
        return await answer(request, "HttpFiles", lambda: batches.files_page(limit, after, order, purpose,
                                                                           http_tenant(request)))

    @app.get("/v1/files/{file_id}/content")
    async def content(request: Request, file_id: str) -> Response:
        return await answer(request, "HttpFiles", lambda: Response(batches.content(file_id, http_tenant(request)),
                                                                   media_type="application/jsonl"))

    @app.post("/v1/batches")
    async def create(request: Request) -> Response:
        async def work():
            return batches.create(await json_body(request), http_tenant(request))
        return await answer(request, "HttpBatches", work)

    @app.get("/v1/batches")
    async def page(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None) -> Response:
        return await answer(request, "HttpBatches", lambda: batches.page(limit, after, http_tenant(request)))
