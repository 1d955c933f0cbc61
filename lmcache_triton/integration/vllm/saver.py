"""Saves off vLLM's forward path: each step's stores run in one background thread.

`wait_for_save` hands a step's stores to this thread and returns, so the copy out of the paged
cache overlaps vLLM's next steps instead of delaying them (and the first token). That is only
correct while the blocks being read keep their bytes, which vLLM's protocol for asynchronous
saving gives: a running request's computed blocks are never rewritten; a finished request's blocks
are held (`request_finished` returns True) until every worker reports it in `finished_sending`,
which happens once its stores are done (`idle`); a preempted request's blocks are freed at once,
so the worker waits for its stores before the next step's loads and forward (`wait`).

One thread, first in first out: a request's stores run in step order, and the engine sees one
store at a time (beside the main thread's loads and the lookup server's lookups, as before). On
CUDA each job waits for an event recorded on the forward's stream, and copies on a side stream.

The stores themselves wait on no disk or network (lower tiers write in their own threads), so a
job cannot hang; `close` still bounds its wait.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger("lmcache_triton")


class AsyncSaver:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        # On a CPU host the copies run on one torch thread: the forward's OpenMP team already
        # holds every core the worker owns, and a second team beside it made both wait on
        # descheduled threads (copies fell from 3.7-4.1 GB/s on one thread to 0.07-0.2 GB/s on two,
        # 2-core VM with both cores busy). torch's thread count is per thread: the forward keeps its.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-triton-save",
                                        initializer=torch.set_num_threads,
                                        initargs=(1 if device.type == "cpu" else torch.get_num_threads(),))
        self._in_flight: Counter[str] = Counter()   # jobs submitted and not done, per request
        self._submitted = 0                          # jobs ever submitted / done (done in order: one thread)
        self._done = 0
        self._cond = threading.Condition()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def submit(self, req_id: str, job: Callable[[], object]) -> None:
        """Runs `job` (a store that reads this step's KV) in the background. Never raises."""
        ready = None
        if self._stream is not None:  # the job reads what this step's forward wrote
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        with self._cond:
            self._in_flight[req_id] += 1
            self._submitted += 1
        try:
            self._pool.submit(self._run, req_id, job, ready)
        except RuntimeError:  # closed: run it here rather than lose the request's hold accounting
            self._run(req_id, job, ready)

    def _run(self, req_id: str, job: Callable[[], object], ready: torch.cuda.Event | None) -> None:
        try:
            if self._stream is None:
                job()
            else:
                self._stream.wait_event(ready)
                with torch.cuda.stream(self._stream):
                    job()
        except Exception:
            logger.exception("lmcache_triton: save of request %s failed; its chunks stay uncached", req_id)
        finally:
            with self._cond:
                self._done += 1
                self._in_flight[req_id] -= 1
                if self._in_flight[req_id] <= 0:
                    del self._in_flight[req_id]
                self._cond.notify_all()

    def idle(self, req_id: str) -> bool:
        """No store of this request is queued or running."""
        with self._cond:
            return req_id not in self._in_flight

    def wait(self, req_ids: Iterable[str] | None = None, timeout: float | None = None) -> bool:
        """Waits until no store of these requests (None: of any) is queued or running; False on timeout."""
        wanted = None if req_ids is None else set(req_ids)

        def done() -> bool:
            return not self._in_flight if wanted is None else wanted.isdisjoint(self._in_flight)

        with self._cond:
            return self._cond.wait_for(done, timeout)

    def flush(self, timeout: float) -> bool:
        """Waits for the jobs submitted so far (not for later ones: under load the queue is never
        empty); False on timeout. A lookup calls it so a prompt whose saves are queued is found."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    def close(self, timeout: float) -> None:
        if not self.wait(timeout=timeout):
            logger.warning("lmcache_triton: saves still running after %.0f s at shutdown", timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
