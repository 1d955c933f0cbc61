"""Lookup messages over pyzmq: the scheduler's client (DEALER) to each worker's server (ROUTER).

Request frames: [header JSON, payload]; header
`{"v": 3, "seq": n, "id": lookup_id, "ns": namespace, "adapter": str, "deadline": seconds | null,
"n": tokens, "chunk": chunk_size | null, "mm": [[offset, length, hash], ...] | null}`.
With "chunk" set the payload is the prompt's token-chain hashes (`keys.ChunkHashes`: 16 bytes per
span of "chunk" tokens, the last span partial when "n" is not a multiple), computed once per
request by the scheduler: 8 KiB for a 128K-token prompt, where its ids take 1 MiB, and the worker
hashes nothing but the scope into each key. Without it (CacheBlend: segments are found in the ids)
the payload is the "n" token ids as little-endian int64, with the multimodal spans in "mm".
The namespace travels in clear only here, between the scheduler and its own workers (IPC); every
key the workers make carries a keyed digest of it.
Reply frames: [`{"v": 3, "seq": n, "hit": tokens}`]. Sockets are IPC, named per vLLM engine id
and rank, so two vLLM instances on one host never answer each other.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from lmcache_triton.integration.vllm.common import ipc_path
from lmcache_triton.keys import ChunkHashes, MMSpan

VERSION = 3  # v3: chunk hashes instead of token ids; v2 sent the ids
HASH_BYTES = 16


def socket_path(engine_id: str, rank: int) -> str:
    return ipc_path("lookup", engine_id, rank)


# The lookup servers of this process, by address: vLLM's engine core runs the scheduler and a
# single worker (UniProcExecutor) in one process, and there the client hands the encoded request
# to the server (`submit(frames, caller_waits)`: the reply frames, later) instead of through the
# socket. `caller_waits`: the client waits for the answer anyway (a synchronous lookup).
Submit = Callable[[list[bytes], bool], "Future[list[bytes]]"]
_in_process: dict[str, Submit] = {}
_in_process_lock = threading.Lock()


def serve_in_process(address: str, submit: Submit) -> None:
    with _in_process_lock:
        _in_process[address] = submit


def stop_serving_in_process(address: str, submit: Submit) -> None:
    with _in_process_lock:
        if _in_process.get(address) == submit:
            del _in_process[address]


def in_process(address: str) -> Submit | None:
    """How to submit to the server bound to `address` in this process; None: none is."""
    with _in_process_lock:
        return _in_process.get(address)


@dataclass
class LookupRequest:
    """A decoded request: the lookup's arguments for `engine.lookup`."""

    seq: int
    lookup_id: str
    namespace: str
    adapter: str
    deadline: float | None
    num_tokens: int
    tokens: list[int] | None = None           # without chunk hashes
    mm_spans: list[MMSpan] | None = None      # with tokens (the hashes have them folded in)
    chunk_hashes: ChunkHashes | None = None

    def lookup_args(self) -> tuple[list[int] | int, dict]:
        """(tokens, key arguments) of `engine.lookup`."""
        scope = dict(namespace=self.namespace, adapter=self.adapter)
        if self.chunk_hashes is not None:
            return self.num_tokens, dict(scope, chunk_hashes=self.chunk_hashes)
        return self.tokens, dict(scope, mm_spans=self.mm_spans)


def encode_request(seq: int, lookup_id: str, tokens, namespace: str, adapter: str = "",
                   mm_spans: list | None = None, deadline: float | None = None, *,
                   chunk_hashes: ChunkHashes | None = None) -> list[bytes]:
    """`deadline` (wall-clock seconds, same host) is when the client stops waiting for the answer.
    With `chunk_hashes` (of the spans of `tokens` from the first: their multimodal inputs are in
    them) only `len(tokens)` is read of `tokens`, and the hashes are sent."""
    header = {"v": VERSION, "seq": seq, "id": lookup_id, "ns": namespace, "adapter": adapter,
              "deadline": deadline, "n": len(tokens), "chunk": None, "mm": None}
    if chunk_hashes is not None:
        if chunk_hashes.first != 0 or chunk_hashes.num_tokens != len(tokens):
            raise ValueError("a lookup sends the hashes of every span of its tokens")
        header["chunk"] = chunk_hashes.chunk_size
        return [json.dumps(header).encode(), b"".join(chunk_hashes.hashes)]
    header["mm"] = [list(s) for s in mm_spans] if mm_spans else None
    return [json.dumps(header).encode(), np.asarray(tokens, dtype="<i8").tobytes()]


def decode_request(frames: list[bytes]) -> LookupRequest:
    if len(frames) != 2:
        raise ValueError(f"lookup request must have 2 frames, got {len(frames)}")
    header = json.loads(frames[0])
    if not isinstance(header, dict) or header.get("v") != VERSION:
        raise ValueError(f"lookup protocol version {header.get('v') if isinstance(header, dict) else None!r}, "
                         f"expected {VERSION}")
    n = int(header["n"])
    payload = bytes(frames[1])
    req = LookupRequest(seq=int(header["seq"]), lookup_id=str(header["id"]), namespace=str(header.get("ns") or ""),
                        adapter=str(header.get("adapter") or ""), deadline=header.get("deadline"), num_tokens=n)
    if header.get("chunk") is not None:
        chunk = int(header["chunk"])
        if chunk <= 0 or len(payload) != HASH_BYTES * -(-n // chunk):
            raise ValueError(f"lookup hash frame of {len(payload)} bytes for {n} tokens in chunks of {chunk}")
        hashes = tuple(payload[i:i + HASH_BYTES] for i in range(0, len(payload), HASH_BYTES))
        req.chunk_hashes = ChunkHashes(0, hashes, n, chunk)
        return req
    if len(payload) != 8 * n:
        raise ValueError(f"lookup token frame of {len(payload)} bytes for {n} int64 tokens")
    req.tokens = np.frombuffer(payload, dtype="<i8").tolist()
    req.mm_spans = [(int(o), int(k), str(h)) for o, k, h in header["mm"]] if header.get("mm") else None
    return req


def encode_reply(seq: int, hit: int) -> list[bytes]:
    return [json.dumps({"v": VERSION, "seq": seq, "hit": hit}).encode()]


def decode_reply(frames: list[bytes]) -> tuple[int, int]:
    reply = json.loads(frames[-1])
    return int(reply["seq"]), int(reply["hit"])
