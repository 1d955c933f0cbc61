"""What reading from a tier costs: a moving estimate of its latency per call and time per byte.

Every real transfer feeds it (the StorageManager times each lower tier's reads, writes and presence
questions; the engine times its copies out of the CPU tier), so the estimate follows the tier as it
is now, not as it was configured. The load-or-recompute decision (engine/load_policy.py) asks it
what loading a prefix would take.

A transfer of `b` bytes in `c` calls that took `t` seconds is modelled as `t = c * latency + b *
seconds_per_byte`: the latency comes from calls that move (almost) nothing (presence questions, the
probe at start), the time per byte from the rest of each transfer once its calls' latency is taken
off. Both are exponential moving averages: a tier that slows down weighs in within a few
transfers (`ALPHA`), a single outlier does not flip a decision.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

ALPHA = 0.3  # weight of the newest sample: after 3 samples of a new speed the estimate is 2/3 there
# A transfer under this size says more about the latency than about the bandwidth.
_MIN_TRANSFER_BYTES = 64 << 10
# Consecutive loads that ran past their deadline before the tier is skipped for loads.
SLOW_AFTER_MISSES = 2
# A tier skipped as slow is tried again (one load) after this long, whatever its estimate says.
SLOW_RETRY_S = 30.0


@dataclass(frozen=True)
class TransferCost:
    """One tier's estimate at one time (what metrics and `lmcache-triton stats` show)."""

    latency_s: float | None       # per call; None: never measured
    bytes_per_s: float | None     # None: no transfer large enough measured yet
    samples: int
    slow: bool                    # skipped for loads (it kept missing its deadlines)
    deadline_misses: int          # loads stopped at their deadline, ever


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


class TransferEstimate:
    """One tier's moving estimate; thread-safe (reads, writes and lookups run on several threads)."""

    def __init__(self, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self.latency_s: float | None = None
        self.seconds_per_byte: float | None = None
        self.samples = 0
        self.deadline_misses = 0
        self._consecutive_misses = 0
        self._slow_since: float | None = None

    # ---- samples -------------------------------------------------------------------------------
    def observe_round_trip(self, seconds: float) -> None:
        """A call that moved (almost) no data: a presence question, a probe."""
        with self._lock:
            self.latency_s = _ewma(self.latency_s, max(seconds, 0.0))
            self.samples += 1

    def observe_transfer(self, nbytes: int, seconds: float, calls: int = 1) -> None:
        """`nbytes` moved in `calls` calls, in `seconds` all told."""
        with self._lock:
            self.samples += 1
            if nbytes < _MIN_TRANSFER_BYTES:
                self.latency_s = _ewma(self.latency_s, max(seconds, 0.0) / max(calls, 1))
                return
            # The bytes' share: what the calls' known latency leaves, and never less than half the
            # transfer (a latency estimate from a quieter moment must not make bytes look free).
            latency = (self.latency_s or 0.0) * calls
            moving = max(seconds - latency, seconds / 2, 1e-9)
            self.seconds_per_byte = _ewma(self.seconds_per_byte, moving / nbytes)

    # ---- deadlines -----------------------------------------------------------------------------
    def deadline_missed(self) -> None:
        """A load from this tier ran past its deadline (and was cut short)."""
        with self._lock:
            self.deadline_misses += 1
            self._consecutive_misses += 1
            if self._consecutive_misses >= SLOW_AFTER_MISSES and self._slow_since is None:
                self._slow_since = self._clock()

    def deadline_met(self) -> None:
        with self._lock:
            self._consecutive_misses = 0
            self._slow_since = None

    @property
    def slow(self) -> bool:
        """Skipped for loads: it missed SLOW_AFTER_MISSES deadlines in a row. After SLOW_RETRY_S the
        next load tries it again (one more miss marks it slow anew; a load on time clears it)."""
        with self._lock:
            if self._slow_since is None:
                return False
            if self._clock() - self._slow_since < SLOW_RETRY_S:
                return True
            self._slow_since = None
            self._consecutive_misses = SLOW_AFTER_MISSES - 1
            return False

    # ---- estimates -----------------------------------------------------------------------------
    def seconds(self, nbytes: int, calls: int) -> float | None:
        """Estimated time to move `nbytes` in `calls` calls; None until a transfer large enough to
        say how fast the tier moves bytes was measured."""
        with self._lock:
            if self.seconds_per_byte is None:
                return None
            return (self.latency_s or 0.0) * calls + nbytes * self.seconds_per_byte

    def linear(self) -> tuple[float, float] | None:
        """(seconds per call, seconds per byte) of `seconds`, read once for many estimates."""
        with self._lock:
            if self.seconds_per_byte is None:
                return None
            return self.latency_s or 0.0, self.seconds_per_byte

    def snapshot(self) -> TransferCost:
        slow = self.slow
        with self._lock:
            bps = 1.0 / self.seconds_per_byte if self.seconds_per_byte else None
            return TransferCost(self.latency_s, bps, self.samples, slow, self.deadline_misses)


class Timer:
    """`with Timer() as t: ...; t.seconds` (perf_counter)."""

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start
