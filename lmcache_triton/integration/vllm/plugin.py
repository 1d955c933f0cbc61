"""The `vllm.general_plugins` entry point: registers the connector's name with vLLM's factory, so
`{"kv_connector": "LMCacheTritonConnectorV1", "kv_role": "kv_both"}` works without a module path.

vLLM loads general plugins in every process (main, engine core, workers) before it creates a
connector; this function imports only vLLM's factory and the small model hook, never
lmcache_triton's engine.
"""


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from lmcache_triton.integration.vllm import model_hook

    model_hook.install()  # CacheBlend runs the loaded model; this wrap only records a reference
    name = "LMCacheTritonConnectorV1"
    if name not in KVConnectorFactory._registry:  # register_connector raises on a second call
        KVConnectorFactory.register_connector(name, "lmcache_triton.integration.vllm.connector", name)
