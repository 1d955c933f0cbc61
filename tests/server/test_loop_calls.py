"""LoopCalls: what another thread hands the serve loop runs on the loop's thread, wakes its poll,
is never run once its caller gave up, and fails at once when the loop has stopped."""

from __future__ import annotations

import select
import threading
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from lmcache_triton.server.loop_calls import LoopCalls, LoopStopped


def _readable(calls: LoopCalls, timeout_s: float = 0.0) -> bool:
    return bool(select.select([calls.fileno()], [], [], timeout_s)[0])


def test_a_call_runs_on_the_loop_thread_and_wakes_its_poll() -> None:
    calls = LoopCalls()
    try:
        assert not _readable(calls)
        ran_on: list[str] = []
        future = calls.submit(lambda: ran_on.append(threading.current_thread().name) or 42)
        assert _readable(calls), "an idle loop must wake when a call arrives"
        assert not future.done()  # nothing runs until the loop takes it
        calls.run_pending()
        assert future.result(0) == 42 and ran_on == [threading.current_thread().name]
        assert not _readable(calls), "the wake-ups were taken with the calls"

        failing = calls.submit(lambda: 1 / 0)
        calls.run_pending()  # a failing call costs its caller an exception, not the loop
        with pytest.raises(ZeroDivisionError):
            failing.result(0)
    finally:
        calls.close()


def test_a_call_its_caller_gave_up_on_is_never_run() -> None:
    calls = LoopCalls()
    try:
        ran: list[int] = []
        future = calls.submit(lambda: ran.append(1))
        with pytest.raises(FutureTimeout):
            future.result(0.01)
        assert future.cancel()
        calls.run_pending()
        assert ran == []
    finally:
        calls.close()


def test_after_close_calls_fail_at_once() -> None:
    calls = LoopCalls()
    queued = calls.submit(lambda: 1)
    calls.close()
    with pytest.raises(LoopStopped):
        queued.result(0)  # its caller is told now, not after its timeout
    with pytest.raises(LoopStopped):
        calls.submit(lambda: 1)
