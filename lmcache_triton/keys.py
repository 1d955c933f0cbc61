"""Chunk keys: what names one stored chunk, and the hashes that go into it.

The lowest floor beside config and metadata: the engine, every tier and the cache server agree on
these names. Everything that changes a token's KV is part of its key (model, ranks, dtype, chunk
format, model variant and adapter, namespace, multimodal hashes); a secret never is (the
namespace is a keyed digest of the request's cache_salt).

Hashes are the same in every process, across restarts and machines (LMCache uses Python's
`hash()`, which changes with PYTHONHASHSEED). A chunk's token-chain hash is SHA-256 (truncated to
16 bytes) over the previous chunk's hash and the chunk's token ids as little-endian int64: the
bytes of vLLM's own token tensors, hashed where they lie. On the x86 hosts here SHA-256 runs on
the CPU's SHA instructions. Narrowing the ids to uint32 first (key scheme lmct4) halved the bytes
but needed a range check and a conversion per call: right after a 256 MiB store (caches cold,
as a lookup finds them) those two numpy calls took 115 of the 200 us spent on the ids of an
8K-token prompt, more than the extra 32 KiB of SHA-256.

A chunk's hash is taken in two steps (key scheme `lmct5`):

- the *token chain*, `chain_hash(hash of chunk i-1, ids of chunk i, its multimodal/extra bytes)`
  from `CHAIN_ROOT`: scope-free, so vLLM's scheduler computes it once per request as its tokens
  arrive (`TokenChain`) and ships 16 bytes per chunk (`ChunkHashes`) instead of the token ids;
- the *scope*, folded into each chunk by whoever makes the key (the worker):
  `scoped_hash(scope_seed(namespace digest, identity), chain hash)`, so chunks of one prompt
  still differ in every namespace, adapter and model variant, while the chain is hashed once.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import quote, unquote

import numpy as np
import torch

from lmcache_triton.metadata import LMCacheEngineMetadata

_HASH_BYTES = 16
_SEP = "@"
# Bump when the key scheme changes, so old entries can never match. v2: the namespace is a keyed
# digest (v1 wrote the cache_salt in clear) and `identity` names the model variant and adapter.
# v3: the chain over the tokens is scope-free and the scope is folded into each chunk's hash
# (`scoped_hash`), so the scheduler hashes a request's tokens once (v2 seeded the chain with the scope).
# v4: the chain is SHA-256 over uint32 token ids (v3: blake2b over int64 ids).
# v5: SHA-256 over int64 token ids, as they lie in vLLM's tensors.
_KEY_PREFIX = "lmct5"
# The token chain's hash "before the first chunk".
CHAIN_ROOT = hashlib.blake2b(b"lmcache-triton/token-chain/v5", digest_size=_HASH_BYTES).digest()
_ID_BYTES = 8  # token ids hashed as little-endian int64
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


def scope_seed(namespace_hex: str, identity: str) -> bytes:
    """What every key of a request folds in besides its tokens: the namespace digest and the
    identity (model variant + block layout, adapter). Keys of different scopes never match."""
    return hashlib.blake2b(f"{namespace_hex}\x00{identity}".encode(), digest_size=_HASH_BYTES,
                           person=b"lmct-scope").digest()


def scoped_hash(seed: bytes, span_hash: bytes) -> bytes:
    """A key's chunk hash: the scope's seed folded into a (scope-free) chain or segment hash."""
    return hashlib.blake2b(seed + span_hash, digest_size=_HASH_BYTES).digest()


def _id_array(tokens: torch.Tensor | np.ndarray | Sequence[int], start: int = 0,
              end: int | None = None) -> np.ndarray:
    """Token ids [start, end) as a contiguous little-endian int64 array; only that range is read.
    A CPU int64 tensor (what vLLM and the engine hand over) is read in place, without a copy. Ids
    that are not integers, or do not fit in int64, are an error, never another id's bytes."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype == torch.int64 and tokens.device.type == "cpu" and not tokens.requires_grad:
            ids = tokens.numpy()[start:end]   # a view: no torch op (each ~40 us with caches cold)
        elif tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got a {tokens.dtype} tensor")
        else:
            ids = tokens[start:end].detach().to(device="cpu", dtype=torch.int64).numpy()
    else:
        try:
            ids = tokens[start:end]  # lists, tuples, arrays and vLLM's ConstantList slice without a copy of the rest
        except TypeError:  # an iterable that does not slice
            ids = list(tokens)[start:end]
        if isinstance(ids, (list, tuple)):
            # Python ints (vLLM's prompt_token_ids): struct packs 8K of them in ~150 us here,
            # np.fromiter took ~450, np.asarray ~550; it refuses what is not an int64 as fromiter does
            try:
                return np.frombuffer(struct.pack(f"<{len(ids)}q", *ids), dtype="<i8")
            except struct.error as e:
                raise ValueError(f"token ids must be integers that fit in int64: {e}") from None
        if isinstance(ids, np.ndarray) and ids.dtype != np.int64:
            if ids.dtype.kind not in "iu":
                raise ValueError(f"token ids must be integers, got a {ids.dtype} array")
            if ids.dtype.kind == "u" and ids.dtype.itemsize == 8 and ids.size and int(ids.max()) > _INT64_MAX:
                raise ValueError(f"token id {int(ids.max())} does not fit in int64")
        try:
            if isinstance(ids, np.ndarray):
                ids = np.asarray(ids, dtype=np.int64)
            else:
                ids = np.fromiter(ids, dtype=np.int64, count=len(ids))
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"token ids must be integers that fit in int64: {e}") from None
    if _BIG_ENDIAN:
        ids = ids.astype("<i8")
    return ids if ids.flags.c_contiguous else np.ascontiguousarray(ids)


_INT64_MAX = 2**63 - 1
_BIG_ENDIAN = sys.byteorder != "little"


def chain_hash(prefix_hash: bytes, tokens: torch.Tensor | np.ndarray | Sequence[int] | memoryview,
               extra: bytes = b"") -> bytes:
    """Hash of one chunk given the hash of everything before it (`tokens` as ids, or as the bytes
    of their little-endian int64s)."""
    h = hashlib.sha256(prefix_hash)
    h.update(tokens if isinstance(tokens, memoryview) else _id_array(tokens))  # a buffer, no copy
    if extra:
        h.update(b"\x00extra\x00")
        h.update(extra)
    return h.digest()[:_HASH_BYTES]


def chunk_extra(i: int, start: int, end: int, mm_spans: Sequence[MMSpan] | None = None,
                extra_hashes: Sequence[bytes] | None = None) -> bytes:
    """Bytes folded into span i's hash: the caller's extra hash for it and the multimodal inputs
    whose placeholders overlap tokens [start, end)."""
    extra = extra_hashes[i] if extra_hashes is not None and i < len(extra_hashes) else b""
    return extra + spans_hash(mm_spans, start, end)


@dataclass(frozen=True)
class ChunkHashes:
    """Token-chain hashes of the spans of a sequence of `num_tokens` tokens, from span `first` on:
    span i is tokens [i * chunk_size, min((i + 1) * chunk_size, num_tokens)), so the last one is
    a partial chunk's when `num_tokens` is not a multiple of `chunk_size`. What the scheduler
    ships instead of token ids (16 bytes a chunk); scope-free (see the module's docstring)."""

    first: int
    hashes: tuple[bytes, ...]
    num_tokens: int
    chunk_size: int

    def __post_init__(self) -> None:
        if self.chunk_size <= 0 or self.first < 0 or self.num_tokens < 0:
            raise ValueError(f"bad ChunkHashes: first={self.first} num_tokens={self.num_tokens} "
                             f"chunk_size={self.chunk_size}")
        if self.first + len(self.hashes) > -(-self.num_tokens // self.chunk_size):
            raise ValueError(f"{len(self.hashes)} hashes from span {self.first} exceed the spans of "
                             f"{self.num_tokens} tokens")
        if not isinstance(self.hashes, tuple):
            object.__setattr__(self, "hashes", tuple(self.hashes))

    @property
    def start(self) -> int:
        """The first token the hashes name."""
        return self.first * self.chunk_size

    def get(self, i: int, start: int, end: int) -> bytes | None:
        """Span i's hash if these hashes name that very span, [start, end); else None (a span
        cut shorter, e.g. a load that stops mid-chunk, is another span)."""
        j = i - self.first
        if 0 <= j < len(self.hashes) and start == i * self.chunk_size and \
                end == min(start + self.chunk_size, self.num_tokens):
            return self.hashes[j]
        return None

    def since(self, token: int) -> ChunkHashes:
        """The hashes from the span holding token `token` (chunk-aligned) on."""
        if token % self.chunk_size or token < self.start:
            raise ValueError(f"hashes from token {token}: not a chunk boundary at or after {self.start}")
        return ChunkHashes(token // self.chunk_size, self.hashes[token // self.chunk_size - self.first:],
                           self.num_tokens, self.chunk_size)


class TokenChain:
    """The token-chain hashes of one growing token sequence, chunk by chunk: hash i =
    `chain_hash(hash i-1, ids of chunk i, chunk_extra(i))`, from `CHAIN_ROOT`.

    Scope-free: the namespace and identity are folded into each key later (`scoped_hash`). vLLM's
    scheduler keeps one per request and extends it as tokens arrive, so each whole chunk is hashed
    once however long the prompt and however many prefill steps; a partial tail is hashed when
    asked for and not kept (it changes as the sequence grows). `tokens` is always the sequence
    from position 0 (a list, tuple, array or 1-D tensor); only the ids not hashed yet are read.
    """

    def __init__(self, chunk_size: int, mm_spans: Sequence[MMSpan] | None = None,
                 extra_hashes: Sequence[bytes] | None = None) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self.mm_spans = list(mm_spans) if mm_spans else None
        self.extra_hashes = extra_hashes
        self.hashes: list[bytes] = []  # of whole chunks 0, 1, ...

    def _extra(self, i: int, start: int, end: int) -> bytes:
        return chunk_extra(i, start, end, self.mm_spans, self.extra_hashes)

    def extend(self, tokens: torch.Tensor | np.ndarray | Sequence[int], upto: int | None = None) -> list[bytes]:
        """Hashes the whole chunks of `tokens[:upto]` not hashed yet; returns every whole chunk's hash."""
        c = self.chunk_size
        full = (len(tokens) if upto is None else min(upto, len(tokens))) // c
        done = len(self.hashes)
        if full > done:
            # one conversion for all the new chunks; each chunk hashed straight from its bytes
            ids = memoryview(_id_array(tokens, done * c, full * c)).cast("B")
            prev = self.hashes[-1] if done else CHAIN_ROOT
            step = _ID_BYTES * c
            if self.mm_spans is None and self.extra_hashes is None:  # nothing else to fold in
                # chain_hash inlined: its call was a quarter of hashing 32 chunks (1 KiB each)
                for off in range(0, (full - done) * step, step):
                    h = hashlib.sha256(prev)
                    h.update(ids[off:off + step])
                    prev = h.digest()[:_HASH_BYTES]
                    self.hashes.append(prev)
            else:
                for i in range(done, full):
                    off = (i - done) * step
                    prev = chain_hash(prev, ids[off:off + step], self._extra(i, i * c, (i + 1) * c))
                    self.hashes.append(prev)
        return self.hashes

    def span_hash(self, tokens: torch.Tensor | np.ndarray | Sequence[int], i: int, end: int) -> bytes:
        """The hash of span i of `tokens[:end]`: a whole chunk's from the chain, or the partial
        tail's, hashed now."""
        c = self.chunk_size
        if end >= (i + 1) * c:
            return self.extend(tokens, (i + 1) * c)[i]
        prev = self.extend(tokens, i * c)[i - 1] if i else CHAIN_ROOT
        return chain_hash(prev, _id_array(tokens, i * c, end), self._extra(i, i * c, end))

    def chunk_hashes(self, tokens: torch.Tensor | np.ndarray | Sequence[int], end: int | None = None,
                     start: int = 0) -> ChunkHashes:
        """The hashes of the spans of `tokens[:end]` from the chunk holding token `start` (aligned
        down) on, the partial tail's included."""
        c = self.chunk_size
        end = len(tokens) if end is None else end
        if end > len(tokens):
            raise ValueError(f"hashes up to token {end} of a sequence of {len(tokens)}")
        first = min(start // c, -(-end // c))
        full = end // c
        hashes = self.extend(tokens, end)[first:full]
        if end % c and first <= full:
            hashes.append(self.span_hash(tokens, full, end))
        return ChunkHashes(first, tuple(hashes), end, c)


class CacheEngineKey(NamedTuple):
    """Names one stored chunk: model, ranks, dtype, chunk format, identity (model variant and
    adapter digest), namespace digest and chunk hash.

    `layer_id` is set for the per-layer keys of the layerwise mode (one object per layer).
    `namespace` is `namespace_digest(cache_salt)`, never the salt.

    Immutable; a tuple underneath, so every tier's dict hashes and compares keys in C (a frozen
    dataclass's Python `__hash__`/`__eq__` took most of a lookup's time per chunk).
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
        return tuple.__new__(CacheEngineKey, self[:_LAYER_AT] + (layer_id,) + self[_LAYER_AT + 1:])

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


_LAYER_AT = CacheEngineKey._fields.index("layer_id")


def make_key(metadata: LMCacheEngineMetadata, fmt: str, chunk_hash: bytes, namespace_hex: str = "",
             identity: str = "") -> CacheEngineKey:
    m = metadata
    return CacheEngineKey(model_name=m.model_name, world_size=m.world_size, worker_id=m.worker_id,
                          dtype=m.dtype_name, fmt=fmt, chunk_hash=chunk_hash.hex(), namespace=namespace_hex,
                          identity=identity)


def key_factory(metadata: LMCacheEngineMetadata, fmt: str, namespace_hex: str = "",
                identity: str = "") -> Callable[[bytes], CacheEngineKey]:
    """`make_key` for many chunks of one request: the scope is folded into each chunk's hash
    (`scoped_hash`) and the key built from a template (a lookup of a 128K-token prompt makes 512
    keys: each must cost well under a microsecond)."""
    seeded = hashlib.blake2b(scope_seed(namespace_hex, identity), digest_size=_HASH_BYTES)  # = scoped_hash
    template = make_key(metadata, fmt, b"", namespace_hex, identity)
    at = CacheEngineKey._fields.index("chunk_hash")
    head, tail, new = template[:at], template[at + 1:], tuple.__new__

    def make(span_hash: bytes) -> CacheEngineKey:
        h = seeded.copy()
        h.update(span_hash)
        return new(CacheEngineKey, head + (h.hexdigest(),) + tail)

    return make


@dataclass(frozen=True)
class KeyScope:
    """The request-level inputs of a request's keys besides its tokens."""

    namespace: str = ""  # the request's cache_salt: keys carry only a keyed digest of it
    adapter: str = ""    # the LoRA adapter: its KV is not the base model's
    mm_spans: Sequence[MMSpan] | None = None     # multimodal placeholders (offset, length, hash)
    extra_hashes: Sequence[bytes] | None = None  # per-chunk (or per-segment) bytes folded into the hash
    # Precomputed token-chain hashes (prefix chunks only; `TokenChain` over the same tokens,
    # mm_spans and extra_hashes): the keys are made from them instead of hashing the tokens again.
    # A plain sequence names the spans of the tokens from chunk 0.
    chunk_hashes: ChunkHashes | Sequence[bytes] | None = None
