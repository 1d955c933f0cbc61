"""The cache server's wire format: one ZMQ multipart message per request and per reply.

    request  = [header frame, payload frame 0, ..., payload frame n-1]
    reply    = [header frame, payload frame 0, ..., payload frame n-1]

Request header (little-endian, 52 bytes + 8 per payload frame):

    magic b"LMCT" | version u8 | command u8 | flags u16 | request_id u64 |
    auth 32 bytes (sha256 of the token; zeros without one) | n_frames u32 | n_frames x length u64

Reply header (little-endian, 20 bytes + 8 per payload frame):

    magic b"LMCR" | version u8 | status u8 | command u8 | flags u8 | request_id u64 |
    n_frames u32 | n_frames x length u64

Declared lengths must equal the frames' real lengths; every count and length is bounded (`Limits`).
Values are opaque bytes to the protocol (a server with --disk reads a value's chunk header only to
decide whether to write it through). docs/wire-format.md has the per-command payloads. This module
is pure encoding: no sockets, no I/O.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

MAGIC_REQUEST = b"LMCT"
MAGIC_REPLY = b"LMCR"
VERSION = 1

_REQ = struct.Struct("<4sBBHQ32sI")
_REP = struct.Struct("<4sBBBBQI")
_LEN = struct.Struct("<Q")
_U32 = struct.Struct("<I")
NO_AUTH = bytes(32)

# Reply flag bits.
FLAG_TRUNCATED = 1  # LIST: more keys exist than were returned


class Command(IntEnum):
    PUT = 1      # [key, value]                       -> OK
    GET = 2      # [key]                              -> OK [value] | NOT_FOUND | BUSY
    EXISTS = 3   # [key 0, ..., key n-1]              -> OK [bitmap of ceil(n/8) bytes, bit i = key i]
    DELETE = 4   # [key]                              -> OK | NOT_FOUND
    LIST = 5     # [] or [limit u32]                  -> OK [key, ...] (FLAG_TRUNCATED when cut)
    STATS = 6    # []                                 -> OK [utf-8 JSON object]
    HEALTH = 7   # []                                 -> OK [b"ok"]


class Status(IntEnum):
    OK = 0
    NOT_FOUND = 1
    BAD_REQUEST = 2      # malformed header, wrong frame count or lengths, bad magic
    AUTH_FAILED = 3
    TOO_LARGE = 4        # key, value, key count or message over a limit
    UNKNOWN_COMMAND = 5
    BAD_VERSION = 6
    INTERNAL = 7
    BUSY = 8             # GET: too many reply bytes queued for clients that do not read; retry later


@dataclass(frozen=True)
class Limits:
    """Bounds every server and client enforces before touching a payload."""

    max_key_bytes: int = 1024
    max_value_bytes: int = 1 << 30
    max_keys_per_request: int = 4096  # EXISTS keys, LIST replies

    @property
    def max_frames(self) -> int:
        return self.max_keys_per_request

    @property
    def max_frame_bytes(self) -> int:
        """For ZMQ_MAXMSGSIZE: the largest single frame a peer may send (a value, plus slack)."""
        return self.max_value_bytes + 64 * 1024


class WireError(Exception):
    """A message that does not follow this format; `status` is what the server replies with."""

    def __init__(self, status: Status, message: str, request_id: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.request_id = request_id


@dataclass(frozen=True)
class Request:
    command: Command
    request_id: int
    auth: bytes
    frames: list  # of buffers (bytes, memoryview or zmq.Frame buffers)


@dataclass(frozen=True)
class Reply:
    status: Status
    command: int
    request_id: int
    flags: int
    frames: list


def auth_digest(token: str | None) -> bytes:
    """What travels in the header: a fixed-size digest, so the header's size never depends on the
    token. It is not a secret channel (a sniffer can replay it): run over loopback or a tunnel."""
    if not token:
        return NO_AUTH
    return hashlib.sha256(token.encode("utf-8")).digest()


def _lengths(frames: Sequence) -> bytes:
    return b"".join(_LEN.pack(memoryview(f).nbytes) for f in frames)


def encode_request(command: Command | int, request_id: int, frames: Sequence = (),
                   auth: bytes = NO_AUTH) -> list:
    header = _REQ.pack(MAGIC_REQUEST, VERSION, int(command), 0, request_id, auth, len(frames)) + _lengths(frames)
    return [header, *frames]


def encode_reply(status: Status, command: int, request_id: int, frames: Sequence = (), flags: int = 0) -> list:
    header = _REP.pack(MAGIC_REPLY, VERSION, int(status), int(command) & 0xFF, flags, request_id,
                       len(frames)) + _lengths(frames)
    return [header, *frames]


def _check_lengths(header: memoryview, offset: int, n: int, frames: Sequence, request_id: int) -> None:
    if len(frames) != n:
        raise WireError(Status.BAD_REQUEST, f"header declares {n} payload frames, message has {len(frames)}",
                        request_id)
    if header.nbytes != offset + 8 * n:
        raise WireError(Status.BAD_REQUEST,
                        f"header is {header.nbytes} bytes, expected {offset + 8 * n} for {n} frames", request_id)
    for i, f in enumerate(frames):
        (declared,) = _LEN.unpack_from(header, offset + 8 * i)
        actual = memoryview(f).nbytes
        if declared != actual:
            raise WireError(Status.BAD_REQUEST, f"frame {i} declared {declared} bytes, has {actual}", request_id)


def decode_request(parts: Sequence, limits: Limits = Limits()) -> Request:
    """Parses and bounds-checks a request (without the ROUTER identity). Raises WireError."""
    if not parts:
        raise WireError(Status.BAD_REQUEST, "empty message")
    header = memoryview(parts[0])
    if header.nbytes < _REQ.size:
        raise WireError(Status.BAD_REQUEST, f"header frame is {header.nbytes} bytes, need >= {_REQ.size}")
    magic, version, command, _flags, request_id, auth, n = _REQ.unpack_from(header)
    if magic != MAGIC_REQUEST:
        raise WireError(Status.BAD_REQUEST, f"bad magic {bytes(magic)!r}, expected {MAGIC_REQUEST!r}")
    if version != VERSION:
        raise WireError(Status.BAD_VERSION, f"protocol version {version} not supported (server speaks {VERSION})",
                        request_id)
    if n > limits.max_frames:
        raise WireError(Status.TOO_LARGE, f"{n} payload frames, limit {limits.max_frames}", request_id)
    _check_lengths(header, _REQ.size, n, parts[1:], request_id)
    try:
        cmd = Command(command)
    except ValueError:
        raise WireError(Status.UNKNOWN_COMMAND, f"unknown command {command}", request_id) from None
    return Request(cmd, request_id, bytes(auth), list(parts[1:]))


def decode_reply(parts: Sequence) -> Reply:
    """Parses a server reply. Raises WireError on anything malformed."""
    if not parts:
        raise WireError(Status.BAD_REQUEST, "empty reply")
    header = memoryview(parts[0])
    if header.nbytes < _REP.size:
        raise WireError(Status.BAD_REQUEST, f"reply header is {header.nbytes} bytes, need >= {_REP.size}")
    magic, version, status, command, flags, request_id, n = _REP.unpack_from(header)
    if magic != MAGIC_REPLY or version != VERSION:
        raise WireError(Status.BAD_REQUEST, f"reply has magic {bytes(magic)!r} version {version}")
    _check_lengths(header, _REP.size, n, parts[1:], request_id)
    try:
        st = Status(status)
    except ValueError:
        raise WireError(Status.BAD_REQUEST, f"reply has unknown status {status}", request_id) from None
    return Reply(st, command, request_id, flags, list(parts[1:]))


def pack_bits(bits: Sequence[bool]) -> bytes:
    """EXISTS reply: bit i (least significant first within each byte) says whether key i is stored."""
    out = bytearray((len(bits) + 7) // 8)
    for i, b in enumerate(bits):
        if b:
            out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def unpack_bits(data: bytes | memoryview, n: int) -> list[bool]:
    buf = bytes(data)
    if len(buf) != (n + 7) // 8:
        raise WireError(Status.BAD_REQUEST, f"EXISTS bitmap is {len(buf)} bytes, expected {(n + 7) // 8} for {n} keys")
    return [bool(buf[i >> 3] >> (i & 7) & 1) for i in range(n)]


def pack_u32(value: int) -> bytes:
    return _U32.pack(value)


def unpack_u32(data: bytes | memoryview) -> int:
    buf = memoryview(data)
    if buf.nbytes != 4:
        raise WireError(Status.BAD_REQUEST, f"expected a 4-byte u32, got {buf.nbytes} bytes")
    return _U32.unpack(buf)[0]
