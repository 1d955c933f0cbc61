"""Functions other threads hand to the cache server's one loop thread, which runs them between messages.

The server's store, counters and reply budget belong to its loop thread and are touched by no
other: the admin API's threads (admin_http.py) ask the loop instead of taking a lock the loop would
have to take around every message. `submit` queues a function and writes a byte to a socket pair
the loop polls beside its ZMQ socket, so an idle loop wakes at once; `run_pending` runs what is
queued. A caller waits on the returned Future with its own timeout and never holds up the loop; a
call it cancels before the loop took it is never run.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class LoopStopped(RuntimeError):
    """The serve loop has ended: nothing more will run."""


class LoopCalls:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()  # orders submit against close: nothing is queued after close
        self._closed = False

    def fileno(self) -> int:
        """What the loop polls (readable: something was submitted)."""
        return self._wake_r.fileno()

    def submit(self, fn: Callable[[], Any]) -> Future:
        """Queues `fn` for the loop thread; its result (or exception) arrives in the Future."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise LoopStopped("the cache server's serve loop has stopped")
            self._queue.put((fn, future))
            try:
                self._wake_w.send(b"\0")
            except BlockingIOError:
                pass  # the pair's buffer is full of wake-ups: the loop will look anyway
        return future

    def run_pending(self) -> None:
        """The loop thread's side: takes the wake-ups, then runs every queued call (wake-ups first,
        so a call queued meanwhile either runs now or leaves a wake-up for the next poll)."""
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                fn, future = self._queue.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up waiting before the loop took it
            try:
                future.set_result(fn())
            except Exception as e:  # the caller reports it; the loop goes on
                future.set_exception(e)

    def close(self) -> None:
        """The loop is ending: what is still queued fails at once instead of timing out."""
        with self._lock:
            self._closed = True
        while True:
            try:
                _, future = self._queue.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(LoopStopped("the cache server stopped before it ran this"))
        self._wake_r.close()
        self._wake_w.close()
