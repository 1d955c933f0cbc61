"""TransferEstimate (storage/transfer_cost.py): a tier's moving latency and time per byte, from
synthetic transfers whose true latency and bandwidth the test knows; and the slow marking that
deadline misses set, on an injected clock."""

from __future__ import annotations

import random
import threading

import pytest

from lmcache_triton.storage.transfer_cost import SLOW_AFTER_MISSES, SLOW_RETRY_S, TransferCost, TransferEstimate

MB = 1 << 20
LATENCY_S = 0.001          # the synthetic tier: 1 ms a call
BYTES_PER_S = 1e9          # and 1 GB/s
NOISE = 0.02               # each sample off by up to 2%


class Tier:
    """A synthetic tier: every call costs `latency_s`, every byte 1 / `bytes_per_s`, each sample
    off by up to `noise` (seeded, the same every run). It feeds what it "moved" to an estimate the
    way the backends do: presence questions as round trips, reads as transfers."""

    def __init__(self, estimate: TransferEstimate, latency_s: float, bytes_per_s: float, *, seed: int = 0,
                 noise: float = NOISE) -> None:
        self.estimate, self.latency_s, self.bytes_per_s, self.noise = estimate, latency_s, bytes_per_s, noise
        self.rng = random.Random(seed)

    def _jitter(self, seconds: float) -> float:
        return seconds * (1 + self.rng.uniform(-self.noise, self.noise))

    def round_trip(self) -> None:
        self.estimate.observe_round_trip(self._jitter(self.latency_s))

    def transfer(self) -> None:
        # Reads that the bytes dominate (4 to 64 MB: 4 to 64 ms against 1 or 2 ms of latency).
        nbytes, calls = self.rng.randint(4 * MB, 64 * MB), self.rng.randint(1, 2)
        self.estimate.observe_transfer(nbytes, self._jitter(calls * self.latency_s + nbytes / self.bytes_per_s), calls)

    def run(self, n: int) -> None:
        for i in range(n):
            self.round_trip() if i % 2 == 0 else self.transfer()


def _within(value: float | None, expected: float, rel: float) -> bool:
    return value is not None and abs(value - expected) <= rel * expected


def test_converges_on_a_synthetic_tier():
    est = TransferEstimate()
    Tier(est, LATENCY_S, BYTES_PER_S).run(60)
    snap = est.snapshot()
    assert _within(snap.latency_s, LATENCY_S, 0.05), snap
    assert _within(snap.bytes_per_s, BYTES_PER_S, 0.05), snap
    assert snap.samples == 60 and not snap.slow and snap.deadline_misses == 0
    for nbytes, calls in [(MB, 1), (16 * MB, 4), (256 * MB, 1), (0, 3)]:
        truth = calls * LATENCY_S + nbytes / BYTES_PER_S
        assert _within(est.seconds(nbytes, calls), truth, 0.05), (nbytes, calls)


@pytest.mark.parametrize("slower", [
    pytest.param(dict(latency=1, bandwidth=10), id="bandwidth-10x-slower"),
    pytest.param(dict(latency=10, bandwidth=10), id="latency-and-bandwidth-10x-slower"),
])
def test_reacts_to_a_slowdown_within_a_few_samples(slower):
    est = TransferEstimate()
    Tier(est, LATENCY_S, BYTES_PER_S).run(60)
    before = est.seconds(32 * MB, 1)
    busy = Tier(est, LATENCY_S * slower["latency"], BYTES_PER_S / slower["bandwidth"], seed=1)
    truth = busy.latency_s + 32 * MB / busy.bytes_per_s
    for _ in range(3):  # a few of the slow tier's reads (each with a presence question before it)
        busy.round_trip()
        busy.transfer()
    now = est.seconds(32 * MB, 1)
    assert now > 4 * before, "three slow reads must move the estimate most of the way"
    assert truth / 2 <= now <= truth * 2, (now, truth)
    busy.run(40)
    assert _within(est.seconds(32 * MB, 1), truth, 0.05), "and converge on the new speed"


def test_a_single_outlier_does_not_become_the_estimate():
    est = TransferEstimate()
    Tier(est, LATENCY_S, BYTES_PER_S).run(60)
    settled = est.seconds(32 * MB, 1)
    est.observe_transfer(32 * MB, 100 * settled)  # one read stuck behind something for a moment
    assert est.seconds(32 * MB, 1) < 50 * settled


def test_small_transfers_feed_the_latency_only():
    est = TransferEstimate()
    est.observe_transfer(4 << 10, 0.004, calls=2)  # 4 KB in two calls: all latency
    assert est.latency_s == pytest.approx(0.002)
    assert est.seconds_per_byte is None and est.seconds(MB, 1) is None, "no bandwidth from a small transfer"
    snap = est.snapshot()
    assert (snap.latency_s, snap.bytes_per_s, snap.samples) == (pytest.approx(0.002), None, 1)
    est.observe_transfer(8 * MB, 0.010)  # now a transfer large enough to say
    assert est.seconds(8 * MB, 1) is not None


def test_a_stale_latency_never_makes_the_bytes_look_free():
    """The latency came from a slow moment (10 ms); a 12 ms transfer leaves 2 ms for its bytes by
    that, but the bytes' share is never taken as less than half the transfer."""
    est = TransferEstimate()
    est.observe_round_trip(0.010)
    est.observe_transfer(8 * MB, 0.012)
    assert est.seconds_per_byte == pytest.approx(0.006 / (8 * MB))


def test_negative_times_count_as_zero():
    est = TransferEstimate()
    est.observe_round_trip(-1.0)  # a clock step
    assert est.latency_s == 0.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_deadline_misses_in_a_row_mark_the_tier_slow_and_a_load_on_time_clears_it():
    est = TransferEstimate(clock=Clock())
    for _ in range(SLOW_AFTER_MISSES - 1):
        est.deadline_missed()
    assert not est.slow, "fewer misses than SLOW_AFTER_MISSES in a row"
    est.deadline_met()
    est.deadline_missed()
    assert SLOW_AFTER_MISSES == 1 or not est.slow, "a load on time restarts the count"
    for _ in range(SLOW_AFTER_MISSES - 1):
        est.deadline_missed()
    assert est.slow
    assert est.snapshot().slow and est.snapshot().deadline_misses == 2 * SLOW_AFTER_MISSES - 1
    est.deadline_met()
    assert not est.slow and not est.snapshot().slow


def test_a_slow_tier_is_tried_again_after_the_retry_interval():
    clock = Clock()
    est = TransferEstimate(clock=clock)
    for _ in range(SLOW_AFTER_MISSES):
        est.deadline_missed()
    assert est.slow
    clock.now += SLOW_RETRY_S - 0.1
    assert est.slow, "still skipped before SLOW_RETRY_S"
    clock.now += 0.1
    assert not est.slow, "tried again at SLOW_RETRY_S"
    est.deadline_missed()
    assert est.slow, "the retry missed too: one miss marks it slow anew"
    clock.now += SLOW_RETRY_S
    assert not est.slow
    est.deadline_met()
    est.deadline_missed()
    assert SLOW_AFTER_MISSES == 1 or not est.slow, "the retry was on time: back to counting from zero"
    assert est.deadline_misses == SLOW_AFTER_MISSES + 2


def test_the_snapshot_says_what_the_estimate_holds():
    est = TransferEstimate(clock=Clock())
    assert est.snapshot() == TransferCost(None, None, 0, False, 0), "never measured"
    est.observe_round_trip(0.002)
    est.observe_transfer(10 * MB, 0.002 + 0.010)  # 10 MB in 10 ms past the latency: 1 GB/s (binary)
    for _ in range(SLOW_AFTER_MISSES):
        est.deadline_missed()
    snap = est.snapshot()
    assert snap.latency_s == pytest.approx(0.002)
    assert snap.bytes_per_s == pytest.approx(10 * MB / 0.010)
    assert (snap.samples, snap.slow, snap.deadline_misses) == (2, True, SLOW_AFTER_MISSES)


def test_many_threads_observing_at_once():
    """Reads, writes and lookups feed one tier's estimate from several threads: every sample
    counts, and what they leave is an estimate between the speeds they saw."""
    est = TransferEstimate()
    threads, per_thread = 8, 500
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def feed(seed: int) -> None:
        try:
            tier = Tier(est, LATENCY_S * (1 + seed % 2), BYTES_PER_S / (1 + seed % 2), seed=seed)
            start.wait()
            for i in range(per_thread):
                tier.run(1) if i % 3 else tier.transfer()
                if i % 50 == 0:
                    est.deadline_missed() if seed % 2 else est.deadline_met()
                    est.snapshot()
                    est.seconds(MB, 1)
        except BaseException as e:  # noqa: BLE001 - reported below, not lost in a thread
            errors.append(e)

    workers = [threading.Thread(target=feed, args=(s,)) for s in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(30)
    assert not errors and not any(w.is_alive() for w in workers)
    snap = est.snapshot()
    assert snap.samples == threads * per_thread
    assert LATENCY_S * 0.9 <= snap.latency_s <= 2 * LATENCY_S * 1.1
    assert BYTES_PER_S / 2 * 0.9 <= snap.bytes_per_s <= BYTES_PER_S * 1.1
    assert snap.deadline_misses == threads // 2 * (per_thread // 50)
