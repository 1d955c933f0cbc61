"""Prefill/decode disaggregation: a prefill instance sends each prompt's chunks to a decode instance.

The deployment (examples/pd/ has the commands): a prefiller (kv_role kv_producer; enable_pd,
pd_role: sender), a decoder (kv_role kv_consumer; enable_pd, pd_role: receiver, pd_peer_host,
pd_peer_init_port, pd_buffer_size) and `lmcache-triton proxy` in front. For each request the proxy
asks the prefiller for one token, with `kv_transfer_params.disagg_spec` naming the decoder's
listener, then sends the request unchanged to the decoder, whose lookup finds the prompt's chunks in
its CPU tier and loads all but the last token.

- Sender (`PDSender.send_request`): at a request's last prefill step the worker sends every chunk
  of the prompt, the partial last one too, to the receiver rank with its own rank, and waits. So the transfer is
  over before the prefill's reply leaves, and the proxy needs no notification (LMCache's
  pd_proxy_host/port are ignored). A chunk the receiver already holds is not sent again (one
  EXISTS each: a chat's earlier rounds cross once).
- Receiver (`PDReceiver`): each worker rank listens on TCP (the cache server's wire format, PUT,
  EXISTS and HEALTH only, authenticated with remote_auth_token like the cache server), checks each
  chunk (its key, its shape against the engine's, its checksum) and puts it into the CPU tier, which
  is the receive buffer (pd_buffer_size bytes). When it is full the least recently used unheld
  chunks make room; a chunk that still cannot fit is refused (BUSY).
- Faults end in misses: a receiver that is gone costs the sender one refused connect (or the
  connect timeout, at most 1 s) and it stops sending; a refused chunk stops the request's transfer;
  a sender killed mid-transfer leaves whole chunks only (one ZMQ message a chunk, checksummed). The
  decoder's lookup then finds a shorter prefix, or none, and vLLM computes the rest.

The request body chooses where the prefiller sends that request's KV (LMCache's protocol): expose
the prefiller's API to the proxy only, and set remote_auth_token on both sides off loopback.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache_triton.integration.vllm.paged import PagedKV, tokens_with_slots
from lmcache_triton.keys import CacheEngineKey
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.server import wire
from lmcache_triton.server.cache_server import CacheServer, ServerConfig
from lmcache_triton.server.wire import Command, Limits, Status
from lmcache_triton.storage import serde
from lmcache_triton.storage.manager import StorageManager

if TYPE_CHECKING:
    from lmcache_triton.integration.vllm.saving import Saving
    from lmcache_triton.integration.vllm.specs import DisaggSpec, ReqMeta

logger = logging.getLogger("lmcache_triton")


def rank_port(ports: Sequence[int], rank: int) -> int:
    """Rank `rank`'s port: its own entry, or base + rank when one port is given."""
    if len(ports) == 1:
        return ports[0] + rank
    if rank >= len(ports):
        raise ValueError(f"{len(ports)} PD ports given ({list(ports)}) for worker rank {rank}: give one per rank, "
                         "or one base port")
    return ports[rank]


def _address(host: str) -> str:
    """ZMQ binds addresses, not names: LMCache's configs say pd_peer_host: localhost."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        return socket.gethostbyname(host)


# ---- the receiver ---------------------------------------------------------------------------------
@dataclass
class ReceiverStats:
    received: int = 0       # chunks put in the buffer (or already there)
    refused_full: int = 0   # no room: every chunk in the buffer held
    rejected: int = 0       # not a whole, intact chunk of this engine under its key


class PDReceiver(CacheServer):
    """One worker rank's listener: chunks a prefiller sends go into `manager`'s CPU tier."""

    kind = "PD receiver"

    def __init__(self, manager: StorageManager, metadata: LMCacheEngineMetadata, *, host: str, port: int,
                 auth_token: str | None = None) -> None:
        # A frame larger than any chunk of this engine can be is cut off by ZMQ before it is read.
        limits = Limits(max_value_bytes=serde.max_serialized_nbytes(metadata), max_keys_per_request=4096)
        # (its own store stays empty: the capacity its log line shows is the buffer's)
        super().__init__(ServerConfig(host=_address(host), port=port, max_size_bytes=manager.cpu.capacity_bytes,
                                      limits=limits, auth_token=auth_token))
        self.manager = manager
        self.received = ReceiverStats()
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Binds (raises if the port is taken: a receiver that cannot listen is a broken deployment)
        and serves in a daemon thread; returns host:port."""
        endpoint = self.bind()
        self._thread = threading.Thread(target=self.serve_forever, name="lmcache-triton-pd-receiver", daemon=True)
        self._thread.start()
        return endpoint

    def close(self, timeout: float = 2.0) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _dispatch(self, req: wire.Request) -> tuple[Status, list, int]:
        if req.command == Command.HEALTH:
            return Status.OK, [b"ok"], 0
        if self._auth is not None and not hmac.compare_digest(req.auth, self._auth):
            self.stats.auth_failures += 1
            return Status.AUTH_FAILED, [b"authentication failed: wrong or missing token"], 0
        if req.command == Command.PUT:
            return self._receive(req.frames)
        if req.command == Command.EXISTS:
            keys = [self._chunk_key(f) for f in req.frames]
            return Status.OK, [wire.pack_bits([self.manager.cpu.contains(k) for k in keys])], 0
        raise wire.WireError(Status.UNKNOWN_COMMAND,
                             f"a PD receiver takes PUT, EXISTS and HEALTH, not {req.command.name}")

    def _chunk_key(self, frame: Any) -> CacheEngineKey:
        try:
            return CacheEngineKey.from_string(self._key(frame).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise wire.WireError(Status.BAD_REQUEST, f"not a chunk key: {e}") from None

    def _receive(self, frames: Sequence) -> tuple[Status, list, int]:
        self._arity(frames, 2, "PUT")
        key, value = self._chunk_key(frames[0]), memoryview(frames[1])
        try:
            stored = self.manager.receive(key, value)
        except serde.SerdeError as e:
            self.received.rejected += 1
            logger.warning("lmcache_triton PD receiver: chunk %s refused: %s", key.chunk_hash, e)
            raise wire.WireError(Status.BAD_REQUEST, f"chunk refused: {e}") from None
        if not stored:
            self.received.refused_full += 1
            return Status.BUSY, [b"receive buffer full (pd_buffer_size): every chunk in it is held"], 0
        self.received.received += 1
        return Status.OK, [], 0


# ---- the sender -----------------------------------------------------------------------------------
class PDSender:
    """A worker rank's connections to the receivers it sends to, one per listener address."""

    # Receivers are few (one per decoder rank); a bound keeps a stream of bogus addresses from
    # piling up sockets.
    _MAX_PEERS = 64

    def __init__(self, metadata: LMCacheEngineMetadata, *, rank: int, compression: str, timeout_s: float,
                 auth_token: str | None) -> None:
        self.metadata = metadata
        self.rank = rank
        self.compression = compression
        self.timeout_s = timeout_s
        self.auth_token = auth_token
        self._peers: dict[tuple[str, int], Any] = {}

    def peer(self, spec: DisaggSpec) -> Any:
        """The tier that stands for `spec`'s receiver rank (a cache-server client: fail-soft,
        refused connects noticed at once, an unreachable peer backed off)."""
        from lmcache_triton.storage.remote import CacheServerBackend

        address = (spec.receiver_host, rank_port(spec.receiver_init_port, self.rank))
        peer = self._peers.get(address)
        if peer is None:
            if len(self._peers) >= self._MAX_PEERS:
                old = self._peers.pop(next(iter(self._peers)))
                old.close()
            peer = self._peers[address] = CacheServerBackend(
                *address, self.metadata, compression=self.compression, timeout_s=self.timeout_s,
                auth_token=self.auth_token)
        return peer

    def send_request(self, req: ReqMeta, paged: PagedKV, saving: Saving) -> None:
        """Sends the request's prompt to the receiver its disagg spec names and waits, so the
        transfer is over before the prefill's reply leaves (in turn with the saves: the chunks this
        step's save is storing are then sent as stored). Never raises: a failed send is the
        decoder's miss."""
        spec = req.disagg_spec
        if spec is None:
            return
        try:
            n = tokens_with_slots(req)
            if req.token_offset or n <= 0:
                return
            tokens, kw = paged.move_args(req, 0, n)
            peer = self.peer(spec)
            # a send waits at most its chunks' timeouts: bound the wait by the same, generously
            held = saving.in_turn(req.req_id, lambda: paged.engine.send(tokens, to=peer, **kw),
                                  timeout=self.timeout_s * 4 + 30, what=f"sending request {req.req_id} to {peer.url}")
            log = logger.debug if held >= n else logger.warning
            log("lmcache_triton: request %s: the decoder at %s holds %d of its %d prompt tokens", req.req_id,
                peer.url, held, n)
        except Exception:
            logger.exception("lmcache_triton: sending request %s to its decoder failed", req.req_id)

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers = {}
