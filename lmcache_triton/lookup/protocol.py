"""Lookup messages over pyzmq: the scheduler's client (DEALER) to each worker's server (ROUTER).

Request frames: [header JSON, token ids as little-endian int64]; header
`{"v": 1, "seq": n, "id": lookup_id, "ns": namespace, "extra": [hex, ...] | null}`.
Reply frames: [`{"v": 1, "seq": n, "hit": tokens}`]. Sockets are IPC, named per vLLM engine id
and rank, so two vLLM instances on one host never answer each other.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np

VERSION = 1


def socket_path(engine_id: str, rank: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:80]
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'lmct-lookup-{safe}-{rank}')}"


def encode_request(seq: int, lookup_id: str, tokens: list[int], namespace: str,
                   extra_hashes: list[bytes] | None) -> list[bytes]:
    header = {"v": VERSION, "seq": seq, "id": lookup_id, "ns": namespace,
              "extra": [h.hex() for h in extra_hashes] if extra_hashes else None}
    return [json.dumps(header).encode(), np.asarray(tokens, dtype="<i8").tobytes()]


def decode_request(frames: list[bytes]) -> tuple[dict, list[int], list[bytes] | None]:
    if len(frames) != 2:
        raise ValueError(f"lookup request must have 2 frames, got {len(frames)}")
    header = json.loads(frames[0])
    if header.get("v") != VERSION:
        raise ValueError(f"lookup protocol version {header.get('v')!r}, expected {VERSION}")
    if len(frames[1]) % 8:
        raise ValueError("lookup token frame is not a whole number of int64")
    tokens = np.frombuffer(frames[1], dtype="<i8").tolist()
    extra = [bytes.fromhex(h) for h in header["extra"]] if header.get("extra") else None
    return header, tokens, extra


def encode_reply(seq: int, hit: int) -> list[bytes]:
    return [json.dumps({"v": VERSION, "seq": seq, "hit": hit}).encode()]


def decode_reply(frames: list[bytes]) -> tuple[int, int]:
    reply = json.loads(frames[-1])
    return int(reply["seq"]), int(reply["hit"])
