"""The engine floor: keys and token databases, the GPU connectors, LMCacheEngine and its builder."""
