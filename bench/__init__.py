"""Benchmarks of lmcache_triton: `python -m bench.<name>`. Speed is measured here, never asserted in tests."""
