"""Histogram buckets shared by the router and the shards, so the same measure has the same buckets everywhere.

They span the tiny CPU model of the tests (passes of tens of milliseconds, tens of tokens) and a 48B model on a
GPU serving long prompts (TTFT of tens of seconds under load, 1M-token prompts, passes of thousands of tokens).
"""

# Request phases (queue wait, prefill, time to first token, end to end), in seconds.
REQUEST_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Gaps between output tokens (time per output token, inter-token latency), in seconds.
TOKEN_GAP_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
# One engine pass, in seconds.
PASS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# Token counts: prompt and generation lengths, tokens in a pass or a chunk (x4 per bucket up to 1M).
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
# Small counts: sequences in a pass, chunks (micro-batches) in a pass.
COUNT = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
FLAG = (0.5,)  # a 0/1 observation: the bucket counts the zeros, _sum the ones
