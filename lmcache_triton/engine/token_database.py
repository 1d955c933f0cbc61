"""Token ids -> chunks -> keys.

A key is derived from a prefix hash chain: chunk i's hash covers every token before its end, so a
chunk can only be reused behind the same prefix. The hash is blake2b over the token ids as
little-endian int64 bytes, which is the same in every process, across restarts and machines
(LMCache uses Python's `hash()`, which changes with PYTHONHASHSEED).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from urllib.parse import quote, unquote

import torch

from lmcache_triton.storage.memory import MemoryFormat
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


class ChunkedTokenDatabase:
    """Splits token ids into `chunk_size` chunks and keys each with the prefix hash chain."""

    prefix_chain = True  # chunk i is only usable behind chunks 0..i-1: a miss ends every load

    def __init__(self, chunk_size: int, metadata: LMCacheEngineMetadata, *, save_unfull_chunk: bool = True,
                 fmt: MemoryFormat | str | None = None, namespace_secret: str | None = None) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self.metadata = metadata
        self.save_unfull_chunk = save_unfull_chunk
        if fmt is None:
            fmt = MemoryFormat.KV_MLA if metadata.use_mla else MemoryFormat.KV_2LTD
        self.fmt = MemoryFormat(fmt).value
        self.namespace_secret = namespace_secret

    def make_key(self, chunk_hash: bytes, namespace_hex: str = "", identity: str = "") -> CacheEngineKey:
        return make_key(self.metadata, self.fmt, chunk_hash, namespace_hex, identity)

    def key_scope(self, namespace: str, adapter: str) -> tuple[str, str]:
        """(namespace digest, identity) of the keys of a request."""
        return (namespace_digest(namespace, self.namespace_secret),
                identity_digest(self.metadata.kv_identity, adapter))

    def chunk_bounds(self, num_tokens: int) -> list[tuple[int, int]]:
        """[start, end) of every chunk kept for `num_tokens` tokens (a partial tail only if enabled)."""
        bounds = [(s, min(s + self.chunk_size, num_tokens)) for s in range(0, num_tokens, self.chunk_size)]
        if bounds and bounds[-1][1] - bounds[-1][0] < self.chunk_size and not self.save_unfull_chunk:
            bounds.pop()
        return bounds

    def num_skipped(self, num_tokens: int, mask: torch.Tensor | None) -> int:
        """Leading tokens a mask tells us to skip; the mask must be False...False True...True."""
        if mask is None:
            return 0
        if mask.dim() != 1 or mask.numel() != num_tokens:
            raise ValueError(f"mask must be 1-D with {num_tokens} entries, got shape {tuple(mask.shape)}")
        mask = mask.to(device="cpu", dtype=torch.bool)
        n_false = int(num_tokens - mask.sum().item())
        if n_false and mask[:n_false].any():
            raise ValueError("mask must be a run of False (the skipped prefix) followed by True")
        if n_false % self.chunk_size != 0:
            raise ValueError(
                f"mask must skip a chunk-aligned prefix: {n_false} skipped tokens is not a multiple of "
                f"chunk_size={self.chunk_size}"
            )
        return n_false

    def process_tokens(
        self,
        tokens: torch.Tensor | Sequence[int],
        mask: torch.Tensor | None = None,
        *,
        namespace: str = "",
        extra_hashes: Sequence[bytes] | None = None,
        adapter: str = "",
        mm_spans: Sequence[MMSpan] | None = None,
    ) -> Iterator[tuple[int, int, CacheEngineKey]]:
        """Yields (start, end, key) for each chunk not skipped by the mask, in token order.

        `mm_spans` (multimodal inputs) and `extra_hashes[i]` (any bytes for chunk i) are folded
        into the chunk hashes: the same placeholder token ids with other images must not share KV.
        `adapter` names the LoRA adapter (its KV differs from the base model's).
        """
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1:
                raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
            tokens = tokens.detach().to("cpu", torch.int64)
        num_tokens = len(tokens)
        skip = self.num_skipped(num_tokens, mask)
        ns_hex, identity = self.key_scope(namespace, adapter)
        prefix = chain_seed(ns_hex, identity)
        for i, (start, end) in enumerate(self.chunk_bounds(num_tokens)):
            extra = extra_hashes[i] if extra_hashes is not None and i < len(extra_hashes) else b""
            extra += spans_hash(mm_spans, start, end)
            prefix = chain_hash(prefix, tokens[start:end], extra)
            if end <= skip:
                continue
            yield start, end, self.make_key(prefix, ns_hex, identity)
