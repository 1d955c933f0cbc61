"""Lookup messages over pyzmq: the scheduler's client (DEALER) to each worker's server (ROUTER).

Request frames: [header JSON, token ids as little-endian int64]; header
`{"v": 2, "seq": n, "id": lookup_id, "ns": namespace, "adapter": str, "mm": [[offset, length, hash], ...] | null}`.
The namespace travels in clear only here, between the scheduler and its own workers (IPC); every
key the workers make carries a keyed digest of it.
Reply frames: [`{"v": 1, "seq": n, "hit": tokens}`]. Sockets are IPC, named per vLLM engine id
and rank, so two vLLM instances on one host never answer each other.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

VERSION = 2


def socket_path(engine_id: str, rank: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:80]
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'lmct-lookup-{safe}-{rank}')}"


def encode_request(seq: int, lookup_id: str, tokens: list[int], namespace: str, adapter: str = "",
                   mm_spans: list | None = None, deadline: float | None = None) -> list[bytes]:
    """`deadline` (wall-clock seconds, same host) is when the client stops waiting for the answer."""
    header = {"v": VERSION, "seq": seq, "id": lookup_id, "ns": namespace, "adapter": adapter,
              "mm": [list(s) for s in mm_spans] if mm_spans else None, "deadline": deadline}
    return [json.dumps(header).encode(), np.asarray(tokens, dtype="<i8").tobytes()]


def decode_request(frames: list[bytes]) -> tuple[dict, list[int], list[tuple[int, int, str]] | None]:
    if len(frames) != 2:
        raise ValueError(f"lookup request must have 2 frames, got {len(frames)}")
    header = json.loads(frames[0])
    if header.get("v") != VERSION:
        raise ValueError(f"lookup protocol version {header.get('v')!r}, expected {VERSION}")
    if len(frames[1]) % 8:
        raise ValueError("lookup token frame is not a whole number of int64")
    tokens = np.frombuffer(frames[1], dtype="<i8").tolist()
    mm = [(int(o), int(n), str(h)) for o, n, h in header["mm"]] if header.get("mm") else None
    return header, tokens, mm


def encode_reply(seq: int, hit: int) -> list[bytes]:
    return [json.dumps({"v": VERSION, "seq": seq, "hit": hit}).encode()]


def decode_reply(frames: list[bytes]) -> tuple[int, int]:
    reply = json.loads(frames[-1])
    return int(reply["seq"]), int(reply["hit"])
