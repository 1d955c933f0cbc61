"""Load or recompute (engine/load_policy.py), without vLLM or I/O: `decide` over tiers whose
estimates the test sets by hand, and PrefillEstimate's fit of synthetic steps."""

from __future__ import annotations

import random

import pytest

from lmcache_triton.engine.load_policy import (
    CHEAPER,
    DEADLINE_SLACK_S,
    DECISION_REASONS,
    LOAD,
    NEGLIGIBLE,
    NOISE_S,
    POLICY_ALWAYS,
    RECOMPUTE,
    RECOMPUTE_CHEAPER,
    TIER_SLOW,
    UNMEASURED,
    ChunkAt,
    LoadDecision,
    PrefillEstimate,
    decide,
)
from lmcache_triton.storage.transfer_cost import SLOW_AFTER_MISSES, TransferEstimate

MB = 1 << 20
TOKENS = 256              # per chunk
PER_TOKEN_S = 1e-4        # vLLM's prefill: 25.6 ms a chunk
CHUNK_RECOMPUTE_S = TOKENS * PER_TOKEN_S


def estimate(latency_s: float | None = None, bytes_per_s: float | None = None, *, slow: bool = False
             ) -> TransferEstimate:
    """A tier's estimate as if measured: `latency_s` a call, `bytes_per_s` (None: never measured)."""
    est = TransferEstimate()
    est.latency_s = latency_s
    est.seconds_per_byte = None if bytes_per_s is None else 1.0 / bytes_per_s
    if slow:
        for _ in range(SLOW_AFTER_MISSES):
            est.deadline_missed()
    return est


def tiers(**estimates: TransferEstimate):
    """cost_of over named estimates; the CPU tier never measured (its copies count as free) unless given."""
    estimates.setdefault("cpu", estimate())
    asked: list[str] = []

    def cost_of(name: str) -> TransferEstimate:
        asked.append(name)
        return estimates[name]

    cost_of.asked = asked
    return cost_of


def prefill(per_token_s: float | None = PER_TOKEN_S) -> PrefillEstimate:
    p = PrefillEstimate()
    if per_token_s is not None:
        p.calibrate(per_token_s)
    return p


def chunks(*tier_names: str, nbytes: int = MB) -> list[ChunkAt]:
    return [ChunkAt(name, TOKENS, nbytes) for name in tier_names]


FAST_CPU = estimate(0.0, 10e9)           # 0.1 ms a chunk
FAST_DISK = estimate(0.0005, 2e9)        # 1 ms a chunk
SLOW_REMOTE = estimate(0.005, 10e6)      # ~110 ms a chunk: four times a chunk's prefill


# ---- what to load --------------------------------------------------------------------------------
def test_no_chunks_is_nothing_to_load():
    assert decide([], tiers(), prefill()) == LoadDecision(0, RECOMPUTE_CHEAPER, None, 0.0, 0.0, None)


@pytest.mark.parametrize("cpu", [pytest.param(FAST_CPU, id="cpu-measured"),
                                 pytest.param(estimate(), id="cpu-never-measured")])
def test_a_prefix_all_in_the_cpu_tier_loads(cpu):
    d = decide(chunks("cpu", "cpu", "cpu", "cpu"), tiers(cpu=cpu), prefill())
    assert (d.chunks, d.reason, d.rest_reason) == (4, CHEAPER, None)
    assert d.recompute_s == pytest.approx(4 * CHUNK_RECOMPUTE_S)
    assert d.load_s == pytest.approx(0.0 if cpu.seconds_per_byte is None else 4 * MB / 10e9)


def test_a_remote_slower_than_the_prefill_is_recomputed():
    d = decide(chunks("remote", "remote", "remote", "remote"), tiers(remote=SLOW_REMOTE), prefill())
    assert (d.chunks, d.reason, d.rest_reason, d.deadline_s) == (0, RECOMPUTE_CHEAPER, None, None)
    assert (d.load_s, d.recompute_s) == (0.0, 0.0), "no chunk chosen: nothing to load, nothing of theirs to recompute"


@pytest.mark.parametrize("lower", [pytest.param("remote", id="slow-remote"), pytest.param("disk", id="slow-disk")])
def test_a_fast_cpu_half_and_a_slow_lower_half_loads_exactly_the_cpu_half(lower):
    d = decide(chunks("cpu", "cpu", lower, lower), tiers(cpu=FAST_CPU, **{lower: SLOW_REMOTE}), prefill())
    assert (d.chunks, d.reason, d.rest_reason) == (2, CHEAPER, RECOMPUTE_CHEAPER)
    assert d.recompute_s == pytest.approx(2 * CHUNK_RECOMPUTE_S)
    assert d.load_s == pytest.approx(2 * MB / 10e9), "the chosen chunks' copy only"


def test_a_fast_disk_after_the_cpu_part_is_loaded_too():
    d = decide(chunks("cpu", "cpu", "disk", "disk"), tiers(cpu=FAST_CPU, disk=FAST_DISK), prefill())
    assert (d.chunks, d.reason, d.rest_reason) == (4, CHEAPER, None)
    assert d.load_s == pytest.approx(2 * 0.0005 + 2 * MB / 2e9 + 4 * MB / 10e9), \
        "the disk's calls and bytes, and the copy of all four out of the CPU tier"


def test_a_fast_disk_then_a_slow_remote_stops_before_the_remote():
    d = decide(chunks("disk", "disk", "remote", "remote"), tiers(disk=FAST_DISK, remote=SLOW_REMOTE), prefill())
    assert (d.chunks, d.reason, d.rest_reason) == (2, CHEAPER, RECOMPUTE_CHEAPER)


@pytest.mark.parametrize("where, expect", [
    pytest.param(("remote", "remote"), (0, TIER_SLOW, None), id="slow-tier-first"),
    pytest.param(("cpu", "cpu", "remote", "remote"), (2, CHEAPER, TIER_SLOW), id="cpu-then-slow-tier"),
])
def test_a_tier_marked_slow_is_not_loaded_from_whatever_its_estimate(where, expect):
    fast_but_missing_deadlines = estimate(0.0, 10e9, slow=True)
    d = decide(chunks(*where), tiers(remote=fast_but_missing_deadlines), prefill())
    assert (d.chunks, d.reason, d.rest_reason) == expect


def test_the_cpu_tier_is_never_skipped_as_slow():
    d = decide(chunks("cpu", "cpu"), tiers(cpu=estimate(0.0, 10e9, slow=True)), prefill())
    assert (d.chunks, d.reason) == (2, CHEAPER)


@pytest.mark.parametrize("deadline_ms, expect", [pytest.param(None, None, id="no-limit"),
                                                 pytest.param(300.0, 0.3, id="deadline_ms")])
def test_policy_always_loads_everything(deadline_ms, expect):
    slow_marked = estimate(0.005, 10e6, slow=True)
    d = decide(chunks("cpu", "remote", "remote", "remote"), tiers(remote=slow_marked), prefill(),
               policy="always", deadline_ms=deadline_ms)
    assert (d.chunks, d.reason, d.rest_reason) == (4, POLICY_ALWAYS, None)
    assert d.deadline_s == expect, "only a limit the user set"


def test_an_unmeasured_lower_tier_is_tried_with_the_recompute_estimate_as_its_deadline():
    d = decide(chunks("cpu", "remote", "remote", "remote"), tiers(cpu=FAST_CPU, remote=estimate()), prefill())
    assert (d.chunks, d.reason, d.rest_reason, d.load_s) == (4, UNMEASURED, None, None)
    assert d.recompute_s == pytest.approx(4 * CHUNK_RECOMPUTE_S)
    assert d.deadline_s == pytest.approx(4 * CHUNK_RECOMPUTE_S), "at most what computing those tokens costs"


def test_an_unmeasured_tier_with_a_quick_prefill_still_gets_the_slack():
    d = decide(chunks("remote"), tiers(remote=estimate()), prefill(1e-7))
    assert (d.chunks, d.reason) == (1, UNMEASURED)
    assert d.deadline_s == DEADLINE_SLACK_S


def test_a_latency_alone_is_not_a_measurement():
    """A tier only asked questions so far (a latency, no bandwidth) cannot say what bytes cost."""
    d = decide(chunks("remote", "remote"), tiers(remote=estimate(0.001, None)), prefill())
    assert (d.chunks, d.reason, d.load_s) == (2, UNMEASURED, None)


def test_without_a_prefill_estimate_every_hit_loads_without_a_deadline():
    d = decide(chunks("cpu", "remote"), tiers(remote=SLOW_REMOTE), prefill(None))
    assert (d.chunks, d.reason, d.recompute_s, d.deadline_s) == (2, UNMEASURED, None, None)
    d = decide(chunks("cpu", "remote"), tiers(remote=SLOW_REMOTE), prefill(None), deadline_ms=80)
    assert d.deadline_s == pytest.approx(0.08)


def test_every_estimate_is_asked_once_per_tier():
    cost_of = tiers(cpu=FAST_CPU, disk=FAST_DISK)
    decide(chunks("cpu", "cpu", "disk", "disk", "disk"), cost_of, prefill())
    assert sorted(cost_of.asked) == ["cpu", "disk"]


def test_reasons_are_the_declared_ones():
    assert set(DECISION_REASONS) == {LOAD, RECOMPUTE}
    assert {CHEAPER, NEGLIGIBLE, POLICY_ALWAYS, UNMEASURED} == set(DECISION_REASONS[LOAD])
    assert {RECOMPUTE_CHEAPER, TIER_SLOW} == set(DECISION_REASONS[RECOMPUTE])


# ---- by when ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("load_s, factor, deadline_ms, expect", [
    pytest.param(0.2, 2.0, None, 0.4, id="factor-times-the-estimate"),
    pytest.param(0.01, 2.0, None, 0.01 + DEADLINE_SLACK_S, id="at-least-the-slack-past-it"),
    pytest.param(0.2, 3.0, None, 0.6, id="another-factor"),
    pytest.param(0.2, 2.0, 250.0, 0.25, id="capped-by-deadline_ms"),
    pytest.param(0.2, 2.0, 1000.0, 0.4, id="deadline_ms-above-it"),
])
def test_the_deadline(load_s, factor, deadline_ms, expect):
    remote = estimate(0.0, MB / load_s)  # one chunk: load_s
    d = decide(chunks("remote"), tiers(remote=remote), prefill(1.0), deadline_factor=factor, deadline_ms=deadline_ms)
    assert (d.chunks, d.reason) == (1, CHEAPER)
    assert d.load_s == pytest.approx(load_s)
    assert d.deadline_s == pytest.approx(expect)


# ---- the margin, at its boundary (exact binary fractions: no rounding decides) ---------------------
# A load of 1 s is worth it up to recompute(k) = (1 - NOISE_S) * (1 + margin); "cheaper" from (1 + margin) on.
@pytest.mark.parametrize("margin, recompute_s, reason", [
    pytest.param(0.25, 1.25, CHEAPER, id="load-x1.25-equals-recompute"),
    pytest.param(0.25, 1.25 - 2 ** -20, NEGLIGIBLE, id="recompute-a-hair-below-within-noise"),
    pytest.param(0.25, (1 - NOISE_S) * 1.25, NEGLIGIBLE, id="at-the-noise-boundary"),
    pytest.param(0.25, (1 - NOISE_S) * 1.25 - 2 ** -10, RECOMPUTE_CHEAPER, id="past-the-noise"),
    pytest.param(0.0, 1.0, CHEAPER, id="no-margin-a-tie-loads"),
    pytest.param(0.5, 1.25, RECOMPUTE_CHEAPER, id="a-larger-margin"),
])
def test_the_margin_at_its_boundary(margin, recompute_s, reason):
    remote = estimate(0.0, float(MB))  # 1 MiB in exactly 1 s
    d = decide(chunks("remote"), tiers(remote=remote), prefill(recompute_s / TOKENS), margin=margin)
    loads = reason != RECOMPUTE_CHEAPER
    assert d.chunks == (1 if loads else 0)
    assert d.reason == reason
    assert (d.load_s, d.recompute_s) == ((1.0, pytest.approx(recompute_s)) if loads else (0.0, 0.0)), \
        "of the chosen chunks"


def test_the_prefix_saving_the_most_wins_not_the_longest_that_passes():
    """A cheap CPU part, then a remote chunk that alone passes the margin only thanks to the CPU
    part's saving: the longer prefix passes, but saves less than stopping before the remote."""
    remote = estimate(0.0, MB / 0.02)  # 20 ms a chunk; its prefill 25.6 ms: load x 1.25 = 25 ms
    d = decide(chunks("cpu", "cpu", "remote"), tiers(remote=remote), prefill())
    assert d.chunks == 3, "20 ms for 25.6 ms: worth it with the margin, and saves 5.6 ms more"
    slower = estimate(0.0, MB / 0.024)  # 24 ms: 24 x 1.25 = 30 > 25.6 alone, but the prefix of 3 passes
    d = decide(chunks("cpu", "cpu", "remote"), tiers(remote=slower), prefill())
    assert d.chunks == 3 and d.reason == CHEAPER, "gain 1.6 ms more than stopping at the CPU part"
    slow = estimate(0.0, MB / 0.03)  # 30 ms: 4.4 ms less saved than the CPU part alone, within the noise
    d = decide(chunks("cpu", "cpu", "remote"), tiers(remote=slow), prefill())
    assert (d.chunks, d.reason) == (3, CHEAPER), "saves about as much: loading spares vLLM the compute"
    slowest = estimate(0.0, MB / 0.06)  # 60 ms: passes the margin with the CPU part, but saves 34 ms less
    d = decide(chunks("cpu", "cpu", "remote"), tiers(remote=slowest), prefill())
    assert (d.chunks, d.rest_reason) == (2, RECOMPUTE_CHEAPER)


# ---- PrefillEstimate -------------------------------------------------------------------------------
OVERHEAD_S = 0.005


def run_steps(p: PrefillEstimate, n: int, per_token_s: float, rng: random.Random, *, sizes=None) -> None:
    """vLLM's steps: decode batches (1-64 tokens) and prefills (512-4096), each `OVERHEAD_S` plus
    its tokens, off by up to 3%."""
    for _ in range(n):
        tokens = sizes(rng) if sizes else rng.choice([rng.randint(1, 64), rng.randint(512, 4096)])
        p.observe(tokens, (OVERHEAD_S + tokens * per_token_s) * (1 + rng.uniform(-0.03, 0.03)))


def test_prefill_fits_the_per_token_slope_apart_from_the_steps_fixed_cost():
    p = prefill(1e-3)  # a calibration far off: the steps replace it
    run_steps(p, 200, 5e-5, random.Random(0))
    assert p.steps == 200
    assert p.per_token_s == pytest.approx(5e-5, rel=0.05)
    assert p.seconds(1000) == pytest.approx(1000 * 5e-5, rel=0.05)


@pytest.mark.parametrize("sizes, calibration, expect", [
    pytest.param(lambda r: r.randint(1, 8), 2e-4, 2e-4, id="decode-only-uses-the-calibration"),
    pytest.param(lambda r: 2048, 2e-4, 2e-4, id="same-size-prefills-use-the-calibration"),
    pytest.param(lambda r: r.randint(1, 8), None, None, id="decode-only-without-calibration-unknown"),
    pytest.param(lambda r: 2048, None, (OVERHEAD_S + 2048 * 5e-5) / 2048, id="same-size-prefills-whole-step-time"),
])
def test_prefill_uses_the_calibration_until_the_steps_differ_enough(sizes, calibration, expect):
    p = prefill(calibration)
    run_steps(p, 50, 5e-5, random.Random(1), sizes=sizes)
    if expect is None:
        assert p.per_token_s is None and p.seconds(100) is None
    else:
        assert p.per_token_s == pytest.approx(expect, rel=0.05)


def test_prefill_with_nothing_observed():
    assert prefill(None).per_token_s is None
    assert prefill(3e-5).seconds(1000) == pytest.approx(0.03)


def test_prefill_ignores_empty_steps():
    p = prefill(None)
    p.observe(0, 0.01)
    p.observe(100, 0.0)
    p.observe(-5, 0.01)
    assert p.steps == 0 and p.per_token_s is None


def test_prefill_reacts_to_a_slowdown():
    rng = random.Random(2)
    p = prefill()
    run_steps(p, 200, 5e-5, rng)
    run_steps(p, 10, 1.5e-4, rng)  # a busier host: three times slower a token
    assert 1.5e-4 / 2 <= p.per_token_s <= 1.5e-4 * 2, "within 2x of the new speed in 10 steps"
    run_steps(p, 50, 1.5e-4, rng)
    assert p.per_token_s == pytest.approx(1.5e-4, rel=0.1)
