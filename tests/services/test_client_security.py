"""The client commands (`complete`, `chat`, `batch`) against a router that serves TLS, requires client certificates
(mTLS) and API keys: they get through with the CA, a client certificate and a key (flag or KIMISERVE_API_KEY), and
each missing or wrong piece is refused with the server's status, or before connecting with a message naming the
flag, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kimiserve.ports import free_port
from launcher.health import wait_serving
from tests.deploy.certs import Ca

REPO_ROOT = Path(__file__).resolve().parents[2]
KEY = "client-test-key-1"


@pytest.fixture(scope="module")
def secure_router(stack, tmp_path_factory):
    """A second router on the session stack's tokenizer and shards: TLS with client certificates, API keys."""
    d = tmp_path_factory.mktemp("client_security")
    ca, rogue = Ca("kimiserve client test CA"), Ca("rogue CA")
    files = {"ca": ca.pem, "rogue-ca": rogue.pem}
    files["server.crt"], files["server.key"] = ca.issue("router", dns=["localhost"], ips=["127.0.0.1"])
    files["client.crt"], files["client.key"] = ca.issue("a client")
    files["rogue.crt"], files["rogue.key"] = rogue.issue("a client")
    for name, data in files.items():
        (d / name).write_bytes(data)
    (d / "keys").write_text(f"# test keys\n{KEY}\n")
    port, health_port = free_port(), free_port()
    shards = ",".join(c.address for n, c in stack.children.items() if n.startswith("shard-"))
    with (d / "router.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "router", "--tokenizer", stack.children["tokenizer"].address,
             "--shards", shards, "--port", str(port), "--metrics-port", str(free_port()),
             "--health-port", str(health_port), "--batch-db", str(d / "batches.sqlite3"),
             "--tls-cert", str(d / "server.crt"), "--tls-key", str(d / "server.key"), "--client-ca", str(d / "ca"),
             "--api-keys-file", str(d / "keys")], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_serving(f"127.0.0.1:{health_port}", 60, alive=lambda: proc.poll() is None)
        yield f"127.0.0.1:{port}", d
    finally:
        proc.terminate()
        proc.wait(30)


def cli(*args: str, api_key_env: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KIMISERVE_API_KEY"}
    if api_key_env is not None:
        env["KIMISERVE_API_KEY"] = api_key_env
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO_ROOT)


def tls_flags(d: Path, client: str | None = "client", ca: str = "ca") -> list[str]:
    flags = ["--tls-ca", str(d / ca)]
    if client:
        flags += ["--tls-cert", str(d / f"{client}.crt"), "--tls-key", str(d / f"{client}.key")]
    return flags


def complete(address: str, *flags: str, api_key_env: str | None = None) -> subprocess.CompletedProcess:
    return cli("complete", "--prompt-ids", "5,6,7", "--max-tokens", "3", "--ignore-eos", "--json",
               "--router", address, *flags, api_key_env=api_key_env)


def test_complete_chat_and_batch_get_through_tls_mtls_and_api_key(secure_router, tmp_path):
    address, d = secure_router
    out = complete(address, *tls_flags(d), api_key_env=KEY)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1])["usage"]["completion_tokens"] == 3
    out = complete(address, *tls_flags(d), "--api-key", KEY)  # the flag, no environment variable
    assert out.returncode == 0, out.stderr[-2000:]

    chat = cli("chat", "Hello", "--max-tokens", "3", "--router", address, *tls_flags(d), api_key_env=KEY)
    assert chat.returncode == 0, chat.stderr[-2000:]

    lines = tmp_path / "in.jsonl"
    lines.write_text("\n".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                           "body": {"prompt": [5, 6, i + 7], "max_tokens": 2}}) for i in range(3)))
    submit = cli("batch", "submit", str(lines), "--router", address, *tls_flags(d), api_key_env=KEY)
    assert submit.returncode == 0, submit.stderr[-2000:]
    results = tmp_path / "out.jsonl"
    fetch = cli("batch", "results", submit.stdout.strip(), "-o", str(results), "--wait", "--router", address,
                *tls_flags(d), api_key_env=KEY)
    assert fetch.returncode == 0, fetch.stderr[-2000:]
    assert sorted(json.loads(x)["custom_id"] for x in results.read_text().splitlines()) == ["c0", "c1", "c2"]


@pytest.mark.parametrize("case, flags, key, fragment", [
    ("no API key", "mtls", None, "UNAUTHENTICATED: missing API key"),
    ("wrong API key", "mtls", "not-a-key", "UNAUTHENTICATED: wrong API key"),
    ("no client certificate", "tls-only", KEY, "UNAVAILABLE"),
    ("client certificate of another CA", "rogue-client", KEY, "UNAVAILABLE"),
    ("plaintext to a TLS port", "none", KEY, "UNAVAILABLE"),
    ("server certificate not signed by the given CA", "rogue-ca", KEY, "UNAVAILABLE"),
])
def test_each_missing_or_wrong_credential_is_refused(secure_router, case, flags, key, fragment):
    address, d = secure_router
    chosen = {"mtls": tls_flags(d), "tls-only": tls_flags(d, client=None), "rogue-client": tls_flags(d, "rogue"),
              "none": [], "rogue-ca": tls_flags(d, ca="rogue-ca")}[flags]
    out = complete(address, *chosen, api_key_env=key)
    assert out.returncode == 2, (case, out.stdout, out.stderr[-2000:])
    assert fragment in out.stderr and "Traceback" not in out.stderr, (case, out.stderr[-2000:])


@pytest.mark.parametrize("flags, fragment", [
    (["--tls-cert", "c.crt"], "--tls-cert/--tls-key/--tls-server-name need --tls-ca"),
    (["--tls-ca", "CA", "--tls-cert", "c.crt"], "--tls-cert and --tls-key go together"),
    (["--tls-ca", "/nonexistent/ca.pem"], "cannot read the CA (--tls-ca) /nonexistent/ca.pem"),
    (["--api-key", " "], "--api-key is empty"),
])
def test_incomplete_or_unreadable_flags_are_named_before_connecting(flags, fragment):
    for command in (["complete", "--prompt-ids", "1"], ["chat", "hi"], ["batch", "list"]):
        out = cli(*command, "--router", "127.0.0.1:1", *flags)
        assert out.returncode == 2 and fragment in out.stderr and "Traceback" not in out.stderr, \
            (command, out.stderr[-2000:])
