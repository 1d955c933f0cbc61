"""The cache server's HTTP admin API against the real server process: /healthcheck, /status and
/metrics report the server's own counters, POST /clear needs the token and empties memory and
--disk, `lmcache-triton stats --admin` reads it, and the token shows up nowhere."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import lmcache_triton
from lmcache_triton.server.cache_server import CacheServer, add_server_parser, add_stats_parser, config_from_args
from lmcache_triton.storage import serde
from lmcache_triton.storage.memory import MemoryFormat
from lmcache_triton.storage.remote import CacheServerClient

pytestmark = pytest.mark.slow

TOKEN = "adm1n-s3cret-t0ken"


def http(port: int, path: str, *, method: str = "GET", token: str | None = None) -> tuple[int, bytes]:
    """(status, body) of one request to the admin API on 127.0.0.1:port."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def status_of(port: int, token: str | None = TOKEN) -> dict:
    code, body = http(port, "/status", token=token)
    assert code == 200, body
    return json.loads(body)


def metrics_of(port: int, token: str | None = TOKEN) -> tuple[dict[str, float], str]:
    code, body = http(port, "/metrics", token=token)
    assert code == 200, body
    text = body.decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}, text


def _chunk(name: str, fill: int) -> bytes:
    """A chunk as lmcache_triton clients PUT it (serde bytes whose header names `name`): --disk keeps it."""
    tensor = torch.full((2, 1, 16, 64), fill, dtype=torch.uint8).view(torch.bfloat16)
    return serde.serialize(name, tensor, MemoryFormat.KV_2LTD)


@pytest.fixture
def admin_server(start_cache_server, free_port):
    """start(*args, token=TOKEN) -> (server, admin port): a server with --admin-port, logging at DEBUG."""
    def start(*args: str, token: str | None = TOKEN):
        port = free_port()
        extra = ["--admin-port", str(port), "--log-level", "DEBUG", *args]
        return start_cache_server(*extra, *(["--auth-token", token] if token else [])), port

    return start


def test_status_and_metrics_are_the_servers_own_counters(admin_server, closing) -> None:
    server, port = admin_server("--max-size-gb", "0.0001")  # 100_000 bytes: three 30 kB values fit
    assert http(port, "/healthcheck") == (200, b'{\n  "status": "ok"\n}\n')  # no token needed
    c = CacheServerClient("127.0.0.1", server.port, timeout_s=2.0, auth_token=TOKEN)
    closing.append(c)
    for i in range(5):
        c.put(f"k{i}".encode(), bytes([i]) * 30_000)
    assert c.get(b"k4") is not None and c.get(b"k0") is None  # k0 and k1 were evicted

    status = status_of(port)
    assert (status["keys"], status["used_bytes"], status["capacity_bytes"]) == (3, 3 * 30_002, 100_000)
    assert (status["puts"], status["hits"], status["misses"], status["evictions"]) == (5, 1, 1, 2)
    assert status["version"] == lmcache_triton.__version__ and status["uptime_s"] > 0
    zmq_stats = c.stats()
    # uptime moves, and so does pending_reply_bytes: a gauge of replies still being sent (the get's
    # 30 kB reply was in flight when /status sampled it in one run)
    moving = ("uptime_s", "pending_reply_bytes")
    assert {k: v for k, v in zmq_stats.items() if k not in moving} == {k: v for k, v in status.items()
                                                                        if k not in moving}
    # clients: connections that sent a request within clients_window_s; one more client, one more
    other = CacheServerClient("127.0.0.1", server.port, timeout_s=2.0, auth_token=TOKEN)
    closing.append(other)
    other.get(b"k4")
    assert status_of(port)["clients"] == status["clients"] + 1 and status["clients_window_s"] == 60

    values, text = metrics_of(port)
    status = status_of(port)
    prefix = "lmcache_triton_server_"
    for name in CacheServer.counters:
        assert values[f"{prefix}{name}_total"] == status[name], name
    for name in ("keys", "used_bytes", "capacity_bytes", "clients", "pending_reply_bytes"):
        assert values[prefix + name] == status[name], name
    assert (values[prefix + "puts_total"], values[prefix + "hits_total"], values[prefix + "evictions_total"],
            values[prefix + "keys"]) == (5, 2, 2, 3)
    assert f'version="{lmcache_triton.__version__}"' in text

    for token in (None, "wrong"):
        code, body = http(port, "/status", token=token)
        assert code == 401 and b"authentication failed" in body
        assert http(port, "/metrics", token=token)[0] == 401
    assert status_of(port)["auth_failures"] == status["auth_failures"] + 4
    assert TOKEN not in json.dumps(status_of(port)) and TOKEN not in metrics_of(port)[1]
    assert http(port, "/nothing")[0] == 404 and http(port, "/status", method="POST")[0] == 405
    server.check_alive()
    assert TOKEN not in server.log() and "GET /status" in server.log()  # DEBUG logs requests, never the token


def test_clear_needs_the_token_and_empties_memory_and_disk(admin_server, tmp_path, closing) -> None:
    store = tmp_path / "store"
    server, port = admin_server("--disk", str(store))
    c = CacheServerClient("127.0.0.1", server.port, timeout_s=2.0, auth_token=TOKEN)
    closing.append(c)
    for i in range(3):
        c.put(f"chunk{i}".encode(), _chunk(f"chunk{i}", i))
    c.put(b"opaque", b"not a chunk: memory only")
    files = sorted(store.glob("??/*.safetensors"))
    assert len(files) == 3

    for token in (None, "wrong", TOKEN + "x"):
        code, body = http(port, "/clear", method="POST", token=token)
        assert code == 401 and b"authentication failed" in body, body
    assert status_of(port)["keys"] == 4 and sorted(store.glob("??/*.safetensors")) == files  # nothing removed
    assert http(port, "/clear", token=TOKEN)[0] == 405  # GET /clear empties nothing

    code, body = http(port, "/clear", method="POST", token=TOKEN)
    assert (code, json.loads(body)) == (200, {"cleared": 4})
    status = status_of(port)
    assert (status["keys"], status["used_bytes"], status["clears"], status["disk"]["chunks"]) == (0, 0, 1, 0)
    assert c.get(b"chunk0") is None and c.get(b"opaque") is None
    assert list(store.glob("??/*.safetensors")) == []
    c.put(b"chunk9", _chunk("chunk9", 9))  # the server goes on serving, and persisting
    assert c.get(b"chunk9") is not None and len(list(store.glob("??/*.safetensors"))) == 1
    server.check_alive()
    assert TOKEN not in server.log() and "/clear removed 4 entries" in server.log()


def test_without_a_token_clear_is_allowed_on_loopback_only(admin_server, closing) -> None:
    server, port = admin_server(token=None)
    c = CacheServerClient("127.0.0.1", server.port, timeout_s=2.0)
    closing.append(c)
    c.put(b"k", b"v")
    assert status_of(port, token=None)["keys"] == 1  # reads are open without a token
    assert http(port, "/clear", method="POST") == (200, b'{\n  "cleared": 1\n}\n')

    exposed, exposed_port = admin_server("--host", "0.0.0.0", token=None)
    c2 = CacheServerClient("127.0.0.1", exposed.port, timeout_s=2.0)
    closing.append(c2)
    c2.put(b"k", b"v")
    code, body = http(exposed_port, "/clear", method="POST")
    assert code == 403 and b"--auth-token" in body
    assert status_of(exposed_port, token=None)["keys"] == 1


def test_a_stalled_http_client_does_not_stall_the_cache(admin_server, closing) -> None:
    """The HTTP side has its own threads: a connection that sends half a request holds one of them,
    not the ZMQ loop, and not the other HTTP clients."""
    server, port = admin_server()
    stalled = socket.create_connection(("127.0.0.1", port))
    closing.append(stalled)
    stalled.sendall(b"GET /sta")  # and never the rest
    c = CacheServerClient("127.0.0.1", server.port, timeout_s=2.0, auth_token=TOKEN)
    closing.append(c)
    c.put(b"k", b"v")
    assert bytes(c.get(b"k")) == b"v"
    assert http(port, "/healthcheck")[0] == 200 and status_of(port)["hits"] == 1


def test_stats_admin_prints_the_status(admin_server, capsys, monkeypatch) -> None:
    monkeypatch.delenv("LMCACHE_REMOTE_AUTH_TOKEN", raising=False)
    server, port = admin_server()
    parser = argparse.ArgumentParser()
    add_stats_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["stats", "--admin", f"http://127.0.0.1:{port}", "--auth-token", TOKEN])
    assert args.func(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["keys"] == 0 and printed["version"] == lmcache_triton.__version__
    assert printed["capacity_bytes"] == status_of(port)["capacity_bytes"]

    args = parser.parse_args(["stats", "--admin", f"http://127.0.0.1:{port}/status", "--watch", "0.05",
                              "--count", "2", "--auth-token", TOKEN])
    assert args.func(args) == 0 and capsys.readouterr().out.count('"keys"') == 2

    args = parser.parse_args(["stats", "--admin", f"http://127.0.0.1:{port}"])
    assert args.func(args) == 1
    assert "HTTP 401" in (err := capsys.readouterr().err) and "authentication failed" in err
    args = parser.parse_args(["stats", "--admin", "lm://127.0.0.1:1"])
    assert args.func(args) == 1 and "http://host:port" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one source: lm:// (or a worker's /metrics), or --admin
        parser.parse_args(["stats", server.url, "--admin", f"http://127.0.0.1:{port}"])


def test_admin_port_is_checked_at_start(free_port) -> None:
    parser = argparse.ArgumentParser()
    add_server_parser(parser.add_subparsers(dest="command"))
    assert config_from_args(parser.parse_args(["server"])).admin_port is None  # off by default
    assert config_from_args(parser.parse_args(["server", "--admin-port", "0"])).admin_port == 0
    with pytest.raises(ValueError, match="admin port"):
        config_from_args(parser.parse_args(["server", "--admin-port", "70000"]))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = subprocess.run([sys.executable, "-m", "lmcache_triton.server.cache_server", "--port", str(free_port()),
                              "--admin-port", str(taken.getsockname()[1])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "cannot bind the admin API (--admin-port)" in out.stderr, out.stderr
