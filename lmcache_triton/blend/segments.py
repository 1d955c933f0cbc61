"""Segment keys for CacheBlend: a prompt is split at a separator and each segment is keyed on its
own tokens, so a document is a hit wherever it appears in a prompt.

Rules (what a user caching documents relies on):

- The separator is a token sequence: `blend_special_str` (" # # ") tokenized *without* special
  tokens (LMCache drops the first id, assuming a BOS; that breaks for tokenizers that add none),
  or the ids given directly.
- Separator tokens belong to no segment: they are never cached, so the blender recomputes them.
- A segment's key is blake2b over b"segment" + the namespace digest and identity (model variant,
  adapter) + its token ids as int64 bytes; no prefix chain. Multimodal inputs are folded into the
  segments their placeholders overlap (not into "chunk i"). Model, ranks, dtype and format are in the `CacheEngineKey` as for chunk keys, and
  the b"segment" tag keeps a segment key from ever equalling a chunk key of the same tokens.
- Segments shorter than `min_tokens` (config `blend_min_tokens`) are not cached: reusing a few
  tokens saves less than a lookup, a load and a re-rotation cost, and short runs (a question, a
  greeting) are rarely repeated. They are not yielded, so they are neither stored nor looked up.
- Empty segments (two separators in a row, a separator at either end) yield nothing.
- With a mask (False...False True...True, as for chunk keys) a segment is skipped if it ends at or
  before the first True: vLLM already holds those tokens.

The KV stored under a segment key is the segment's KV *as if it started at position 0*; the
blender re-rotates K to where the segment sits in each prompt (see blender.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lmcache_triton.storage.memory import MemoryFormat
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.engine.token_database import CacheEngineKey, MMSpan, chain_seed, identity_digest, make_key, namespace_digest, spans_hash

_HASH_BYTES = 16
_DOMAIN = b"segment"


def _as_tensor(tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        return tokens.detach().to("cpu", torch.int64)
    return torch.tensor(list(tokens), dtype=torch.int64)


def segment_hash(tokens: torch.Tensor, scope: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(_DOMAIN)
    h.update(scope)
    h.update(b"\x00")
    h.update(tokens.contiguous().numpy().tobytes())
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


def split_segments(tokens: torch.Tensor, sep: torch.Tensor) -> list[tuple[int, int]]:
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


class SegmentTokenDatabase:
    """Splits token ids at a separator and keys each segment on its own tokens.

    Same calling convention as `ChunkedTokenDatabase.process_tokens`: yields (start, end, key).
    """

    prefix_chain = False  # a segment is usable wherever it appears, whatever precedes it

    def __init__(self, metadata: LMCacheEngineMetadata, separator: Sequence[int] | torch.Tensor, *,
                 min_tokens: int = 256, fmt: MemoryFormat | str | None = None,
                 namespace_secret: str | None = None) -> None:
        self.namespace_secret = namespace_secret
        sep = _as_tensor(separator)
        if len(sep) == 0:
            raise ValueError("separator must have at least one token id")
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.metadata = metadata
        self.separator = sep
        self.min_tokens = min_tokens
        if fmt is None:  # blending is layerwise: one object per (segment, layer)
            fmt = MemoryFormat.KV_MLA if metadata.use_mla else MemoryFormat.KV_T2D
        self.fmt = MemoryFormat(fmt).value

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
                   namespace_secret=getattr(config, "namespace_secret", None))

    def make_key(self, seg_hash: bytes, namespace_hex: str = "", identity: str = "") -> CacheEngineKey:
        return make_key(self.metadata, self.fmt, seg_hash, namespace_hex, identity)

    def segment_bounds(self, tokens: torch.Tensor | Sequence[int]) -> list[tuple[int, int]]:
        """[start, end) of the segments that are cached (at least `min_tokens` long)."""
        return [(s, e) for s, e in split_segments(_as_tensor(tokens), self.separator)
                if e - s >= self.min_tokens]

    def process_tokens(self, tokens: torch.Tensor | Sequence[int], mask: torch.Tensor | None = None, *,
                       namespace: str = "", extra_hashes: Sequence[bytes] | None = None,
                       adapter: str = "", mm_spans: Sequence[MMSpan] | None = None,
                       ) -> Iterator[tuple[int, int, CacheEngineKey]]:
        """Yields (start, end, key) for each cached segment not skipped by the mask, in token order.

        `mm_spans` are folded into the segments they overlap; `extra_hashes[i]`, when given, into
        segment i's hash (i counts cached segments).
        """
        tokens = _as_tensor(tokens)
        skip = 0
        if mask is not None:
            if mask.dim() != 1 or mask.numel() != len(tokens):
                raise ValueError(f"mask must be 1-D with {len(tokens)} entries, got shape {tuple(mask.shape)}")
            mask = mask.to("cpu", torch.bool)
            skip = int((~mask).sum())
            if skip and mask[:skip].any():
                raise ValueError("mask must be a run of False (the skipped prefix) followed by True")
        ns_hex = namespace_digest(namespace, self.namespace_secret)
        identity = identity_digest(self.metadata.kv_identity, adapter)
        scope = chain_seed(ns_hex, identity)
        for i, (start, end) in enumerate(self.segment_bounds(tokens)):
            if end <= skip:
                continue
            h = segment_hash(tokens[start:end], scope)
            extra = (extra_hashes[i] if extra_hashes is not None and i < len(extra_hashes) else b"")
            extra += spans_hash(mm_spans, start, end)
            if extra:
                h = hashlib.blake2b(h + extra, digest_size=_HASH_BYTES).digest()
            yield start, end, self.make_key(h, ns_hex, identity)
