"""Token ids -> the spans an engine caches -> their keys.

Two databases behind one protocol, chosen once when the engine is built:

- `ChunkedTokenDatabase` (prefix reuse, LMCache's default): `chunk_size` chunks keyed by a prefix
  hash chain, so chunk i is reused only behind the same chunks 0..i-1; a miss ends a load. The
  chain may come precomputed (`KeyScope.chunk_hashes`, from vLLM's scheduler): then the tokens
  may be given as their count alone, and nothing is hashed but the scope into each key.
- `SegmentTokenDatabase` (CacheBlend): the prompt is split at a separator and each segment is keyed
  on its own tokens, so a document is a hit wherever it appears; a miss skips one segment.

Segment rules (what a user caching documents relies on):
- The separator is a token sequence: `blend_special_str` (" # # ") tokenized *without* special
  tokens (LMCache drops the first id, assuming a BOS; that breaks for tokenizers that add none),
  or the ids given directly. Separator tokens belong to no segment and are never cached.
- A segment's hash is blake2b over b"segment" + its token ids (the tag keeps a segment key from
  ever equalling a chunk key of the same tokens), with the key scope folded in as for chunks
  (`keys.scoped_hash`).
- Segments shorter than `min_tokens` (config `blend_min_tokens`) are not cached: reusing a few
  tokens saves less than a lookup, a load and a re-rotation cost.
- The KV stored under a segment key is the segment's KV *as if it started at position 0*; the
  blender re-rotates K to where the segment sits in each prompt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from lmcache_triton.keys import (
    CacheEngineKey,
    ChunkHashes,
    KeyScope,
    TokenChain,
    chunk_extra,
    identity_digest,
    key_factory,
    make_key,
    namespace_digest,
)
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage.memory import MemoryFormat

Tokens = torch.Tensor | Sequence[int]
# The tokens of an engine call: their ids from position 0, or (prefix chunks with
# `KeyScope.chunk_hashes`) only their count.
TokensOrCount = Tokens | int
Span = tuple[int, int]

_HASH_BYTES = 16
_SEGMENT_TAG = b"segment"


class TokenDatabase(Protocol):
    """What the engine asks of a token database."""

    # True: span i is usable only behind spans 0..i-1 (a miss ends a lookup and a load).
    prefix_chain: bool
    fmt: str  # the MemoryFormat of the stored objects, part of every key

    def spans(self, tokens: TokensOrCount) -> list[Span]:
        """[start, end) of every span of `tokens` that is cached (stored, looked up, loaded)."""
        ...

    def cached_tokens(self, tokens: TokensOrCount) -> int:
        """How many tokens lie in the spans that are cached (prefix: where the last one ends)."""
        ...

    def num_skipped(self, tokens: TokensOrCount, mask: torch.Tensor | None = None,
                    scope: KeyScope = KeyScope()) -> int:
        """Leading tokens a call skips: those `mask` skips (vLLM holds them), and with tokens given
        as a count, those before the precomputed hashes."""
        ...

    def process_tokens(self, tokens: TokensOrCount, mask: torch.Tensor | None = None,
                       scope: KeyScope = KeyScope()) -> Iterator[tuple[int, int, CacheEngineKey]]:
        """(start, end, key) of every cached span not skipped, in token order."""
        ...


# ---- helpers shared by both databases -------------------------------------------------------------
def num_tokens(tokens: TokensOrCount) -> int:
    return tokens if isinstance(tokens, int) else len(tokens)


def as_token_tensor(tokens: Tokens) -> torch.Tensor:
    """1-D int64 CPU tensor of the token ids (the bytes every hash is taken over)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if tokens.dtype == torch.int64 and tokens.device.type == "cpu" and not tokens.requires_grad:
            return tokens
        return tokens.detach().to("cpu", torch.int64)
    return torch.tensor(list(tokens), dtype=torch.int64)


def skipped_prefix(mask: torch.Tensor | None, num_tokens: int) -> int:
    """Leading tokens `mask` skips (vLLM already holds them); the mask must be False...False True...True."""
    if mask is None:
        return 0
    if mask.dim() != 1 or mask.numel() != num_tokens:
        raise ValueError(f"mask must be 1-D with {num_tokens} entries, got shape {tuple(mask.shape)}")
    mask = mask.to(device="cpu", dtype=torch.bool)
    n_false = int(num_tokens - mask.sum().item())
    if n_false and mask[:n_false].any():
        raise ValueError("mask must be a run of False (the skipped prefix) followed by True")
    return n_false


def _extra(scope: KeyScope, i: int, start: int, end: int) -> bytes:
    """Bytes folded into span i's hash: the caller's extra hash and the overlapping multimodal inputs."""
    return chunk_extra(i, start, end, scope.mm_spans, scope.extra_hashes)


def _default_fmt(metadata: LMCacheEngineMetadata, fmt: MemoryFormat | str | None, plain: MemoryFormat) -> str:
    if fmt is None:
        fmt = MemoryFormat.KV_MLA if metadata.use_mla else plain
    return MemoryFormat(fmt).value


class _KeyedDatabase:
    """Key construction common to both databases."""

    metadata: LMCacheEngineMetadata
    fmt: str
    namespace_secret: str | None

    def make_key(self, span_hash: bytes, namespace_hex: str = "", identity: str = "") -> CacheEngineKey:
        """The key of a span whose hash already folds in its scope."""
        return make_key(self.metadata, self.fmt, span_hash, namespace_hex, identity)

    def key_scope(self, namespace: str, adapter: str) -> tuple[str, str]:
        """(namespace digest, identity) of the keys of a request."""
        return (namespace_digest(namespace, self.namespace_secret),
                identity_digest(self.metadata.kv_identity, adapter))

    # Per scope (namespace digest, identity): its key factory (making one takes ~15 us) and the
    # keys it made lately, per span hash: the same chunks are keyed again and again (a prompt's
    # lookup, then its load; a system prompt in every request), and a cached key costs a dict read
    # where making one costs a hash and a tuple. Bounded: emptied when it holds this many keys or
    # scopes.
    KEY_CACHE_SIZE = 1 << 16
    SCOPE_CACHE_SIZE = 1 << 10
    _scopes: dict[tuple[str, str], tuple[Callable[[bytes], CacheEngineKey], dict[bytes, CacheEngineKey]]] | None = None
    _key_cache_len = 0

    def scoped_keys(self, scope: KeyScope) -> Callable[[bytes], CacheEngineKey]:
        """Span hash (scope-free) -> key: the namespace digest and identity folded into the hash
        (`keys.scoped_hash`) and named in the key."""
        if self._scopes is None or len(self._scopes) > self.SCOPE_CACHE_SIZE:
            self._scopes, self._key_cache_len = {}, 0
        # by the request's own (namespace, adapter): the two digests of key_scope are not taken
        # again for every call (~25 us with caches cold, in a 0.5 ms lookup)
        entry = self._scopes.get((scope.namespace, scope.adapter))
        if entry is None:
            ns_hex, identity = self.key_scope(scope.namespace, scope.adapter)
            entry = self._scopes[(scope.namespace, scope.adapter)] = (
                key_factory(self.metadata, self.fmt, ns_hex, identity), {})
        factory, cached = entry

        def make(span_hash: bytes) -> CacheEngineKey:
            key = cached.get(span_hash)
            if key is None:
                key = cached[span_hash] = factory(span_hash)
                self._key_cache_len += 1
                if self._key_cache_len > self.KEY_CACHE_SIZE:  # other threads may still fill an emptied one
                    self._scopes, self._key_cache_len = {}, 0
            return key

        return make


# ---- prefix chunks ---------------------------------------------------------------------------------
class ChunkedTokenDatabase(_KeyedDatabase):
    """Splits token ids into `chunk_size` chunks and keys each with the prefix hash chain."""

    prefix_chain = True

    def __init__(self, chunk_size: int, metadata: LMCacheEngineMetadata, *, save_unfull_chunk: bool = True,
                 fmt: MemoryFormat | str | None = None, namespace_secret: str | None = None) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self.metadata = metadata
        self.save_unfull_chunk = save_unfull_chunk
        self.fmt = _default_fmt(metadata, fmt, MemoryFormat.KV_2LTD)
        self.namespace_secret = namespace_secret

    def num_chunks(self, num_tokens: int) -> int:
        """How many chunks are kept for `num_tokens` tokens (a partial tail only if enabled)."""
        c = self.chunk_size
        return num_tokens // c + (1 if num_tokens % c and self.save_unfull_chunk else 0)

    def chunk_bounds(self, num_tokens: int) -> list[Span]:
        """[start, end) of every chunk kept for `num_tokens` tokens (a partial tail only if enabled)."""
        c = self.chunk_size
        return list(zip(range(0, num_tokens, c), [*range(c, num_tokens, c), num_tokens]))[:self.num_chunks(num_tokens)]

    def cached_tokens(self, tokens: TokensOrCount) -> int:
        n = num_tokens(tokens)
        return n if self.num_chunks(n) * self.chunk_size >= n else n // self.chunk_size * self.chunk_size

    def spans(self, tokens: TokensOrCount) -> list[Span]:
        return self.chunk_bounds(num_tokens(tokens))

    def chunk_hashes(self, hashes: ChunkHashes | Sequence[bytes] | None, n: int) -> ChunkHashes | None:
        """`KeyScope.chunk_hashes` as ChunkHashes (a plain sequence names the spans of the `n` tokens from 0)."""
        if hashes is None:
            return None
        if not isinstance(hashes, ChunkHashes):
            hashes = ChunkHashes(0, tuple(hashes), n, self.chunk_size)
        if hashes.chunk_size != self.chunk_size:
            raise ValueError(f"chunk hashes of {hashes.chunk_size}-token chunks for a database of "
                             f"chunk_size={self.chunk_size}")
        return hashes

    def num_skipped(self, tokens: TokensOrCount, mask: torch.Tensor | None = None,
                    scope: KeyScope = KeyScope()) -> int:
        """Leading tokens skipped: a whole number of chunks. The mask's skipped prefix; with tokens
        given as a count, also every chunk before the precomputed hashes (nothing keys them)."""
        n = num_tokens(tokens)
        n_false = skipped_prefix(mask, n)
        if n_false % self.chunk_size != 0:
            raise ValueError(
                f"mask must skip a chunk-aligned prefix: {n_false} skipped tokens is not a multiple of "
                f"chunk_size={self.chunk_size}"
            )
        if isinstance(tokens, int):
            hashes = self.chunk_hashes(scope.chunk_hashes, n)
            if hashes is None:
                raise ValueError("tokens given as a count need KeyScope.chunk_hashes")
            n_false = max(n_false, min(hashes.start, n))
        return n_false

    def process_tokens(self, tokens: TokensOrCount, mask: torch.Tensor | None = None,
                       scope: KeyScope = KeyScope()) -> Iterator[tuple[int, int, CacheEngineKey]]:
        """`scope.mm_spans` and `scope.extra_hashes[i]` (any bytes for chunk i) are folded into the
        chunk hashes: the same placeholder token ids with other images must not share KV.

        With `scope.chunk_hashes` (the same chain, precomputed: `TokenChain`), a span they name
        is not hashed again; a span they do not name is hashed from the token ids, and with
        tokens given as a count it cannot be keyed, so it and every span behind it are left out
        (a miss, never a wrong key)."""
        if isinstance(tokens, torch.Tensor):
            tokens = as_token_tensor(tokens)  # 1-D, on the CPU
        n = num_tokens(tokens)
        skip = self.num_skipped(tokens, mask, scope)
        given = self.chunk_hashes(scope.chunk_hashes, n)
        make = self.scoped_keys(scope)
        c = self.chunk_size
        spans = self.num_chunks(n)
        first = skip // c
        if given is not None and given.first <= first:
            # The whole chunks both `given` and these tokens have: their keys at once (a lookup of
            # a 128K-token prompt is 512 of them), no per-span checks.
            last = min(given.first + len(given.hashes), given.num_tokens // c, n // c, spans)
            if last > first:
                keys = [make(h) for h in given.hashes[first - given.first:last - given.first]]
                yield from zip(range(first * c, last * c, c), range((first + 1) * c, (last + 1) * c, c), keys)
                first = last
        chain: TokenChain | None = None
        if given is None and not isinstance(tokens, int) and first < n // c:
            # No precomputed hashes: every whole chunk hashed from one conversion of the ids (a
            # chunk at a time took ~80% of an 8K-token lookup, 1.5 ms for 32 chunks), keyed at once.
            chain = TokenChain(self.chunk_size, scope.mm_spans, scope.extra_hashes)
            last = min(n // c, spans)
            keys = [make(h) for h in chain.extend(tokens, n)[first:last]]
            yield from zip(range(first * c, last * c, c), range((first + 1) * c, (last + 1) * c, c), keys)
            first = last
        for i in range(first, spans):
            start, end = i * c, min((i + 1) * c, n)
            if end <= skip:
                continue
            h = given.get(i, start, end) if given is not None else None
            if h is None:
                if isinstance(tokens, int):
                    return
                if chain is None:
                    chain = TokenChain(self.chunk_size, scope.mm_spans, scope.extra_hashes)
                    if given is not None and given.first == 0:  # its whole chunks start the chain
                        chain.hashes = list(given.hashes[:given.num_tokens // self.chunk_size])
                    chain.extend(tokens, n)  # the rest of the whole chunks, from one conversion
                h = chain.hashes[i] if end - start == c else chain.span_hash(tokens, i, end)
            yield start, end, make(h)


# ---- CacheBlend segments ---------------------------------------------------------------------------
def segment_hash(tokens: torch.Tensor) -> bytes:
    """A segment's own hash (scope-free: the key folds the scope in, as for chunks)."""
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(_SEGMENT_TAG)
    h.update(b"\x00")
    h.update(tokens.to(torch.int64).contiguous().numpy().astype("<i8", copy=False).tobytes())
    return h.digest()


def find_separators(tokens: torch.Tensor, sep: torch.Tensor) -> list[int]:
    """Start indices of the non-overlapping occurrences of `sep` in `tokens`, left to right."""
    n, m = len(tokens), len(sep)
    if m == 0 or n < m:
        return []
    hits = (tokens.unfold(0, m, 1) == sep).all(dim=1).nonzero().flatten().tolist()
    out: list[int] = []
    for i in hits:  # "a a a" with separator "a a": one match, not two overlapping ones
        if not out or i >= out[-1] + m:
            out.append(i)
    return out


def split_segments(tokens: torch.Tensor, sep: torch.Tensor) -> list[Span]:
    """[start, end) of every non-empty segment between separators."""
    bounds, start = [], 0
    for i in find_separators(tokens, sep):
        bounds.append((start, i))
        start = i + len(sep)
    bounds.append((start, len(tokens)))
    return [(s, e) for s, e in bounds if e > s]


def separator_ids(special_str: str, tokenizer: Any) -> list[int]:
    """The ids of `special_str` without BOS/EOS: what the tokenizer puts between documents."""
    ids = tokenizer.encode(special_str, add_special_tokens=False)
    if not ids:
        raise ValueError(f"blend separator {special_str!r} tokenizes to no ids")
    return list(ids)


class SegmentTokenDatabase(_KeyedDatabase):
    """Splits token ids at a separator and keys each segment on its own tokens."""

    prefix_chain = False

    def __init__(self, metadata: LMCacheEngineMetadata, separator: Tokens, *, min_tokens: int = 256,
                 fmt: MemoryFormat | str | None = None, namespace_secret: str | None = None) -> None:
        sep = as_token_tensor(separator)
        if len(sep) == 0:
            raise ValueError("separator must have at least one token id")
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.metadata = metadata
        self.separator = sep
        self.min_tokens = min_tokens
        self.fmt = _default_fmt(metadata, fmt, MemoryFormat.KV_T2D)  # blending is layerwise
        self.namespace_secret = namespace_secret

    @classmethod
    def from_config(cls, config: Any, metadata: LMCacheEngineMetadata, tokenizer: Any = None, *,
                    separator: Sequence[int] | None = None, fmt: MemoryFormat | str | None = None
                    ) -> SegmentTokenDatabase:
        """From `blend_special_str` + the model's tokenizer, or from `separator` ids."""
        if separator is None:
            if tokenizer is None:
                raise ValueError("SegmentTokenDatabase needs the model's tokenizer or the separator ids")
            separator = separator_ids(config.blend_special_str, tokenizer)
        return cls(metadata, separator, min_tokens=config.blend_min_tokens, fmt=fmt,
                   namespace_secret=config.namespace_secret)

    def segment_bounds(self, tokens: Tokens) -> list[Span]:
        """[start, end) of the segments that are cached (at least `min_tokens` long)."""
        return [(s, e) for s, e in split_segments(as_token_tensor(tokens), self.separator)
                if e - s >= self.min_tokens]

    spans = segment_bounds

    def cached_tokens(self, tokens: TokensOrCount) -> int:
        return sum(e - s for s, e in self.segment_bounds(tokens))

    def num_skipped(self, tokens: TokensOrCount, mask: torch.Tensor | None = None,
                    scope: KeyScope = KeyScope()) -> int:
        return skipped_prefix(mask, num_tokens(tokens))

    def process_tokens(self, tokens: TokensOrCount, mask: torch.Tensor | None = None,
                       scope: KeyScope = KeyScope()) -> Iterator[tuple[int, int, CacheEngineKey]]:
        """A segment is skipped if it ends at or before the mask's first True (vLLM holds it).
        `scope.mm_spans` are folded into the segments they overlap; `scope.extra_hashes[i]` into
        segment i's hash (i counts cached segments). Segments are found in the token ids, so those
        are needed (precomputed prefix-chain hashes do not apply)."""
        if isinstance(tokens, int) or scope.chunk_hashes is not None:
            raise ValueError("segment keys are taken over the token ids: give the ids, not chunk hashes")
        tokens = as_token_tensor(tokens)
        skip = skipped_prefix(mask, len(tokens))
        make = self.scoped_keys(scope)
        for i, (start, end) in enumerate(self.segment_bounds(tokens)):
            if end <= skip:
                continue
            h = segment_hash(tokens[start:end])
            extra = _extra(scope, i, start, end)
            if extra:
                h = hashlib.blake2b(h + extra, digest_size=_HASH_BYTES).digest()
            yield start, end, make(h)
