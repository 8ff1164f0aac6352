"""The OpenAI-compatible HTTP API of the router (FastAPI on uvicorn, in the router's own event loop beside grpc.aio).

app.py builds the application (routes, middleware), chat.py / completions.py / batches.py answer the endpoints
through the same flows and batch runner as the gRPC API, responses.py shapes OpenAI's JSON, errors.py maps the
router's named errors to OpenAI's error shape, server.py serves it.
"""
