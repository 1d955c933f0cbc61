"""Which threads and ZMQ sockets the project's code opened and never closed (tests/conftest.py fails
the run on any).

A thread or socket is the project's when the code that started or opened it is: the innermost
frame outside the machinery that does it for the caller (threading, concurrent.futures for a pool's
lazily started workers, pyzmq) is in lmcache_triton/, tests/ or bench/. So vLLM's, torch's, tqdm's,
prometheus_client's and pytest's own threads never count, even when our code is further up the stack
(the metrics HTTP server is prometheus_client's, once per process by design), while a pool our code
submits to does. Names and thread lists alone cannot tell that apart: a pool's workers are started
lazily by the first submit, possibly long after the pool, and vLLM names its threads as it likes.
Each one is attributed to the test running when it was opened (setup and teardown included), so
the report names the test that leaked it; the verdict waits for the session's end, when every
fixture has closed what it holds, so a module- or session-scoped fixture's threads are not leaks.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parents[1]
_PROJECT_DIRS = tuple(str(REPO / d) + "/" for d in ("lmcache_triton", "tests", "bench"))
_THIS_FILE = str(Path(__file__).resolve())
_HELPERS = (str(Path(threading.__file__).resolve()), str(Path(threading.__file__).parent / "concurrent") + "/",
            str(Path(zmq.__file__).parent / "sugar") + "/", _THIS_FILE)


@dataclass(frozen=True)
class Opened:
    what: str   # "thread 'name'" or "zmq DEALER socket"
    where: str  # file:line in function, of the project code that opened it
    test: str   # the test running when it was opened


def _project_opener() -> str | None:
    """file:line of the innermost caller outside _HELPERS, when it is project code; else None."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_HELPERS):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(_PROJECT_DIRS):
        return None
    path = Path(frame.f_code.co_filename).relative_to(REPO)
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


class LeakTracker:
    """Records the project's threads and sockets from `install()` to `uninstall()`."""

    def __init__(self) -> None:
        self.current_test = "(no test: collection or session setup)"
        self._threads: list[tuple[weakref.ref, Opened]] = []
        self._sockets: list[tuple[weakref.ref, Opened]] = []
        self._lock = threading.Lock()
        self._thread_start = threading.Thread.start
        self._add_socket = zmq.Context._add_socket

    def install(self) -> None:
        tracker, thread_start, add_socket = self, self._thread_start, self._add_socket

        def start(thread: threading.Thread) -> None:
            where = _project_opener()
            if where is not None:
                tracker._record(tracker._threads, thread, Opened(f"thread {thread.name!r}", where,
                                                                 tracker.current_test))
            thread_start(thread)

        def _add(context: zmq.Context, socket: zmq.Socket) -> None:
            where = _project_opener()
            if where is not None:
                tracker._record(tracker._sockets, socket, Opened(f"zmq {socket.type.name} socket", where,
                                                                 tracker.current_test))
            add_socket(context, socket)

        threading.Thread.start = start
        zmq.Context._add_socket = _add

    def uninstall(self) -> None:
        threading.Thread.start = self._thread_start
        zmq.Context._add_socket = self._add_socket

    def _record(self, into: list, obj: object, opened: Opened) -> None:
        with self._lock:
            into.append((weakref.ref(obj), opened))

    def leaks(self, grace_s: float = 3.0) -> list[Opened]:
        """What is still open: sockets not closed, threads still alive after `grace_s` (a thread
        told to stop may take a poll interval to notice). Garbage is collected first: a socket
        nothing refers to is closed by its finalizer, and a thread that ends with its owner ends."""
        gc.collect()
        with self._lock:
            threads, sockets = list(self._threads), list(self._sockets)
        deadline = time.monotonic() + grace_s
        found = []
        for ref, opened in threads:
            thread = ref()
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    found.append(opened)
        found += [opened for ref, opened in sockets if (s := ref()) is not None and not s.closed]
        return found


def report(leaks: list[Opened]) -> str:
    """The leaks, grouped by the test that opened them."""
    by_test: dict[str, list[Opened]] = {}
    for opened in leaks:
        by_test.setdefault(opened.test, []).append(opened)
    lines = [f"{len(leaks)} thread(s)/ZMQ socket(s) opened by the project's code are still open at the end of "
             "the session: close what is opened (threads joined on close)"]
    for test, items in by_test.items():
        lines.append(f"  leaked by {test}:")
        lines += [f"    {o.what}, opened at {o.where}" for o in items]
    return "\n".join(lines)
