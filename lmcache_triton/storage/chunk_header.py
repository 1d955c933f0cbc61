"""A chunk's safetensors header, checked without torch: its integrity, version, key and sizes.

`serde` builds on it (dtype, shape and format checks need torch); the cache server's `--disk`
folder uses it alone, so a server process never imports torch (2 s and ~200 MB at start).

The header must be exactly the canonical JSON we write (sorted keys, no spaces, ASCII), padded
with spaces, and `header_crc` covers the rest of it: a flipped bit either breaks parsing, breaks
canonical form, or changes a value that the CRC then rejects.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

FORMAT_VERSION: int = 1

# A chunk's header is a few hundred bytes; a huge length means a corrupt length field, and
# refusing it early keeps a bit flip from making us read or allocate gigabytes.
MAX_HEADER_BYTES = 1 << 20

META_FIELDS = ("checksum", "compression", "dtype", "fmt", "header_crc", "key", "num_tokens", "shape", "version")


class SerdeError(Exception):
    """Bytes that are not a chunk we can vouch for; callers turn it into a miss."""


class UnsupportedVersionError(SerdeError):
    """A well-formed chunk of another FORMAT_VERSION (a newer writer may share the directory)."""


@dataclass(frozen=True)
class RawHeader:
    """A header whose bytes checked out; its values are still strings (serde.parse_header types them)."""

    meta: dict[str, str]       # __metadata__ without header_crc
    tensors: dict[str, Any]    # the one tensor entry, by name
    data_offset: int           # where the data section starts: 8 + header length
    payload_nbytes: int        # bytes of the data section as stored (compressed size for lz4)

    @property
    def key(self) -> str:
        return self.meta["key"]

    @property
    def file_nbytes(self) -> int:
        """Exact size of the whole serialized chunk."""
        return self.data_offset + self.payload_nbytes


def crc(data: bytes | memoryview) -> str:
    return f"crc32:{zlib.crc32(data):08x}"


def canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    try:
        mv = memoryview(data)
    except TypeError as e:
        raise SerdeError(f"chunk data must be bytes-like, got {type(data).__name__}") from e
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")
    return mv


def header_span(prefix: bytes | memoryview) -> int:
    """Bytes from the start of a chunk through the end of its JSON header, given its first 8."""
    if len(prefix) < 8:
        raise SerdeError(f"chunk is truncated: {len(prefix)} bytes, not even the 8-byte header length")
    (n,) = struct.unpack_from("<Q", prefix, 0)
    if n == 0 or n > MAX_HEADER_BYTES:
        raise SerdeError(f"chunk header length {n} is out of range (1..{MAX_HEADER_BYTES})")
    return 8 + n


def read_raw_header(data: bytes | memoryview) -> RawHeader:
    """Parses and verifies only the header; `data` may stop right after it (see header_span)."""
    mv = as_bytes_view(data)
    end = header_span(mv[:8])
    if len(mv) < end:
        raise SerdeError(f"chunk is truncated inside its header: {len(mv)} of {end} bytes")
    text = bytes(mv[8:end]).rstrip(b" ")
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise SerdeError(f"chunk header is not valid JSON: {e}") from None
    if not isinstance(header, dict) or canonical(header) != text:
        raise SerdeError("chunk header is not in canonical form (corrupt or not written by us)")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or sorted(meta) != sorted(META_FIELDS):
        raise SerdeError(f"chunk header metadata must have exactly the fields {META_FIELDS}")
    if not all(isinstance(v, str) for v in meta.values()):
        raise SerdeError("chunk header metadata values must be strings")
    stored_crc = meta.pop("header_crc")
    if crc(canonical({"__metadata__": meta, **header})) != stored_crc:
        raise SerdeError("chunk header checksum mismatch (corrupt header)")
    if meta["version"] != str(FORMAT_VERSION):
        raise UnsupportedVersionError(
            f"chunk format version {meta['version']!r} is not supported (this reader: {FORMAT_VERSION})")
    info = next(iter(header.values()), None)
    offsets = info.get("data_offsets") if len(header) == 1 and isinstance(info, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and offsets[0] == 0
            and isinstance(offsets[1], int) and offsets[1] >= 0):
        raise SerdeError(f"chunk header must describe exactly one tensor at data offsets [0, n], got {header}")
    return RawHeader(meta=meta, tensors=header, data_offset=end, payload_nbytes=offsets[1])
