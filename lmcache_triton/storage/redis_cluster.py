"""`redis-cluster://[user:password@]host:port[,host:port...]` (and `rediss-cluster://` with TLS,
`valkey-cluster://`, `valkeys-cluster://`): chunks on a Redis Cluster or Valkey cluster.

The nodes given are seeds: redis-py's cluster client asks them for the slot map and sends each
key to the master that owns its hash slot, so chunks spread over every master. Values, key prefix
and the bounded GETRANGE read are those of one Redis (redis_backend.py).

Fail-soft per master, not per cluster. A master that is down costs misses and failed puts on its
own slots only: its keys are skipped for a back-off (0.1 s doubling to 2 s, as for a whole
remote) while the other masters keep serving theirs. EXISTS is pipelined per master, so one
dead master turns only its keys into misses. Only a cluster that cannot be reached at all (no
seed answers) backs the whole tier off. Start the cluster with `cluster-require-full-coverage no`:
otherwise every master refuses every key (CLUSTERDOWN) while any slot is uncovered.

The client is created on first use (creating it asks a seed for the slot map), so an engine
starts while the cluster is down and uses it once it answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.remote_url import REMOTE_SCHEMES, cluster_nodes, redact_url
from lmcache_triton.storage import serde
from lmcache_triton.storage.redis_backend import KEY_PREFIX, bounded_get, require_redis
from lmcache_triton.storage.remote_base import (
    _BACKOFF_MAX_S,
    _BACKOFF_MIN_S,
    CONNECT_TIMEOUT_S,
    RemoteChunkBackend,
    RemoteError,
    RemoteUnavailable,
)

T = TypeVar("T")


class NodeDown(RemoteError):
    """One master failed (`skipped` False) or is backing off (True): a miss on its slots, not a
    reason to stop using the others (not a RemoteUnavailable: the whole tier does not back off)."""

    def __init__(self, message: str, skipped: bool) -> None:
        super().__init__(message)
        self.skipped = skipped


class RedisClusterBackend(RemoteChunkBackend):
    name = "RedisClusterBackend"

    def __init__(self, url: str, metadata: LMCacheEngineMetadata | None = None, *, compression: str = "naive",
                 timeout_s: float = 10.0, auth_token: str | None = None, key_prefix: str = KEY_PREFIX) -> None:
        super().__init__(url=redact_url(url), metadata=metadata, compression=compression, timeout_s=timeout_s)
        require_redis(self.url)
        scheme = url.partition("://")[0].lower()
        if REMOTE_SCHEMES.get(scheme) not in ("redis-cluster", "rediss-cluster"):
            raise ValueError(f"not a cluster url: {self.url!r} (expected redis-cluster://, rediss-cluster://, "
                             "valkey-cluster:// or valkeys-cluster://)")
        self._nodes, user, password = cluster_nodes(url)
        self._tls = REMOTE_SCHEMES[scheme] == "rediss-cluster"
        self._user, self._password = user, password or auth_token
        self.prefix = key_prefix
        self._max_value_bytes = None if metadata is None else serde.max_serialized_nbytes(metadata)
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._node_lock = threading.Lock()
        self._down: dict[str, tuple[float, float]] = {}  # master "host:port" -> (down until, next back-off)

    # ---- the client and the masters' health ------------------------------------------------------
    def _cluster(self):
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    from redis.backoff import NoBackoff
                    from redis.cluster import ClusterNode, RedisCluster
                    from redis.retry import Retry

                    import redis

                    # redis-py 6+ takes the retries from `retry` alone (and warns about the old knob)
                    old = {"cluster_error_retry_attempts": 0} if int(redis.__version__.split(".")[0]) < 6 else {}
                    try:
                        self._client = RedisCluster(
                            startup_nodes=[ClusterNode(h, p) for h, p in self._nodes],
                            username=self._user, password=self._password, ssl=self._tls,
                            socket_timeout=self.timeout_s,
                            socket_connect_timeout=min(self.timeout_s, CONNECT_TIMEOUT_S),
                            # a retry multiplies the time a call can take; a miss is cheaper
                            retry=Retry(NoBackoff(), 0), require_full_coverage=False, **old)
                    except Exception as e:
                        raise RemoteUnavailable(f"no seed node of {self.url} answered: {type(e).__name__}: {e}") from None
        return self._client

    def _node_of(self, key: str) -> str:
        node = self._cluster().get_node_from_key(self._k(key))
        return node.name

    def _skip(self, node: str) -> bool:
        with self._node_lock:
            until = self._down.get(node, (0.0, 0.0))[0]
        return time.monotonic() < until

    def _failed(self, node: str) -> None:
        with self._node_lock:
            _, backoff = self._down.get(node, (0.0, _BACKOFF_MIN_S))
            self._down[node] = (time.monotonic() + backoff, min(backoff * 2, _BACKOFF_MAX_S))

    def _answered(self, node: str) -> None:
        if node in self._down:
            with self._node_lock:
                self._down.pop(node, None)

    def _on_node(self, node: str, op: Callable[[], T]) -> T:
        """`op` on master `node` (`_node_of` a key), unless that master is backing off; a failure
        backs it off and raises NodeDown (a miss there, counted, while the other masters carry on)."""
        from redis.exceptions import ConnectionError as RedisConnectionError, RedisClusterException, \
            TimeoutError as RedisTimeoutError

        if self._skip(node):
            raise NodeDown(f"master {node} is backing off after a failure", skipped=True)
        try:
            result = op()
        except (RedisConnectionError, RedisTimeoutError, RedisClusterException, OSError) as e:
            self._failed(node)
            raise NodeDown(f"master {node}: {type(e).__name__}: {e}", skipped=False) from None
        self._answered(node)
        return result

    # ---- RemoteChunkBackend hooks ------------------------------------------------------------------
    def _k(self, key: str) -> str:
        return self.prefix + key

    def _put_bytes(self, key: str, data: bytes) -> None:
        self._on_node(self._node_of(key), lambda: self._cluster().set(self._k(key), data))

    def _exists_before_put(self, key: str) -> list[bool]:
        return [bool(self._on_node(self._node_of(key), lambda: self._cluster().exists(self._k(key))))]

    def _get_bytes(self, key: str) -> bytes | None:
        k = self._k(key)

        def read(a, b):
            return self._on_node(self._node_of(key),
                                 lambda: self._cluster().get(k) if a is None else self._cluster().getrange(k, a, b))

        return bounded_get(read, key, self._max_value_bytes)

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        """One pipeline per master; a master that fails (or backs off) answers "absent" for its keys."""
        by_node: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            by_node.setdefault(self._node_of(k), []).append(i)
        found = [False] * len(keys)
        for node, idx in by_node.items():
            try:
                answers = self._on_node(node, lambda: self._exists_on_one_master(keys, idx))
            except NodeDown as e:
                self._count("skipped_unavailable" if e.skipped else "errors")
                continue
            for i, n in zip(idx, answers):
                found[i] = bool(n)
        return found

    def _exists_on_one_master(self, keys: Sequence[str], idx: list[int]) -> list[Any]:
        pipe = self._cluster().pipeline()
        for i in idx:
            pipe.exists(self._k(keys[i]))
        return pipe.execute()

    def _delete(self, key: str) -> bool:
        return bool(self._on_node(self._node_of(key), lambda: self._cluster().delete(self._k(key))))

    def _close(self) -> None:
        if self._client is not None:
            self._client.close()
