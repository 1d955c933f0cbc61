"""`redis://host:port[/db]`, `rediss://` (TLS) and `valkey://` / `valkeys://` (same protocol).

Keys are `lmct:` + the chunk key, so the cache can share a database with other data and be listed
or flushed with `SCAN MATCH lmct:*`. Eviction is Redis's own (set `maxmemory` and an
`allkeys-lru` policy on the server); this client does not bound what it stores.

redis-py's retries are turned off: a retry would multiply the time a call can take, and a miss is
cheaper than a stalled forward pass. Its connection pool reconnects by itself (a pooled connection
that the server closed is detected and replaced on next use), so a restarted server is used again
without any action here (tests/storage/test_redis.py checks it).

With metadata, a GET never reads more than the largest chunk this engine could have written
(`serde.max_serialized_nbytes`, B): it is `GETRANGE key 0 B`, which returns at most B + 1 bytes,
and B + 1 means "larger than any chunk of ours": refused, so a hostile 1 GiB value under our key
is never sent nor allocated whole. One command, as fast as GET (loopback, median of 31, 8 MiB:
GET 44.9 ms, GETRANGE 44.7 ms); a Lua script doing STRLEN then GET took 98.5 ms, as it copies the
value through Lua. A missing key reads as b"", which no chunk is, so it is a miss as with GET.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.remote_url import REMOTE_SCHEMES, redact_url
from lmcache_triton.storage import serde
from lmcache_triton.storage.remote_base import CONNECT_TIMEOUT_S, RemoteChunkBackend

KEY_PREFIX = "lmct:"
_SCHEMES = {s: p for s, p in REMOTE_SCHEMES.items() if p in ("redis", "rediss")}  # scheme -> redis-py's


class OversizedValueError(serde.SerdeError):
    """The stored value is larger than any chunk this engine writes: not ours, and not read whole."""


def redis_url(url: str) -> str:
    """The URL redis-py understands: valkey:// and valkeys:// mapped to redis:// and rediss://."""
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(f"not a redis/valkey url: {url!r} (expected redis://, rediss://, valkey:// or valkeys://)")
    if not parts.hostname:
        raise ValueError(f"redis url {url!r} has no host")
    return urlunsplit(parts._replace(scheme=_SCHEMES[parts.scheme]))


def require_redis(url: str) -> None:
    """ImportError naming the extra to install, where the redis package is missing."""
    try:
        import redis  # noqa: F401
    except ImportError as e:
        raise ImportError(f"remote_url {url!r} needs the `redis` package: pip install 'lmcache-triton[redis]'") from e


def bounded_get(read, key: str, limit: int | None) -> bytes | None:
    """`read(start, end)` is GETRANGE of the value under `key` (`read(None, None)`: a plain GET, when
    no bound is known): the value, None if absent, OversizedValueError past `limit` bytes."""
    if limit is None:  # no metadata, no bound on what a chunk may be
        return read(None, None)
    value = read(0, limit)  # both ends inclusive: at most limit + 1 bytes
    if not value:
        return None
    if len(value) > limit:
        raise OversizedValueError(f"value under {key!r} is larger than the {limit} bytes of this engine's "
                                  "largest chunk; refused after reading that many")
    return value


class RedisBackend(RemoteChunkBackend):
    name = "RedisBackend"

    def __init__(self, url: str, metadata: LMCacheEngineMetadata | None = None, *, compression: str = "naive",
                 timeout_s: float = 10.0, auth_token: str | None = None, key_prefix: str = KEY_PREFIX) -> None:
        super().__init__(url=redact_url(url), metadata=metadata, compression=compression, timeout_s=timeout_s)
        require_redis(self.url)
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kwargs = {}
        if auth_token and not urlsplit(url).password:
            kwargs["password"] = auth_token
        self.prefix = key_prefix
        self._redis = redis.Redis.from_url(
            redis_url(url), socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, CONNECT_TIMEOUT_S),
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, **kwargs)
        self._max_value_bytes = None if metadata is None else serde.max_serialized_nbytes(metadata)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _put_bytes(self, key: str, data: bytes) -> None:
        self._redis.set(self._k(key), data)

    def _get_bytes(self, key: str) -> bytes | None:
        k = self._k(key)
        return bounded_get(lambda a, b: self._redis.get(k) if a is None else self._redis.getrange(k, a, b),
                           key, self._max_value_bytes)

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        # EXISTS k1 k2 ... returns a count, not which ones: one pipelined round trip of single EXISTS
        pipe = self._redis.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self._k(k))
        return [bool(n) for n in pipe.execute()]

    def _delete(self, key: str) -> bool:
        return bool(self._redis.delete(self._k(key)))

    def _close(self) -> None:
        self._redis.close()
