"""Lookup across processes: vLLM's scheduler asks the workers' engines how much of a prompt is cached."""
