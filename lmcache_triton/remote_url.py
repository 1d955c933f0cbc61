"""The remote tier's URL: which schemes it takes, how a URL is checked and parsed, and how its
secrets are kept out of logs, errors and stats.

Its own module because two floors read it: the config checks ``remote_url`` against
``REMOTE_SCHEMES`` and shows it through :func:`redact_url`; storage/ builds its backend from the same
table and parses cluster URLs with :func:`cluster_nodes`. One table and one redaction keep the two
from disagreeing. Standard library only; nothing happens at import.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

__all__ = [
    "CLUSTER_PROTOCOLS", "REMOTE_SCHEMES", "cluster_nodes", "named_like_secret", "redact_url",
    "remote_url_forms", "remote_url_problem",
]

# The remote_url schemes, the one table: scheme -> the protocol its backend speaks. "lm" is the cache
# server here; the others are served by storage/redis_backend.py, which hands redis-py the
# protocol's scheme (valkey:// is redis://, valkeys:// is rediss://, TLS).
REMOTE_SCHEMES: Mapping[str, str] = types.MappingProxyType(
    {"lm": "lm", "redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss",
     # a Redis Cluster / Valkey cluster given by one or more seed nodes (redis-py's cluster client)
     "redis-cluster": "redis-cluster", "rediss-cluster": "rediss-cluster",
     "valkey-cluster": "redis-cluster", "valkeys-cluster": "rediss-cluster"}
)
CLUSTER_PROTOCOLS = ("redis-cluster", "rediss-cluster")
# Substrings of names (extra_config keys, URL query parameters) whose values are redacted.
_SECRET_WORDS = ("pass", "secret", "token", "credential", "auth")


def named_like_secret(name: str) -> bool:
    """``name`` (a URL query parameter, an extra_config key) names a secret: its value is redacted."""
    return any(w in name.lower() for w in _SECRET_WORDS)


def remote_url_forms() -> str:
    """The accepted remote_url forms, for messages and docs."""
    def form(scheme: str, protocol: str) -> str:
        if protocol == "lm":
            return f"{scheme}://host:port"
        if protocol in CLUSTER_PROTOCOLS:
            return f"{scheme}://host:port[,host:port...]"
        return f"{scheme}://host:port[/db]"

    return ", ".join(form(s, p) for s, p in REMOTE_SCHEMES.items())


def cluster_nodes(url: str) -> tuple[list[tuple[str, int]], str | None, str | None]:
    """(seed nodes, user name, password) of a `redis-cluster://[user:password@]host:port[,host:port...]`
    URL; ValueError naming the part that is wrong (never showing the password)."""
    _, _, rest = url.partition("://")
    end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    userinfo, at, hosts = rest[:end].rpartition("@")
    user = password = None
    if at:
        name, colon, secret = userinfo.partition(":")
        user, password = (unquote(name) or None), (unquote(secret) if colon else None)
        if not colon:  # redis://TOKEN@host: the user info is the password (as redis-py reads it)
            user, password = None, unquote(name)
    nodes = []
    for item in hosts.split(","):
        try:
            parts = urlsplit(f"//{item}")
            port = parts.port
        except ValueError as e:
            raise ValueError(f"cluster node {item!r}: {e}") from None
        if not parts.hostname or port is None:
            raise ValueError(f"cluster node {item!r} is not host:port")
        nodes.append((parts.hostname, port))
    return nodes, user, password


def redact_url(url: str) -> str:
    """``url`` fit for logs, errors and stats: the password of its user info becomes ``***`` (the
    user name stays); user info without a password (``scheme://TOKEN@host``, a token for some
    services) becomes ``***`` whole; so do the values of query parameters named like secrets.
    Plain string work, so a URL that ``urlsplit`` refuses is redacted all the same."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    end = min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest))
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, host = netloc.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if colon else f"***@{host}"
    path, q, query = tail.partition("?")
    if q:
        query, hash_, fragment = query.partition("#")
        params = []
        for param in query.split("&"):
            name, eq, _ = param.partition("=")
            params.append(f"{name}=***" if eq and named_like_secret(name) else param)
        tail = f"{path}?{'&'.join(params)}{hash_}{fragment}"
    return f"{scheme}{sep}{netloc}{tail}"


def remote_url_problem(url: str) -> str | None:
    """Why ``url`` is not a remote_url this package serves (with the accepted forms), or None. The
    reason never shows the URL: the caller shows it through :func:`redact_url`."""
    def bad(why: str) -> str:
        return f"{why}; accepted forms: {remote_url_forms()}"

    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if REMOTE_SCHEMES.get(scheme) in CLUSTER_PROTOCOLS:
        try:
            cluster_nodes(url)
        except ValueError as e:
            return bad(str(e))
        rest = url.partition("://")[2]
        tail = rest[min([i for i in (rest.find(c) for c in "/?#") if i >= 0], default=len(rest)):]
        if tail not in ("", "/"):
            return bad(f"{scheme}:// URLs take no path, query or fragment (a cluster has database 0 only)")
        return None
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return bad(str(e))
    if parts.scheme not in REMOTE_SCHEMES:
        return bad(f"unsupported scheme {parts.scheme!r}" if parts.scheme else "no scheme")
    if not parts.hostname:
        return bad("missing host")
    if REMOTE_SCHEMES[parts.scheme] == "lm":
        if port is None:
            return bad("missing port")
        if parts.path not in ("", "/"):
            return bad(f"{parts.scheme}:// URLs take no path")
    else:
        db = parts.path.strip("/")
        if db and not db.isdigit():
            return bad(f"the database must be a number, got {db!r}")
    if parts.query or parts.fragment:
        return bad("no query or fragment allowed")
    return None
