"""The `vllm.general_plugins` entry point: registers the connector's name with vLLM's factory, so
`{"kv_connector": "LMCacheTritonConnectorV1", "kv_role": "kv_both"}` works without a module path.

vLLM loads general plugins in every process (main, engine core, workers) before it creates a
connector; this function imports only vLLM's factory, never lmcache_triton's engine.
"""


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name = "LMCacheTritonConnectorV1"
    if name not in KVConnectorFactory._registry:  # register_connector raises on a second call
        KVConnectorFactory.register_connector(name, "lmcache_triton.integration.vllm.connector", name)
