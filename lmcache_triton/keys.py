"""Chunk keys: what names one stored chunk, and the hashes that go into it.

The lowest floor beside config and metadata: the engine, every tier and the cache server agree on
these names. Everything that changes a token's KV is part of its key (model, ranks, dtype, chunk
format, model variant and adapter, namespace, multimodal hashes); a secret never is (the
namespace is a keyed digest of the request's cache_salt).

Hashes are blake2b over the token ids as little-endian int64 bytes, the same in every process,
across restarts and machines (LMCache uses Python's `hash()`, which changes with PYTHONHASHSEED).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from urllib.parse import quote, unquote

import torch

from lmcache_triton.metadata import LMCacheEngineMetadata

_HASH_BYTES = 16
_SEP = "@"
# Bump when the key scheme changes, so old entries can never match. v2: the namespace is a keyed
# digest (v1 wrote the cache_salt in clear) and `identity` names the model variant and adapter.
_KEY_PREFIX = "lmct2"
# The blake2b key of namespace digests when the config sets no `namespace_secret`.
_NAMESPACE_KEY = b"lmcache-triton/namespace/v2"

# A multimodal input's placeholder tokens: (offset, length, content hash).
MMSpan = tuple[int, int, str]


def namespace_digest(namespace: str, secret: str | None = None) -> str:
    """What a key carries of a namespace (a request's `cache_salt`, which is a secret): a keyed
    blake2b digest, never the salt itself, so a server LIST, a Redis key, a file name or a log
    line reveals nothing a co-tenant could replay. With `secret` (config `namespace_secret`, the
    same on every instance sharing a store) the digests cannot even be checked against guesses."""
    if not namespace:
        return ""
    key = secret.encode() if secret else _NAMESPACE_KEY
    return hashlib.blake2b(namespace.encode(), key=key[:64], digest_size=_HASH_BYTES, person=b"lmct-ns").hexdigest()


def identity_digest(kv_identity: str, adapter: str) -> str:
    """One field for everything besides the tokens that changes their KV: the model variant
    (revision, quantization, rope overrides, KV cache dtype, block format: metadata.kv_identity)
    and the request's LoRA adapter. Empty when both are."""
    if not kv_identity and not adapter:
        return ""
    h = hashlib.blake2b(digest_size=8, person=b"lmct-id")
    h.update(kv_identity.encode())
    h.update(b"\x00")
    h.update(adapter.encode())
    return h.hexdigest()


def spans_hash(mm_spans: Sequence[MMSpan] | None, start: int, end: int) -> bytes:
    """The hashes of the multimodal inputs whose placeholders overlap tokens [start, end): the same
    placeholder ids with another image must never share KV. Empty when none overlaps."""
    if not mm_spans:
        return b""
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    hit = False
    for offset, length, mm_hash in mm_spans:
        if offset < end and offset + length > start:
            h.update(str(mm_hash).encode())
            h.update(b"\x00")
            hit = True
    return h.digest() if hit else b""


def chain_seed(namespace_hex: str, identity: str) -> bytes:
    """Hash 'before the first chunk': keys of different namespaces or identities never chain alike."""
    return hashlib.blake2b(f"{namespace_hex}\x00{identity}".encode(), digest_size=_HASH_BYTES).digest()


def _to_int64_bytes(tokens: torch.Tensor | Sequence[int]) -> bytes:
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().to(device="cpu", dtype=torch.int64).contiguous().numpy().tobytes()
    return torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()


def chain_hash(prefix_hash: bytes, tokens: torch.Tensor | Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of one chunk given the hash of everything before it."""
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(prefix_hash)
    h.update(_to_int64_bytes(tokens))
    if extra:
        h.update(b"\x00extra\x00")
        h.update(extra)
    return h.digest()


@dataclass(frozen=True)
class CacheEngineKey:
    """Names one stored chunk: model, ranks, dtype, chunk format, identity (model variant and
    adapter digest), namespace digest and chunk hash.

    `layer_id` is set for the per-layer keys of the layerwise mode (one object per layer).
    `namespace` is `namespace_digest(cache_salt)`, never the salt.
    """

    model_name: str
    world_size: int
    worker_id: int
    dtype: str
    fmt: str
    chunk_hash: str
    namespace: str = ""
    layer_id: int | None = None
    identity: str = ""

    def with_layer(self, layer_id: int) -> CacheEngineKey:
        return replace(self, layer_id=layer_id)

    def to_string(self) -> str:
        parts = [
            _KEY_PREFIX,
            quote(self.model_name, safe=""),
            str(self.world_size),
            str(self.worker_id),
            self.dtype,
            self.fmt,
            self.identity,
            quote(self.namespace, safe=""),
            self.chunk_hash,
        ]
        if self.layer_id is not None:
            parts.append(f"L{self.layer_id}")
        return _SEP.join(parts)

    @classmethod
    def from_string(cls, s: str) -> CacheEngineKey:
        parts = s.split(_SEP)
        if len(parts) not in (9, 10) or parts[0] != _KEY_PREFIX:
            raise ValueError(f"not a lmcache_triton key: {s!r}")
        layer_id = None
        if len(parts) == 10:
            if not parts[9].startswith("L"):
                raise ValueError(f"bad layer suffix in key: {s!r}")
            layer_id = int(parts[9][1:])
        return cls(
            model_name=unquote(parts[1]),
            world_size=int(parts[2]),
            worker_id=int(parts[3]),
            dtype=parts[4],
            fmt=parts[5],
            identity=parts[6],
            namespace=unquote(parts[7]),
            chunk_hash=parts[8],
            layer_id=layer_id,
        )

    def __str__(self) -> str:
        return self.to_string()


def make_key(metadata: LMCacheEngineMetadata, fmt: str, chunk_hash: bytes, namespace_hex: str = "",
             identity: str = "") -> CacheEngineKey:
    m = metadata
    return CacheEngineKey(model_name=m.model_name, world_size=m.world_size, worker_id=m.worker_id,
                          dtype=m.dtype_name, fmt=fmt, chunk_hash=chunk_hash.hex(), namespace=namespace_hex,
                          identity=identity)


@dataclass(frozen=True)
class KeyScope:
    """The request-level inputs of a request's keys besides its tokens."""

    namespace: str = ""  # the request's cache_salt: keys carry only a keyed digest of it
    adapter: str = ""    # the LoRA adapter: its KV is not the base model's
    mm_spans: Sequence[MMSpan] | None = None     # multimodal placeholders (offset, length, hash)
    extra_hashes: Sequence[bytes] | None = None  # per-chunk (or per-segment) bytes folded into the hash
