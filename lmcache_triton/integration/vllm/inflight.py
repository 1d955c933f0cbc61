"""The worker side's requests in flight: one `InFlight` per request, from its first load or save to
the end of its last save, created in `InFlightRequests.get` and removed in `_forget` only.

A step's load and layerwise store live for the step (until wait_for_save); a request whose saves
were queued on the save thread lives on until vLLM finished it and the saves are done, because vLLM
holds its blocks until the worker reports it in finished_sending (saver.py has why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass

from lmcache_triton.integration.vllm.loading import LayerwiseLoad

logger = logging.getLogger("lmcache_triton")


@dataclass
class InFlight:
    req_id: str
    load: LayerwiseLoad | None = None                # a layerwise load, this step
    storer: Generator[None, None, int] | None = None  # a layerwise store, this step
    saving: bool = False    # saves were queued: vLLM holds its blocks once it finishes
    finished: bool = False  # vLLM finished it: reported once its saves are done

    @property
    def done(self) -> bool:
        """Nothing of the request is left to run or to report."""
        return self.load is None and self.storer is None and not self.saving


class InFlightRequests:
    def __init__(self) -> None:
        self._by_id: dict[str, InFlight] = {}

    def get(self, req_id: str) -> InFlight:
        entry = self._by_id.get(req_id)
        if entry is None:
            entry = self._by_id[req_id] = InFlight(req_id)
        return entry

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def loads(self) -> list[LayerwiseLoad]:
        return [e.load for e in self._by_id.values() if e.load is not None]

    def take_storer(self, req_id: str) -> Generator[None, None, int] | None:
        entry = self._by_id.get(req_id)
        if entry is None:
            return None
        storer, entry.storer = entry.storer, None
        return storer

    def saving(self, req_ids: Iterable[str]) -> list[str]:
        """Those of `req_ids` with saves queued (and not yet reported)."""
        return [r for r in req_ids if r in self._by_id and self._by_id[r].saving]

    def end_step(self) -> None:
        """The step is over: its loads are finished (the caller ran them out) and a layerwise store
        still open belongs to a request this step's metadata did not name: closed, nothing stored."""
        for entry in list(self._by_id.values()):
            entry.load = None
            if entry.storer is not None:
                close, entry.storer = entry.storer.close, None
                try:
                    close()
                except Exception:
                    logger.exception("lmcache_triton: closing the layerwise save of %s failed", entry.req_id)
            if entry.done:
                self._forget(entry)

    def finished(self, finished_req_ids: set[str], idle: Callable[[str], bool]) -> set[str]:
        """The finished requests whose saves are all done (vLLM then frees their blocks): exactly
        those the scheduler side held, every finished request that queued a save, and only once."""
        done = set()
        for entry in list(self._by_id.values()):
            entry.finished = entry.finished or (entry.saving and entry.req_id in finished_req_ids)
            if entry.finished and idle(entry.req_id):
                done.add(entry.req_id)
                self._forget(entry)
        return done

    def _forget(self, entry: InFlight) -> None:
        del self._by_id[entry.req_id]
