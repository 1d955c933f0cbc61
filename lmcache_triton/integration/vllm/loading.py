"""The worker side's loads: a request's stored chunks into vLLM's paged cache before (layerwise:
beside) the forward, and the blocks of whatever did not load reported for vLLM to recompute.

A load is all layers at once (`engine.retrieve`, before the forward), layer by layer
(`LayerwiseLoad`: layer j is loaded before layer j's attention), or CacheBlend's (the blender
reads the prompt's segments and writes the blended KV). Whichever it is, its outcome is one mask of
the tokens that loaded, and every expected token outside it lands in `LoadErrors` - a load that
fails midway included: vLLM must never take KV that is not there for computed. vLLM recomputes
those blocks (kv_load_failure_policy "recompute", the config's default) or fails the request
("fail"); either way the step's forward ran over them, so nothing that step computed for the
request is saved, checked or sent (`LoadErrors.requests`, worker.py).
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lmcache_triton.integration.vllm.paged import PagedKV, tokens_with_slots

if TYPE_CHECKING:
    from lmcache_triton.integration.vllm.specs import ReqMeta

logger = logging.getLogger("lmcache_triton")


@dataclass
class LoadErrors:
    """The paged-cache blocks of tokens that should have loaded and did not, until vLLM asks, and
    the requests they belong to, until the step's saves are decided."""

    block_size: int
    policy: str = "recompute"  # what vLLM does with them: the config's kv_load_failure_policy
    block_ids: set[int] = field(default_factory=set)
    requests: set[str] = field(default_factory=set)

    def record(self, req: ReqMeta, expected: torch.Tensor, loaded: torch.Tensor | None) -> None:
        """Reports the blocks of `expected` tokens (a mask over tokens 0..) that `loaded` (None:
        nothing) does not cover, so vLLM recomputes them. Never raises: it is the error path."""
        try:
            got = torch.zeros(len(expected), dtype=torch.bool)
            if loaded is not None:
                m = min(len(loaded), len(expected))
                got[:m] = loaded[:m].cpu()
            missing = expected.cpu() & ~got
            if not missing.any():
                return
            self.requests.add(req.req_id)
            pos = missing.nonzero().flatten() - req.token_offset  # the slot mapping starts there
            pos = pos[(pos >= 0) & (pos < len(req.slot_mapping))]
            slots = req.slot_mapping[pos]
            blocks = (slots[slots >= 0] // self.block_size).unique().tolist()
            then = (f"vLLM recomputes {len(blocks)} blocks" if self.policy == "recompute" else
                    f"vLLM fails the request (kv_load_failure_policy 'fail', {len(blocks)} blocks)")
            logger.warning("lmcache_triton: request %s failed to load %d tokens from token %d on; %s",
                           req.req_id, int(missing.sum()), int(missing.nonzero()[0]), then)
            self.block_ids.update(int(b) for b in blocks)
        except Exception:
            logger.exception("lmcache_triton: cannot report the failed load of request %s", req.req_id)

    def take(self) -> set[int]:
        out, self.block_ids = self.block_ids, set()
        return out

    def take_requests(self) -> set[str]:
        """The requests whose load failed since the last call (once a step, before its saves)."""
        out, self.requests = self.requests, set()
        return out


@dataclass
class LayerwiseLoad:
    """A request's layerwise load in flight: the engine's `retrieve_layer` generator, one step a
    layer, whose return value is the mask of loaded tokens. `first_waited` until the forward's
    first wait_for_layer_load, which `start` already answered."""

    req: ReqMeta
    steps: Generator[None, None, torch.Tensor]
    expected: torch.Tensor
    errors: LoadErrors
    first_waited: bool = False
    over: bool = False

    def advance(self) -> bool:
        """One more layer; False once the load is over and its outcome reported (once)."""
        if self.over:
            return False
        try:
            next(self.steps)
            return True
        except StopIteration as end:
            loaded = end.value
        except Exception:  # midway: the layers before may have landed, the request's tokens have not
            logger.exception("lmcache_triton: layerwise load of request %s failed", self.req.req_id)
            loaded = None
        self.over = True
        self.errors.record(self.req, self.expected, loaded)
        return False

    def before_layer(self) -> None:
        """vLLM waits for the next layer: load it (layer 0 was loaded at the start)."""
        if self.first_waited:
            self.advance()
        else:
            self.first_waited = True

    def finish(self) -> None:
        """After the forward: the last steps (the one wait for the copies, the holds released, the
        mask), and any layer vLLM did not wait for."""
        while self.advance():
            pass


@dataclass
class Loader:
    """Starts each request's load as the step's metadata says; `blender` set loads by CacheBlend."""

    paged: PagedKV
    chunk_size: int
    errors: LoadErrors
    blender: Any = None

    def start(self, req: ReqMeta) -> LayerwiseLoad | None:
        """Loads the request's stored tokens (all layers now, or layer 0 now and the rest as the
        forward asks: the LayerwiseLoad returned). Never raises: a failure is the request's miss."""
        spec = req.load_spec
        if spec is None or not spec.can_load:
            return None
        # No more than vLLM accepted and has slots for (the scheduler clamps; this guards).
        n = min(spec.lmcache_cached_tokens, tokens_with_slots(req))
        start = spec.vllm_cached_tokens // self.chunk_size * self.chunk_size
        if n <= 0 or start >= n:
            return None
        expected = torch.ones(n, dtype=torch.bool)
        expected[:start] = False
        engine = self.paged.engine
        try:
            if self.blender is not None:  # it reads the prompt from token 0 itself
                self._blend(req, n)
                return None
            tokens, kw = self.paged.move_args(req, start, n)
            if not engine.layerwise:
                self.errors.record(req, expected, engine.retrieve(tokens, expected, **kw))
                return None
            load = LayerwiseLoad(req, engine.retrieve_layer(tokens, expected, **kw), expected, self.errors)
        except Exception:
            logger.exception("lmcache_triton: load of request %s failed", req.req_id)
            self.errors.record(req, expected, None)
            return None
        # Layer 0 now (on a GPU, layer 1 queued behind it); each later wait_for_layer_load
        # takes one more step, so layer j's attention waits for layer j's load alone.
        load.advance()
        return load

    def _blend(self, req: ReqMeta, n: int) -> None:
        tokens = torch.tensor(req.token_ids[:n], dtype=torch.int64)  # CacheBlend's metadata has the ids from 0
        self.blender.blend_request(tokens, kvcaches=self.paged.kvcaches,
                                   slot_mapping=self.paged.device_slots(req.slots(0, n)), **req.key_args())
