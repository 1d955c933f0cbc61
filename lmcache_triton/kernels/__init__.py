"""Triton kernels of lmcache_triton, each beside its pure-torch reference.

One file per kernel family (``paged_copy``, ``rope``, ``blend``), each with its launchers and its
torch reference (``reference`` for the paged copies); ``cpu_copy`` is the paged copies' CPU
serving path (numba, imported on the first CPU copy); ``naive`` is the slow, obvious oracle of the
paged copies that the tests and the benches check all of them against.

Imports nothing but torch and triton (and the standard library), and has no side effects.
"""

from .common import use_triton
from .layouts import LAYOUTS, KVGeometry, kv_geometry, kv_views
from .paged_copy import PagedTarget, paged_gather, paged_gather_layer, paged_scatter, paged_scatter_layer
from .reference import (paged_gather_layer_ref, paged_gather_ref, paged_scatter_layer_ref,
                        paged_scatter_ref)

__all__ = [
    "LAYOUTS", "KVGeometry", "kv_geometry", "kv_views", "use_triton",
    "paged_gather", "paged_scatter", "paged_gather_layer", "paged_scatter_layer", "PagedTarget",
    "paged_gather_ref", "paged_scatter_ref", "paged_gather_layer_ref", "paged_scatter_layer_ref",
]

# CacheBlend: RoPE re-rotation of reused K, K deviation, recompute selection, selective row writes.
from .blend import (kv_deviation, kv_deviation_ref, num_recompute_tokens, select_recompute_tokens,
                    select_recompute_tokens_ref, selective_write, selective_write_ref, top_deviation_rows,
                    top_deviation_rows_ref)
from .rope import rope_rerotate, rope_rerotate_ref

__all__ += [
    "rope_rerotate", "rope_rerotate_ref",
    "kv_deviation", "kv_deviation_ref", "num_recompute_tokens",
    "select_recompute_tokens", "select_recompute_tokens_ref", "top_deviation_rows", "top_deviation_rows_ref",
    "selective_write", "selective_write_ref",
]
