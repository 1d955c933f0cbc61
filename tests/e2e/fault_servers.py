"""Misbehaving peers of the cache server protocol, for tests/e2e/test_faults_e2e.py.

    python fault_servers.py garbage --port P --stats FILE [--huge-mb 8] [--max-lifetime 600]
    python fault_servers.py slow-reader --port P --ready FILE [--values 8] [--value-mb 2] [--gets 600]

`garbage`: a ROUTER on 127.0.0.1:P that answers every request (but HEALTH, answered honestly so
the test can wait for it) with one fault, in turn: random bytes, a reply that lies (EXISTS: every
key stored; GET: random bytes as the value), a header whose lengths do not match its frames, a
well-formed reply with another request id, a frame far over the client's ZMQ_MAXMSGSIZE. After
each reply it rewrites FILE (JSON: how many replies of each kind, and requests seen).

`slow-reader`: stores a few big values on the real cache server at P, then sends many GETs of them
from a DEALER that never reads a reply (a tiny receive window), until a GET of another value is
refused BUSY (the server's pending-reply budget is held by the replies queued for it). It then
writes FILE (JSON: whether BUSY was seen, and the server's STATS) and keeps its socket open, still
not reading, until it is killed or --max-lifetime passes.

Both are bounded in time and listen or connect on loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import zmq

from lmcache_triton.server import wire
from lmcache_triton.server.wire import Command, Status

# In turn, the quick failures first: the slow ones (the client waits out its timeout, then backs off
# and skips calls for a while) come after, so a short run still sees every kind.
MODES = ("random_bytes", "lying_ok", "bad_lengths", "wrong_request_id", "huge_frame")


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(data))
    os.replace(tmp, path)


def _garbage_reply(mode: str, req: wire.Request | None, rng: random.Random, huge_bytes: int) -> list[bytes]:
    rid = req.request_id if req is not None else 0
    cmd = int(req.command) if req is not None else 0
    if mode == "random_bytes":
        return [rng.randbytes(rng.randrange(1, 64)) for _ in range(rng.randrange(1, 4))]
    if mode == "huge_frame":  # the client's MAXMSGSIZE makes ZMQ drop the connection, unread
        return wire.encode_reply(Status.OK, cmd, rid, [bytes(huge_bytes)])
    if mode == "wrong_request_id":  # what a late reply looks like: the client must keep waiting, then give up
        return wire.encode_reply(Status.NOT_FOUND, cmd, rid + 1000)
    if mode == "lying_ok":
        if req is not None and req.command == Command.EXISTS:
            n = len(req.frames)
            return wire.encode_reply(Status.OK, cmd, rid, [wire.pack_bits([True] * n)])
        if req is not None and req.command == Command.GET:
            return wire.encode_reply(Status.OK, cmd, rid, [rng.randbytes(4096)])
        return wire.encode_reply(Status.OK, cmd, rid)
    if mode == "bad_lengths":
        header = wire.encode_reply(Status.OK, cmd, rid, [bytes(100)])[0]
        return [header, bytes(10)]
    raise ValueError(mode)


def garbage(args: argparse.Namespace) -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{args.port}")
    rng = random.Random(0)
    counts = dict.fromkeys(MODES, 0) | {"requests": 0, "health": 0}
    huge = int(args.huge_mb * (1 << 20))
    n = 0
    deadline = time.monotonic() + args.max_lifetime
    _write_json(args.stats, counts)
    while time.monotonic() < deadline:
        if not sock.poll(200):
            continue
        ident, *parts = sock.recv_multipart()
        counts["requests"] += 1
        try:
            req = wire.decode_request(parts)
        except wire.WireError:
            req = None
        if req is not None and req.command == Command.HEALTH:
            counts["health"] += 1
            reply = wire.encode_reply(Status.OK, int(req.command), req.request_id, [b"ok"])
        else:
            mode = MODES[n % len(MODES)]
            n += 1
            counts[mode] += 1
            reply = _garbage_reply(mode, req, rng, huge)
        try:
            sock.send_multipart([ident, *reply], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        _write_json(args.stats, counts)
    return 0


def slow_reader(args: argparse.Namespace) -> int:
    from lmcache_triton.storage.remote import CacheServerClient, RemoteError

    client = CacheServerClient("127.0.0.1", args.port, timeout_s=5.0)
    keys = [f"slow-reader-{i}".encode() for i in range(args.values)]
    size = int(args.value_mb * (1 << 20))
    for i, k in enumerate(keys):
        client.put(k, bytes([i]) * size)
    # The probe: a value of its own (the budget counts each distinct value once, so a GET of a value
    # already queued for the reader always fits), as big as one of vLLM's chunks here.
    client.put(b"slow-reader-probe", bytes(128 << 10))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)  # a tiny window: what it does not read stays queued in the server
    sock.connect(f"tcp://127.0.0.1:{args.port}")
    for i in range(args.gets):
        sock.send_multipart(wire.encode_request(Command.GET, i + 1, [keys[i % len(keys)]]))
    busy = False
    deadline = time.monotonic() + 10
    while not busy and time.monotonic() < deadline:
        try:
            client.get(b"slow-reader-probe")
        except RemoteError as e:
            busy = "BUSY" in str(e)
        time.sleep(0.05)
    _write_json(args.ready, {"busy": busy, "gets_sent": args.gets, "stats": client.stats()})
    client.close()
    time.sleep(args.max_lifetime)  # never reads; killed by the test (or gives up here)
    sock.close(0)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("garbage")
    g.add_argument("--port", type=int, required=True)
    g.add_argument("--stats", required=True)
    g.add_argument("--huge-mb", type=float, default=8.0)
    g.add_argument("--max-lifetime", type=float, default=600.0)
    g.set_defaults(func=garbage)
    s = sub.add_parser("slow-reader")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--ready", required=True)
    s.add_argument("--values", type=int, default=8)
    s.add_argument("--value-mb", type=float, default=2.0)
    s.add_argument("--gets", type=int, default=600)
    s.add_argument("--max-lifetime", type=float, default=600.0)
    s.set_defaults(func=slow_reader)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
