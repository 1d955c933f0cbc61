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

from lmcache_triton.memory import MemoryFormat
from lmcache_triton.metadata import LMCacheEngineMetadata

_HASH_BYTES = 16
_SEP = "@"
_KEY_PREFIX = "lmct1"  # bump when the hashing scheme changes, so old entries can never match


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
    """Names one stored chunk: model, ranks, dtype, chunk format, namespace and chunk hash.

    `layer_id` is set for the per-layer keys of the layerwise mode (one object per layer).
    """

    model_name: str
    world_size: int
    worker_id: int
    dtype: str
    fmt: str
    chunk_hash: str
    namespace: str = ""
    layer_id: int | None = None

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
            quote(self.namespace, safe=""),
            self.chunk_hash,
        ]
        if self.layer_id is not None:
            parts.append(f"L{self.layer_id}")
        return _SEP.join(parts)

    @classmethod
    def from_string(cls, s: str) -> CacheEngineKey:
        parts = s.split(_SEP)
        if len(parts) not in (8, 9) or parts[0] != _KEY_PREFIX:
            raise ValueError(f"not a lmcache_triton key: {s!r}")
        layer_id = None
        if len(parts) == 9:
            if not parts[8].startswith("L"):
                raise ValueError(f"bad layer suffix in key: {s!r}")
            layer_id = int(parts[8][1:])
        return cls(
            model_name=unquote(parts[1]),
            world_size=int(parts[2]),
            worker_id=int(parts[3]),
            dtype=parts[4],
            fmt=parts[5],
            namespace=unquote(parts[6]),
            chunk_hash=parts[7],
            layer_id=layer_id,
        )

    def __str__(self) -> str:
        return self.to_string()


class ChunkedTokenDatabase:
    """Splits token ids into `chunk_size` chunks and keys each with the prefix hash chain."""

    prefix_chain = True  # chunk i is only usable behind chunks 0..i-1: a miss ends every load

    def __init__(self, chunk_size: int, metadata: LMCacheEngineMetadata, *, save_unfull_chunk: bool = True,
                 fmt: MemoryFormat | str | None = None) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self.metadata = metadata
        self.save_unfull_chunk = save_unfull_chunk
        if fmt is None:
            fmt = MemoryFormat.KV_MLA if metadata.use_mla else MemoryFormat.KV_2LTD
        self.fmt = MemoryFormat(fmt).value

    def make_key(self, chunk_hash: bytes, namespace: str = "") -> CacheEngineKey:
        m = self.metadata
        return CacheEngineKey(
            model_name=m.model_name,
            world_size=m.world_size,
            worker_id=m.worker_id,
            dtype=m.dtype_name,
            fmt=self.fmt,
            chunk_hash=chunk_hash.hex(),
            namespace=namespace,
        )

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
    ) -> Iterator[tuple[int, int, CacheEngineKey]]:
        """Yields (start, end, key) for each chunk not skipped by the mask, in token order.

        `extra_hashes[i]`, when given, is folded into chunk i's hash (multimodal inputs: the same
        placeholder token ids with different images must not share KV).
        """
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1:
                raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
            tokens = tokens.detach().to("cpu", torch.int64)
        num_tokens = len(tokens)
        skip = self.num_skipped(num_tokens, mask)
        prefix = hashlib.blake2b(namespace.encode(), digest_size=_HASH_BYTES).digest()
        for i, (start, end) in enumerate(self.chunk_bounds(num_tokens)):
            extra = extra_hashes[i] if extra_hashes is not None and i < len(extra_hashes) else b""
            prefix = chain_hash(prefix, tokens[start:end], extra)
            if end <= skip:
                continue
            yield start, end, self.make_key(prefix, namespace)
