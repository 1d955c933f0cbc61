"""The worker side's saves: which of a request's tokens this step stores, and where the store runs.

Saves are asynchronous (saver.py's one thread) unless the connector is layerwise, whose per-layer
stores run inside the forward (`start_layerwise`, one `next()` per save_kv_layer). Whatever must
see the engine one store at a time (a PD send, an offload request) runs `in_turn`, behind the
stores queued before it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, TypeVar

import torch

from lmcache_triton.config import LMCacheEngineConfig
from lmcache_triton.integration.vllm.paged import PagedKV, tokens_with_slots
from lmcache_triton.integration.vllm.saver import AsyncSaver

if TYPE_CHECKING:
    from lmcache_triton.integration.vllm.specs import ReqMeta

logger = logging.getLogger("lmcache_triton")

T = TypeVar("T")


def nothing_to_store() -> Generator[None, None, int]:
    """A layerwise store with nothing to do (no new chunk, or one that failed): every step a no-op."""
    return 0
    yield  # noqa: unreachable - makes this a generator


class Saving:
    def __init__(self, paged: PagedKV, config: LMCacheEngineConfig, kv_role: str) -> None:
        self.paged = paged
        self.config = config
        self.kv_role = kv_role
        self.blending = False  # segments, not a prefix: set once the engine is built for CacheBlend
        # Async saving, decided from the config alone, as the scheduler side decides which
        # finished requests vLLM must hold for us (the two must agree: see `InFlightRequests.finished`).
        self.saver: AsyncSaver | None = None if config.use_layerwise else AsyncSaver(torch.device("cpu"))

    @property
    def is_async(self) -> bool:
        return self.saver is not None

    def on_device(self, device: torch.device) -> None:
        """The cache lives on `device`: a CUDA cache's stores copy on a side stream of their own."""
        if self.saver is not None and device.type == "cuda":
            self.saver.close(timeout=0)
            self.saver = AsyncSaver(device)

    def store_args(self, req: ReqMeta) -> tuple[list[int] | int, torch.Tensor | None, dict] | None:
        """(tokens, mask, keyword arguments) of the engine's store of this step's new chunks, or None."""
        spec = req.save_spec
        if self.kv_role == "kv_consumer" or spec is None or not spec.can_save:
            return None
        chunk = self.config.chunk_size
        skip = spec.skip_leading_tokens // chunk * chunk
        # Tokens without a slot (-1) have no KV to save; nor does anything behind them.
        num_tokens = tokens_with_slots(req)
        if num_tokens < req.num_tokens:
            num_tokens = num_tokens // chunk * chunk
        if skip >= num_tokens:
            return None
        if self.blending:
            skip = 0  # segments, not a prefix: each is stored once, whatever was loaded
        tokens, kw = self.paged.move_args(req, skip, num_tokens)
        mask = None
        if skip and not isinstance(tokens, int):  # with chunk hashes from `skip` on, the engine skips the rest
            mask = torch.ones(num_tokens, dtype=torch.bool)
            mask[:skip] = False
        return tokens, mask, kw

    def start_layerwise(self, req: ReqMeta) -> Generator[None, None, int]:
        """The request's layerwise store (one layer a `next()`; returns the tokens stored)."""
        args = self.store_args(req)
        if args is None:
            return nothing_to_store()
        tokens, mask, kw = args
        return self.paged.engine.store_layer(tokens, mask, **kw)

    def queue(self, req: ReqMeta) -> None:
        """Stores this step's new chunks of the request: on the save thread, or here without one."""
        args = self.store_args(req)
        if args is None:
            return
        tokens, mask, kw = args
        store = functools.partial(self.paged.engine.store, tokens, mask, **kw)
        if self.saver is None:
            store()
        else:
            self.saver.submit(req.req_id, store)

    def in_turn(self, job_id: str, job: Callable[[], T], *, timeout: float, what: str) -> T:
        """Runs `job` behind the stores queued so far (on the save thread where there is one: the
        engine sees one store at a time) and returns its result. TimeoutError when it did not end
        in `timeout` seconds, RuntimeError when it failed (the log has why)."""
        if self.saver is None:
            return job()
        done: dict[str, T] = {}
        self.saver.submit(job_id, lambda: done.setdefault("result", job()))
        if not self.saver.wait([job_id], timeout=timeout):
            raise TimeoutError(f"{what} did not finish in time (the save thread is busy)")
        if "result" not in done:
            raise RuntimeError(f"{what} failed (the worker's log has why)")
        return done["result"]

    def wait(self, req_ids: list[str]) -> bool:
        """Waits until no store of these requests is queued or running."""
        return self.saver is None or self.saver.wait(req_ids)

    def idle(self, req_id: str) -> bool:
        return self.saver is None or self.saver.idle(req_id)

    def flush(self, timeout: float) -> bool:
        return self.saver is None or self.saver.flush(timeout)

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close(timeout=self.config.blocking_timeout_secs)
