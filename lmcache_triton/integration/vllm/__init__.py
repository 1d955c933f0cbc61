"""lmcache_triton behind vLLM's `--kv-transfer-config`.

    {"kv_connector": "LMCacheTritonConnectorV1",
     "kv_connector_module_path": "lmcache_triton.integration.vllm", "kv_role": "kv_both"}

Names resolve lazily: vLLM's plugin loader imports `plugin` (and `model_hook`) from this package in
every process, and that must not pull in the engine or vLLM's connector base class.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LMCacheTritonConnectorV1": "connector",
    "LMCacheConnectorMetadata": "specs",
    "RequestTracker": "specs",
    "ReqMeta": "specs",
    "LoadSpec": "specs",
    "SaveSpec": "specs",
    "DisaggSpec": "specs",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
