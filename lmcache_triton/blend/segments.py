"""Segment keys for CacheBlend: a prompt is split at a separator and each segment is keyed on its
own tokens, so a document is a hit wherever it appears in a prompt.

Rules (what a user caching documents relies on):

- The separator is a token sequence: `blend_special_str` (" # # ") tokenized *without* special
  tokens (LMCache drops the first id, assuming a BOS; that breaks for tokenizers that add none),
  or the ids given directly.
- Separator tokens belong to no segment: they are never cached, so the blender recomputes them.
- A segment's key is blake2b over b"segment" + its token ids as int64 bytes + the namespace; no
  prefix chain. Model, ranks, dtype and format are in the `CacheEngineKey` as for chunk keys, and
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

from lmcache_triton.memory import MemoryFormat
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.token_database import CacheEngineKey

_HASH_BYTES = 16
_DOMAIN = b"segment"


def _as_tensor(tokens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        return tokens.detach().to("cpu", torch.int64)
    return torch.tensor(list(tokens), dtype=torch.int64)


def segment_hash(tokens: torch.Tensor, namespace: str = "") -> bytes:
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(_DOMAIN)
    h.update(namespace.encode())
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
                 min_tokens: int = 256, fmt: MemoryFormat | str | None = None) -> None:
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
        return cls(metadata, separator, min_tokens=config.blend_min_tokens, fmt=fmt)

    def make_key(self, seg_hash: bytes, namespace: str = "") -> CacheEngineKey:
        m = self.metadata
        return CacheEngineKey(model_name=m.model_name, world_size=m.world_size, worker_id=m.worker_id,
                              dtype=m.dtype_name, fmt=self.fmt, chunk_hash=seg_hash.hex(), namespace=namespace)

    def segment_bounds(self, tokens: torch.Tensor | Sequence[int]) -> list[tuple[int, int]]:
        """[start, end) of the segments that are cached (at least `min_tokens` long)."""
        return [(s, e) for s, e in split_segments(_as_tensor(tokens), self.separator)
                if e - s >= self.min_tokens]

    def process_tokens(self, tokens: torch.Tensor | Sequence[int], mask: torch.Tensor | None = None, *,
                       namespace: str = "", extra_hashes: Sequence[bytes] | None = None,
                       ) -> Iterator[tuple[int, int, CacheEngineKey]]:
        """Yields (start, end, key) for each cached segment not skipped by the mask, in token order.

        `extra_hashes[i]`, when given, is folded into segment i's hash (i counts cached segments).
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
        for i, (start, end) in enumerate(self.segment_bounds(tokens)):
            if end <= skip:
                continue
            h = segment_hash(tokens[start:end], namespace)
            if extra_hashes is not None and i < len(extra_hashes) and extra_hashes[i]:
                h = hashlib.blake2b(h + extra_hashes[i], digest_size=_HASH_BYTES).digest()
            yield start, end, self.make_key(h, namespace)
