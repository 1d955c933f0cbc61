"""Where chunks live once they leave the GPU: the tiers and the StorageManager over them.

Each of these words means one thing across the package (storage, engine, integration, metrics):

- keep: a tier keeps a chunk while the chunk is in it and a reader can find it there
  (`LocalCPUBackend.keeps(key, obj)`: is this the object the tier keeps under `key`?).
  `StorageManager.contains` asks which keys the tiers keep.
- hold: a count of uses on one MemoryObj (`hold()`, `unhold()`, `is_held`). While an object is
  held, the CPU tier never evicts it and nobody frees it. Reads (`get`), write-throughs and
  reservations hold an object; `StorageManager.release(key, obj)` ends one hold, and the last
  release of an object that no tier keeps frees it. `put(key, obj, holds=n)` inserts an object
  with n holds already on it. A `Hold` is the (key, object) pair one hold is released by.
- reservation: the holds a lookup takes on the chunks it reports
  (`contains(..., hold_into=...)`, `LMCacheEngine.lookup(reserve=True)`), so that the load which
  follows finds them; they end at `LMCacheEngine.release_reservation(lookup_id)` or when their
  lease (`reservation_lease_secs`) expires.
- stage: with `local_cpu: false`, a chunk read from a lower tier for a reservation waits in the
  CPU pool, kept by no tier, for the load that follows; its last release frees it.
- pin: pinned host memory, page-locked (`pin_memory`, cudaHostRegister) so the GPU moves it by
  DMA. Nothing else: a chunk that must not be evicted is held, not pinned. (LMCache calls a
  reservation a pin: its `pin_timeout_sec` is `reservation_lease_secs` here; and the miss reason
  `pinned_tier_refusal`, a store refused because every chunk of the CPU tier was held, keeps the
  label dashboards and alerts already select on.)
- io / in memory: `io=False` (and `get_in_memory`) asks only what answers without I/O, the CPU
  tier and the tiers that index their chunks in memory (the disk): vLLM's step may ask that.
  `io=True` asks every tier, a remote included.
"""
