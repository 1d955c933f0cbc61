"""The disk tier: one chunk file per chunk (chunk_files.py: layout, atomic writes, the index rebuilt
at start, LRU eviction by bytes), read straight into the CPU tier's memory.

Engines of different models may share a folder: a file this engine's metadata does not fit
(another model, rank, dtype or shape) is foreign, never served nor deleted, and not counted
against this engine's max_bytes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import BinaryIO

import torch

from lmcache_triton.keys import CacheEngineKey
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage.base import AllocateFn, StorageBackend
from lmcache_triton.storage.chunk_files import ChunkFiles
from lmcache_triton.storage.chunk_header import RawHeader
from lmcache_triton.storage.memory import MemoryObj
from lmcache_triton.storage.serde import (
    COMPRESSIONS,
    check_fits,
    decode_payload,
    parse_header,
    serialize_parts,
    verify_checksum,
)


class LocalDiskBackend(ChunkFiles[CacheEngineKey], StorageBackend):
    name = "LocalDiskBackend"
    indexed_in_memory = True  # contains() reads the in-memory index, never the disk

    def __init__(self, path: str | Path, max_bytes: int, metadata: LMCacheEngineMetadata, *,
                 compression: str = "naive", fsync: bool = False) -> None:
        if compression not in COMPRESSIONS:
            raise ValueError(f"LocalDiskBackend compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.metadata = metadata
        self.compression = compression
        super().__init__(path, max_bytes, key_name=CacheEngineKey.to_string, claim=self._claim, fsync=fsync,
                         name=self.name)

    def _claim(self, raw: RawHeader) -> CacheEngineKey:
        check_fits(parse_header(raw), self.metadata)  # raises SerdeError: foreign
        return CacheEngineKey.from_string(raw.key)  # check_fits parsed it already

    def put(self, key: CacheEngineKey, obj: MemoryObj) -> bool:
        # The naive payload is a view of obj.tensor, written straight to the file (no copy).
        return self.store(key, lambda: serialize_parts(key, obj.tensor, obj.fmt, self.compression))

    def get(self, key: CacheEngineKey, allocate: AllocateFn) -> MemoryObj | None:
        started = time.perf_counter()
        obj = self.read(key, lambda f, raw: self._read_into(f, raw, allocate))
        if obj is not None:  # a read, checks included, is what a load from the disk costs
            self.cost.observe_transfer(obj.nbytes, time.perf_counter() - started)
        return obj

    def _read_into(self, f: BinaryIO, raw: RawHeader, allocate: AllocateFn) -> MemoryObj | None:
        header = parse_header(raw)
        check_fits(header, self.metadata)  # before allocating: the shape comes from the file
        obj = allocate(header.shape, header.dtype, header.fmt)
        if obj is None:  # no room in the CPU tier: a miss, nothing wrong with the file
            return None
        try:
            if header.compression == "naive" and obj.tensor.is_contiguous():
                # Straight into the caller's buffer, then verified there: one copy instead of
                # two. Bad bytes never escape: on a mismatch the object is freed below.
                dst = obj.tensor.reshape(-1).view(torch.uint8).numpy()
                got = f.readinto(memoryview(dst))
                verify_checksum(header, dst if got == len(dst) else dst[:got])
            else:
                decode_payload(header, f.read(header.payload_nbytes), out=obj.tensor)
        except BaseException:
            obj.free()
            raise
        return obj
