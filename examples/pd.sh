#!/usr/bin/env bash
# Prefill/decode disaggregation on one host: a prefiller, a decoder and the proxy in front.
# Clients talk to the proxy (:9000) as to any OpenAI server. For each request the proxy asks the
# prefiller for one token, with kv_transfer_params.disagg_spec naming the decoder's PD listener
# (127.0.0.1:7300); the prefiller sends the prompt's chunks there before it answers; then the proxy
# sends the request unchanged to the decoder, which loads all but the last prompt token and
# generates. On separate hosts, use their addresses (and set remote_auth_token on both sides).
# On a GPU host give each instance its own GPU (CUDA_VISIBLE_DEVICES) and use `vllm serve`.
set -euo pipefail
MODEL=${MODEL:-/path/to/model}
cd "$(dirname "$0")"

LMCACHE_CONFIG_FILE=pd_prefiller.yaml lmcache-triton serve "$MODEL" --port 8100 \
  --kv-transfer-config '{"kv_connector": "LMCacheTritonConnectorV1", "kv_role": "kv_producer"}' &
LMCACHE_CONFIG_FILE=pd_decoder.yaml lmcache-triton serve "$MODEL" --port 8200 \
  --enable-prompt-tokens-details \
  --kv-transfer-config '{"kv_connector": "LMCacheTritonConnectorV1", "kv_role": "kv_consumer"}' &
lmcache-triton proxy --port 9000 --prefiller http://127.0.0.1:8100 \
  --decoder http://127.0.0.1:8200 --decoder-pd 127.0.0.1:7300 &

# Once all three answer /health:
#   curl -s localhost:9000/v1/completions -H 'content-type: application/json' \
#     -d '{"model": "'"$MODEL"'", "prompt": "...", "max_tokens": 64}'
# The decoder's usage.prompt_tokens_details.cached_tokens is the prompt length minus one.
wait
