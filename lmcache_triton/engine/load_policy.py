"""Load or recompute: how many of a prompt's cached tokens are worth loading, and by when.

A lookup finds a prefix of chunks, each kept by some tier (the CPU tier, the disk, a remote). Loading
chunk i costs its tier's latency and bytes (storage/transfer_cost.py) plus the copy out of the CPU
tier; not loading it costs vLLM's prefill of its tokens (`PrefillEstimate`, from the steps vLLM
ran). `decide` picks the prefix whose load saves the most time, among those whose estimated load
beats recomputing by the margin, so a prompt whose first half is in the CPU tier and the rest on a
slow remote loads the first half only. The load then runs against a deadline (`deadline_s`): a tier
that slows down mid-load costs at most that, and what arrived by then is used.

Pure, apart from the estimators' locks: no I/O, no vLLM (tests/engine/test_load_policy.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from lmcache_triton.storage.transfer_cost import ALPHA, TransferEstimate

# Decisions and their reasons (the lmcache_triton_load_decision_total{decision, reason} counter).
LOAD, RECOMPUTE = "load", "recompute"
CHEAPER = "cheaper"                    # load: estimated faster than recomputing by the margin
POLICY_ALWAYS = "policy_always"        # load: load_policy always
UNMEASURED = "unmeasured"              # load: no estimate yet; the deadline is the recompute estimate
NEGLIGIBLE = "negligible"              # load: about as fast as recomputing (within NOISE_S); it spares the compute
RECOMPUTE_CHEAPER = "recompute_cheaper"  # recompute: loading was estimated slower
TIER_SLOW = "tier_slow"                # recompute: the tier kept missing its deadlines
DECISION_REASONS = {LOAD: (CHEAPER, NEGLIGIBLE, POLICY_ALWAYS, UNMEASURED), RECOMPUTE: (RECOMPUTE_CHEAPER, TIER_SLOW)}

# Differences this small are noise to a user and to the estimates (a step's jitter on a busy host):
# within it a load is chosen, because loading spares vLLM the compute, which other requests share.
# The tiny test models compute a chunk in about the time a loopback remote moves it.
NOISE_S = 0.02

# A deadline never closer than this to the estimate: a load estimated at 5 ms must not be cut short
# by a scheduler hiccup (a cut costs a recompute, the very thing the estimate said to avoid).
DEADLINE_SLACK_S = 0.05


class ChunkAt(NamedTuple):
    """One chunk of the found prefix: the tier keeping it, its tokens, bytes and calls to read it
    (one, or one per layer in layerwise mode). A tuple: a lookup makes one per chunk."""

    tier: str
    tokens: int
    nbytes: int
    calls: int = 1


@dataclass(frozen=True)
class LoadDecision:
    chunks: int                  # chunks of the found prefix to load (from the first)
    reason: str                  # why those (a LOAD reason; RECOMPUTE's when chunks == 0)
    rest_reason: str | None      # why the chunks after them are recomputed (None: nothing left)
    load_s: float | None         # estimated load time of the chosen chunks
    recompute_s: float | None    # estimated prefill time of the chosen chunks' tokens
    deadline_s: float | None     # the load stops this long after the lookup began (None: no limit)


class PrefillEstimate:
    """Seconds per token of vLLM's forward on this worker, from the steps it ran: a least-squares
    line `step_seconds = overhead + tokens * per_token` over exponentially decayed sums, so a step of
    2,048 prompt tokens and a decode step of 4 together tell the per-token cost apart from the
    step's fixed cost. Before the steps differ enough in size to say, a calibration (a timed matmul
    of the model's size, integration/vllm/step_timing.py) answers."""

    _MIN_SPREAD_TOKENS = 64.0  # steps must differ by this many tokens (std. dev.) to fit a slope

    def __init__(self, decay: float = 1 - ALPHA / 3) -> None:
        self._lock = threading.Lock()
        self._decay = decay  # ~10 steps' memory: a slowdown (a busier host) shows within a few
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self.calibrated_per_token_s: float | None = None
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            d = self._decay
            self._w = self._w * d + 1
            self._n = self._n * d + tokens
            self._t = self._t * d + seconds
            self._nn = self._nn * d + tokens * tokens
            self._nt = self._nt * d + tokens * seconds
            self.steps += 1

    def calibrate(self, per_token_s: float) -> None:
        self.calibrated_per_token_s = per_token_s

    @property
    def per_token_s(self) -> float | None:
        """Seconds of forward per token; None when neither the steps nor a calibration say."""
        with self._lock:
            if self._w > 0:
                mean_n, mean_t = self._n / self._w, self._t / self._w
                var_n = self._nn / self._w - mean_n * mean_n
                if var_n >= self._MIN_SPREAD_TOKENS ** 2:
                    slope = (self._nt / self._w - mean_n * mean_t) / var_n
                    if slope > 0:
                        return slope
                elif self.calibrated_per_token_s is None and mean_n >= self._MIN_SPREAD_TOKENS:
                    return mean_t / mean_n  # only large steps seen: their whole time, an upper bound
        return self.calibrated_per_token_s

    def seconds(self, tokens: int) -> float | None:
        per = self.per_token_s
        return None if per is None else per * tokens


def decide(chunks: Sequence[ChunkAt], cost_of: Callable[[str], TransferEstimate], prefill: PrefillEstimate, *,
           policy: str = "cost", margin: float = 0.25, deadline_factor: float = 2.0,
           deadline_ms: float | None = None, cpu_tier: str = "cpu") -> LoadDecision:
    """How many of `chunks` (the found prefix, in order) to load, and the load's deadline.

    policy "always": all of them (only `deadline_ms` limits the load). "cost": among the prefixes
    worth loading (load(k) * (1 + margin) <= recompute(k), give or take NOISE_S: load(k) <=
    recompute(k) / (1 + margin) + NOISE_S), the longest whose saving recompute(k) - load(k) is within NOISE_S of the best;
    a chunk on a tier marked slow ends the candidates. Unknown estimates: a CPU-tier
    copy counts as free (memory speed); a lower tier never measured is tried, with the recompute
    estimate of its tokens as the deadline (UNMEASURED), and the first load measures it.
    """
    limit_s = deadline_ms / 1000 if deadline_ms else None
    if not chunks:
        return LoadDecision(0, RECOMPUTE_CHEAPER, None, 0.0, 0.0, None)
    # Each estimate is linear in (calls, bytes): read once, summed chunk by chunk (a lookup of
    # 32 chunks spent ~0.25 ms here asking them chunk by chunk).
    per_token = prefill.per_token_s
    tokens = all_bytes = 0
    lower_s: float | None = 0.0  # reads from the lower tiers, one after the other
    best = (0, 0.0, 0.0, 0.0)  # (k, gain, load_s, recompute_s): none chosen costs nothing either way
    worth: list[tuple[int, float, float, float]] = []  # the prefixes worth loading, as best's
    tried = None  # a prefix loaded without a comparison (policy always, or an estimate missing)
    unmeasured = False
    slow_at: int | None = None
    copy = cost_of(cpu_tier).linear()  # every chunk is copied out of the CPU tier
    rates: dict[str, tuple[float, float] | None] = {}
    for k, chunk in enumerate(chunks, start=1):
        if chunk.tier != cpu_tier:
            if chunk.tier not in rates:
                est = cost_of(chunk.tier)
                if policy != "always" and est.slow:
                    slow_at = k - 1
                    break
                rates[chunk.tier] = est.linear()
            rate = rates[chunk.tier]
            lower_s = None if rate is None or lower_s is None else lower_s + rate[0] * chunk.calls + rate[1] * chunk.nbytes
        tokens += chunk.tokens
        all_bytes += chunk.nbytes
        load_s = None if lower_s is None else lower_s + (0.0 if copy is None else copy[0] + copy[1] * all_bytes)
        if load_s is None:
            unmeasured = True
        recompute_s = None if per_token is None else per_token * tokens
        if policy == "always" or recompute_s is None or load_s is None:
            tried = best = (k, 0.0, load_s, recompute_s)
            continue
        if load_s * (1 + margin) <= recompute_s + NOISE_S * (1 + margin):
            worth.append((k, recompute_s - load_s, load_s, recompute_s))
    if worth and tried is None:  # the longest prefix saving about as much as the best: loading spares vLLM the compute
        top = max(gain for _, gain, _, _ in worth)
        best = max((w for w in worth if w[1] >= top - NOISE_S), key=lambda w: w[0])
    k, gain, est_load, est_recompute = best
    if k == 0:
        reason = TIER_SLOW if slow_at == 0 else RECOMPUTE_CHEAPER
        return LoadDecision(0, reason, None, est_load, est_recompute, None)
    if policy == "always":
        reason = POLICY_ALWAYS
    elif unmeasured or est_recompute is None:
        reason = UNMEASURED
    else:
        reason = CHEAPER if est_load * (1 + margin) <= est_recompute else NEGLIGIBLE
    rest = None
    if k < len(chunks):
        rest = TIER_SLOW if slow_at is not None and slow_at <= k else RECOMPUTE_CHEAPER
    deadline = None
    if policy == "always" or est_recompute is None:  # only an absolute limit the user set
        pass
    elif est_load is not None:
        deadline = max(est_load * deadline_factor, est_load + DEADLINE_SLACK_S)
    elif est_recompute is not None:  # never measured: at most what computing those tokens costs
        deadline = max(est_recompute, DEADLINE_SLACK_S)
    if limit_s is not None:
        deadline = limit_s if deadline is None else min(deadline, limit_s)
    return LoadDecision(k, reason, rest, est_load, est_recompute, deadline)
