"""Integrations of lmcache_triton with serving engines."""
