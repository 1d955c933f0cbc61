"""The worker's answer to the offload server (offload_server.py has the contract): store the slots
a request names under its chunk hashes, in turn with the worker's saves, so the engine still sees
one store at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcache_triton.integration.vllm.offload_server import OffloadMsg, new_job_id
from lmcache_triton.integration.vllm.paged import PagedKV
from lmcache_triton.integration.vllm.saving import Saving


@dataclass
class OffloadStore:
    paged: PagedKV
    saving: Saving
    chunk_size: int
    timeout_s: float

    def __call__(self, msg: OffloadMsg) -> int:
        """The tokens stored now; raises (the server replies with why) when the store cannot run."""
        engine = self.paged.engine
        if engine is None:
            raise RuntimeError("the worker has not registered its KV caches yet")
        n = sum(msg.offsets)
        kw = dict(kvcaches=self.paged.kvcaches, chunk_hashes=msg.chunk_hashes(self.chunk_size),
                  slot_mapping=torch.tensor(msg.slot_mapping, dtype=torch.long, device=self.paged.kvcaches[0].device),
                  namespace=msg.namespace, adapter=msg.adapter)
        return self.saving.in_turn(new_job_id(), lambda: engine.store(n, **kw), timeout=self.timeout_s + 30,
                                   what="the store")
