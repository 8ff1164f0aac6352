"""Prometheus metrics of the tokenizer service, all declared here (STYLE: metrics are an API)."""

from prometheus_client import Counter, Histogram

REQUESTS = Counter(
    "kimiserve_tokenizer_requests",
    "Tokenizer RPCs finished, by rpc name and gRPC status code.",
    ["rpc", "code"],
)
LATENCY = Histogram(
    "kimiserve_tokenizer_request_duration_seconds",
    "Wall time of a tokenizer RPC, from the handler's start to its last response, in seconds.",
    ["rpc"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0),
)
CHAT_PIECES = Counter(
    "kimiserve_tokenizer_chat_pieces",
    "Pieces of rendered chats (a system prompt, tool list or turn) RenderChat encoded (cached=false) or took from "
    "its cache of recent pieces under the request's cache salt (cached=true).",
    ["cached"],
)
TOKENS = Counter(
    "kimiserve_tokenizer_tokens",
    "Token ids produced (Tokenize, RenderChat) or consumed (Detokenize, DetokenizeStream), by rpc.",
    ["rpc"],
)
