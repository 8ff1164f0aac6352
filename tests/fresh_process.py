"""Determinism across processes: Python seeds its str/bytes hashes per process, so set and dict-of-set orders can
differ between two runs of one program while two calls in one process always agree. A determinism test runs one of
its generations here, under a fixed hash seed unlike the test process's random one."""

from __future__ import annotations

import os
import subprocess
import sys

OTHER_HASH_SEED = "12345"


def run_python(code: str, timeout_s: float = 120) -> None:
    """Runs `code` in a fresh interpreter with another hash seed; a failure raises with its stderr."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                         env={**os.environ, "PYTHONHASHSEED": OTHER_HASH_SEED})
    assert out.returncode == 0, f"fresh process (PYTHONHASHSEED={OTHER_HASH_SEED}) failed:\n{out.stderr[-3000:]}"
