"""lmcache_triton: a KV-cache layer for vLLM in the architecture of LMCache, moving KV with Triton.

Importing the package is free of side effects and cheap: vLLM imports plugins in every process,
so the public names below are resolved lazily on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LMCacheEngineConfig": "lmcache_triton.config",
    "ConfigError": "lmcache_triton.config",
    "LMCacheEngineMetadata": "lmcache_triton.metadata",
    "LMCacheEngine": "lmcache_triton.engine.engine",
    "LMCacheEngineBuilder": "lmcache_triton.engine.engine",
    "create_gpu_connector": "lmcache_triton.engine.gpu_connector",
    "ChunkedTokenDatabase": "lmcache_triton.engine.token_database",
    "CacheEngineKey": "lmcache_triton.keys",
    "MemoryFormat": "lmcache_triton.storage.memory",
    "MemoryObj": "lmcache_triton.storage.memory",
    "LMCStatsMonitor": "lmcache_triton.observability.stats",
}

__all__ = sorted(_LAZY) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from lmcache_triton.config import ConfigError, LMCacheEngineConfig
    from lmcache_triton.engine.engine import LMCacheEngine, LMCacheEngineBuilder
    from lmcache_triton.engine.gpu_connector import create_gpu_connector
    from lmcache_triton.storage.memory import MemoryFormat, MemoryObj
    from lmcache_triton.metadata import LMCacheEngineMetadata
    from lmcache_triton.observability.stats import LMCStatsMonitor
    from lmcache_triton.engine.token_database import ChunkedTokenDatabase
    from lmcache_triton.keys import CacheEngineKey


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lmcache_triton' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
