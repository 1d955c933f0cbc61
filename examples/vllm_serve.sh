#!/usr/bin/env bash
# vLLM's OpenAI server with lmcache_triton. The connector is registered through the package's
# vllm.general_plugins entry point, so the module path may be left out.
set -euo pipefail
MODEL=${MODEL:-/path/to/model}

# 1. CPU offload with the defaults (or LMCACHE_CONFIG_FILE=examples/cpu_offload.yaml)
vllm serve "$MODEL" --no-enable-prefix-caching \
  --kv-transfer-config '{"kv_connector": "LMCacheTritonConnectorV1", "kv_role": "kv_both",
                         "kv_connector_extra_config": {"lmcache.max_local_cpu_size": 20}}'

# 2. With a config file (disk tier, cache server or Redis)
# LMCACHE_CONFIG_FILE=examples/disk.yaml vllm serve "$MODEL" \
#   --kv-transfer-config '{"kv_connector": "LMCacheTritonConnectorV1",
#                          "kv_connector_module_path": "lmcache_triton.integration.vllm", "kv_role": "kv_both"}'

# 3. Layerwise loading (layer i+1 loads while layer i computes)
# LMCACHE_USE_LAYERWISE=true vllm serve "$MODEL" --kv-transfer-config '{"kv_connector": "LMCacheTritonConnectorV1", "kv_role": "kv_both"}'
