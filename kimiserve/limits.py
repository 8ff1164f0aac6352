"""Limits on what one request may ask for, checked at the API edge (router) and again by the engine.

One place for every number, so the proto comments, the router's checks and the engine's checks agree.
"""

# Temperatures above this are a uniform draw in all but name; NaN and inf are refused with everything above it.
MAX_TEMPERATURE = 100.0
# Request ids travel in gRPC metadata and in every log line: printable ASCII, bounded length.
MAX_REQUEST_ID_CHARS = 256
