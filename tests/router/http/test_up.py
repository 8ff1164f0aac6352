"""`kimiserve up` serves the HTTP API (on 127.0.0.1:8000 unless told otherwise), prints its URL, and refuses a taken
port before starting anything."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx

from kimiserve.ports import free_port


def up(model, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--model", str(model), "--port",
                             str(free_port()), *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def test_up_refuses_a_taken_http_port(tiny_linear):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "launcher.cli", "up", "--model", str(tiny_linear), "--port",
                              str(free_port()), "--http-port", str(port)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert f"127.0.0.1:{port} is not free" in out.stderr and "--http-port 0" in out.stderr


def test_up_serves_and_prints_the_http_api(tiny_linear):
    port = free_port()
    proc = up(tiny_linear, "--http-port", str(port))
    try:
        deadline = time.monotonic() + 240
        url = None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "up exited before printing its addresses"
            if "OpenAI-compatible HTTP API at " in line:
                url = line.split(" at ", 1)[1].strip()
        assert url == f"http://127.0.0.1:{port}/v1"
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["status"] == "ok"
        assert httpx.get(url + "/models", timeout=10).json()["data"][0]["id"] == tiny_linear.name
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
