"""lmcache_triton behind vLLM's `--kv-transfer-config`.

    {"kv_connector": "LMCacheTritonConnectorV1",
     "kv_connector_module_path": "lmcache_triton.integration.vllm", "kv_role": "kv_both"}

vLLM imports this module (by module path, or through the `vllm.general_plugins` entry point that
registers the name) only when the connector is configured; it imports vLLM.
"""

from lmcache_triton.integration.vllm.connector import LMCacheTritonConnectorV1
from lmcache_triton.integration.vllm.specs import (
    DisaggSpec,
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    RequestTracker,
    SaveSpec,
)

__all__ = ["LMCacheTritonConnectorV1", "LMCacheConnectorMetadata", "RequestTracker", "ReqMeta", "LoadSpec",
           "SaveSpec", "DisaggSpec"]
