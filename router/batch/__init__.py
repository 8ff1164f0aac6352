"""Batch jobs: many Generate / Chat requests run as one durable job with a result per request.

parse.py turns the input into requests, store.py keeps batches, requests and results in SQLite (WAL), jobs.py
runs them (state machine, scheduler, recovery after a restart), execute.py runs one request exactly as the
Generate / Chat RPCs would, service.py serves the batch RPCs, and setup.py is the wiring router/main.py calls.
"""
