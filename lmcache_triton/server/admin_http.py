"""The cache server's admin API: HTTP on its own port (`--admin-port`), beside the ZMQ protocol.

    GET  /healthcheck   200 {"status": "ok"} while the serve loop answers; needs no token
    GET  /status        the server's statistics: the JSON object the STATS command returns
    GET  /metrics       the same figures in Prometheus' text format
    POST /clear         empties the store, its --disk files included; 200 {"cleared": <entries>}

Auth: with a token (--auth-token or $LMCACHE_REMOTE_AUTH_TOKEN) every endpoint but /healthcheck
wants `Authorization: Bearer <token>`, as every ZMQ command but HEALTH wants its digest; a missing
or wrong one gets 401 and counts in `auth_failures`. Without a token the reads are open, and
/clear is refused (403) unless the server listens on loopback only: an open port on a network
must not let anyone empty the cache. The token is never logged, labelled or echoed.

Threads: the HTTP server runs in daemon threads and never touches the store or the counters: each
request hands a function to the serve loop (loop_calls.py) and waits for it with a timeout, so the
figures are exactly the loop's, /clear runs between two ZMQ messages and needs no lock, and a slow
HTTP client costs the loop nothing. A /clear the loop has not started when its caller stops waiting
is never run.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from lmcache_triton.server.loop_calls import LoopCalls, LoopStopped

logger = logging.getLogger("lmcache_triton")

CALL_TIMEOUT_S = 10.0   # what a read waits for the loop (it answers between two ZMQ messages)
CLEAR_TIMEOUT_S = 60.0  # what /clear waits: deleting many --disk files takes a while
_PREFIX = "lmcache_triton_server"
_GAUGES = {  # STATS field -> help; every other number in STATS but uptime is a counter (`counters`)
    "keys": "entries stored (chunks, for lmcache_triton clients)",
    "used_bytes": "bytes of keys and values stored",
    "capacity_bytes": "capacity (--max-size-gb): used_bytes never exceeds it",
    "clients": "client connections (ZMQ peers) that sent a request within clients_window_s",
    "pending_reply_bytes": "bytes of values that queued GET replies keep alive",
    "max_pending_reply_bytes": "bound on pending_reply_bytes (--max-pending-reply-mb)",
    "max_value_bytes": "largest value one PUT may carry (--max-value-mb)",
}
_COUNTERS = {  # help for the counters (ServerStats' fields); a new one is exported with a plain help
    "puts": "PUT requests", "gets": "GET requests", "hits": "GETs answered with a value",
    "misses": "GETs of absent keys", "exists_queries": "EXISTS requests", "exists_keys": "keys asked by EXISTS",
    "deletes": "DELETE requests", "evictions": "entries evicted (least recently used) to make room",
    "rejected_too_large": "requests refused as too large", "auth_failures": "requests with a wrong or missing token",
    "bad_requests": "malformed requests", "unknown_commands": "requests with an unknown command",
    "internal_errors": "requests that hit a server bug (logged)",
    "dropped_replies": "replies dropped: the client's queue was full or it had gone",
    "refused_replies": "GETs answered BUSY: the pending-reply budget was full",
    "not_persisted": "--disk: PUTs of values that are not chunks, kept in memory only",
    "clears": "POST /clear calls that emptied the store",
}
_DISK_GAUGES = {"chunks": "chunk files in --disk", "used_bytes": "bytes of the chunk files in --disk"}


class AdminTarget(Protocol):
    """What the API needs of the server; each of these runs on the serve loop's thread."""

    counters: tuple[str, ...]  # the STATS fields that are counters

    def stats_dict(self) -> dict[str, Any]: ...

    def clear(self) -> int: ...

    def note_auth_failure(self) -> None: ...


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


def _json(status: int, obj: Any, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(status, json.dumps(obj, indent=2).encode() + b"\n", headers=headers)


class _Snapshot:
    """A Prometheus collector over one STATS snapshot: a scrape's figures are one moment's."""

    def __init__(self, stats: dict[str, Any], counters: tuple[str, ...]) -> None:
        self._stats, self._counters = stats, counters

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        yield InfoMetricFamily(_PREFIX, "the cache server's versions",
                               value={"version": str(s["version"]), "protocol_version": str(s["protocol_version"])})
        for name in self._counters:
            yield CounterMetricFamily(f"{_PREFIX}_{name}", _COUNTERS.get(name, f"STATS {name}"), value=s[name])
        for name, doc in _GAUGES.items():
            yield GaugeMetricFamily(f"{_PREFIX}_{name}", doc, value=s[name])
        yield GaugeMetricFamily(f"{_PREFIX}_uptime_seconds", "seconds since the server started", value=s["uptime_s"])
        if s.get("disk"):
            for name, doc in _DISK_GAUGES.items():
                yield GaugeMetricFamily(f"{_PREFIX}_disk_{name}", doc, value=s["disk"][name])


def metrics_text(stats: dict[str, Any], counters: tuple[str, ...]) -> bytes:
    """`stats` (a STATS snapshot) in Prometheus' text exposition format, from a private registry."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(stats, counters))
    return generate_latest(registry)


class AdminAPI:
    """The endpoints, without HTTP: `handle(method, path, authorization) -> Reply`."""

    ROUTES = {"/healthcheck": "GET", "/status": "GET", "/metrics": "GET", "/clear": "POST"}

    def __init__(self, target: AdminTarget, calls: LoopCalls, *, token: str | None, loopback: bool) -> None:
        self._target, self._calls = target, calls
        self._token = token.encode() if token else None
        self._loopback = loopback

    def handle(self, method: str, path: str, authorization: str | None) -> Reply:
        path = path.rstrip("/") or "/"
        want = self.ROUTES.get(path)
        if want is None:
            return _json(404, {"error": f"no endpoint {path}; the admin API has "
                                        + ", ".join(f"{m} {p}" for p, m in self.ROUTES.items())})
        if method != want:
            return _json(405, {"error": f"{path} takes {want}, not {method}"}, (("Allow", want),))
        if path == "/healthcheck":
            _, failed = self._on_loop(lambda: None, CALL_TIMEOUT_S, "the health check")
            return failed or _json(200, {"status": "ok"})
        refused = self._refused(authorization, write=path == "/clear")
        if refused is not None:
            return refused
        if path == "/clear":
            cleared, failed = self._on_loop(self._target.clear, CLEAR_TIMEOUT_S, "/clear")
            return failed or _json(200, {"cleared": cleared})
        stats, failed = self._on_loop(self._target.stats_dict, CALL_TIMEOUT_S, path)
        if failed:
            return failed
        if path == "/metrics":
            return Reply(200, metrics_text(stats, self._target.counters), CONTENT_TYPE_LATEST)
        return _json(200, stats)

    def _refused(self, authorization: str | None, *, write: bool) -> Reply | None:
        if self._token is None:
            if write and not self._loopback:
                return _json(403, {"error": "POST /clear is refused: the server listens beyond loopback "
                                            "without an auth token; start it with --auth-token to allow it"})
            return None
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self._token):
            return None
        try:
            self._calls.submit(self._target.note_auth_failure)  # counted by the loop; not waited for
        except LoopStopped:
            pass
        why = "wrong token" if scheme.lower() == "bearer" else "missing token"
        return _json(401, {"error": f"authentication failed ({why}): send 'Authorization: Bearer <token>' "
                                    "with the server's --auth-token"}, (("WWW-Authenticate", "Bearer"),))

    def _on_loop(self, fn: Callable[[], Any], timeout_s: float, what: str) -> tuple[Any, Reply | None]:
        """`fn()` run by the serve loop, or the 503 that says why it was not."""
        try:
            future = self._calls.submit(fn)
            return future.result(timeout_s), None
        except LoopStopped as e:
            return None, _json(503, {"error": str(e)})
        except FutureTimeout:
            if future.cancel():
                return None, _json(503, {"error": f"the serve loop did not take {what} within {timeout_s:g} s; "
                                                  "nothing was done"})
            return None, _json(503, {"error": f"{what} is still running in the serve loop after {timeout_s:g} s; "
                                              "it will finish"})


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = 10  # seconds a connection that sends nothing keeps its thread
    server_version = "lmcache-triton-admin"

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def _answer(self, method: str) -> None:
        try:
            reply = self.server.api.handle(method, urlsplit(self.path).path, self.headers.get("Authorization"))
        except Exception as e:  # a bug costs this request, never the server
            logger.exception("cache server admin API: %s %s failed", method, urlsplit(self.path).path)
            reply = _json(500, {"error": f"internal error: {type(e).__name__}"})
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        for name, value in reply.headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(reply.body)

    def log_message(self, format: str, *args: Any) -> None:  # request lines only: headers (the token) never
        logger.debug("cache server admin API: %s %s", self.address_string(), format % args)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    api: AdminAPI


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class AdminHTTPServer:
    """The admin API on http://host:port, served by daemon threads from `start()` to `close()`."""

    def __init__(self, host: str, port: int, api: AdminAPI) -> None:
        try:
            self._httpd = (_HTTPServer6 if ":" in host else _HTTPServer)((host, port), _Handler)
        except OSError as e:
            raise OSError(e.errno, f"cannot bind the admin API (--admin-port) on {host}:{port}: {e.strerror}") from e
        self._httpd.api = api
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="lmcache-triton-admin-http",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()


# ---- the client side: `lmcache-triton stats --admin URL` ----------------------------------------
def fetch_status(url: str, token: str | None, timeout_s: float) -> dict[str, Any]:
    """GET `url`/status (`url` is http://host:port, with or without /status); raises OSError or
    ValueError with a message that names the server and what went wrong."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--admin wants http://host:port (the server's --admin-port), got {url!r}")
    base = url.rstrip("/")
    target = base if base.endswith("/status") else f"{base}/status"
    request = urllib.request.Request(target, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read()).get("error", e.reason)
        except (ValueError, AttributeError):
            why = e.reason
        raise OSError(f"{target}: HTTP {e.code}: {why}") from None
    except urllib.error.URLError as e:
        raise OSError(f"{target}: {e.reason}") from None
