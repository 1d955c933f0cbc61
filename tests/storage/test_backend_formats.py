"""Every chunk format and dtype, through every backend (disk, cache server, Redis), exact bytes."""

import pytest
import torch

from lmcache_triton.storage.memory import MemoryFormat, TensorMemoryPool
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage.local_disk import LocalDiskBackend
from lmcache_triton.storage.remote import create_remote_backend
from lmcache_triton.tools.testing import fill_random_
from lmcache_triton.keys import CacheEngineKey

LAYERS, TOKENS, HEADS, HEAD, C = 3, 13, 2, 16, 40
FORMATS = {  # name -> (format, shape, use_mla)
    "KV_2LTD": (MemoryFormat.KV_2LTD, (2, LAYERS, TOKENS, HEADS * HEAD), False),
    "KV_T2D": (MemoryFormat.KV_T2D, (TOKENS, 2, HEADS * HEAD), False),
    "KV_MLA": (MemoryFormat.KV_MLA, (1, LAYERS, TOKENS, C), True),
    "KV_MLA-layer": (MemoryFormat.KV_MLA, (TOKENS, C), True),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "u8": torch.uint8,
          "fp8": torch.float8_e4m3fn}


@pytest.fixture(params=["disk", "lm", "redis"])
def make_backend(request, tmp_path):
    def make(metadata):
        if request.param == "disk":
            return LocalDiskBackend(tmp_path / "kv", 1 << 24, metadata)
        server = request.getfixturevalue("cache_server" if request.param == "lm" else "redis_server")
        return create_remote_backend(server.url, metadata, compression="lz4", timeout_s=5)
    return make


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("fmt_name", FORMATS.keys())
def test_round_trip(make_backend, fmt_name, dtype):
    fmt, shape, mla = FORMATS[fmt_name]
    metadata = LMCacheEngineMetadata(model_name="fmt/model", world_size=1, worker_id=0, kv_dtype=dtype,
                                     kv_shape=(LAYERS, 1, 16, 1, C) if mla else (LAYERS, 2, 16, HEADS, HEAD),
                                     use_mla=mla)
    pool = TensorMemoryPool(1 << 20, pin_memory=False)
    obj = pool.allocate(shape, dtype, fmt)
    fill_random_(obj.tensor, torch.Generator().manual_seed(7))
    key = CacheEngineKey("fmt/model", 1, 0, str(dtype).removeprefix("torch."), fmt.value, f"{list(FORMATS).index(fmt_name):032x}",
                         layer_id=0 if shape[0] == TOKENS else None)
    backend = make_backend(metadata)
    try:
        assert backend.put(key, obj)
        got = backend.get(key, pool.allocate)
        assert got is not None and got.shape == obj.shape and got.dtype == dtype and got.fmt == fmt
        assert torch.equal(got.tensor.view(torch.uint8), obj.tensor.view(torch.uint8))
    finally:
        backend.close()
