"""Prometheus metrics, named lmcache_triton_*, labelled by model and rank.

Counters and gauges are read from the live engines' stats at scrape time (a custom collector:
nothing is counted twice and the per-request path pays nothing for them); latency and throughput
histograms are observed per operation. Whoever owns the process exports its engines (`export`:
vLLM's worker does, on `http://0.0.0.0:(prometheus_port + rank)/metrics` when the config sets
`prometheus_port`); building an engine exports nothing. Under
vLLM's multiprocess Prometheus mode (PROMETHEUS_MULTIPROC_DIR) only the histograms join vLLM's
own /metrics: prometheus-client cannot aggregate custom collectors across processes.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Protocol

from prometheus_client import REGISTRY, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lmcache_triton.observability.stats import EngineSnapshot, LMCStatsMonitor


class Exported(Protocol):
    """What the exporter needs of an engine."""

    stats_monitor: LMCStatsMonitor

    def snapshot(self) -> EngineSnapshot: ...

logger = logging.getLogger("lmcache_triton")

_LABELS = ("model", "rank")
_SECONDS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_BYTES_PER_SECOND = (1e8, 2.5e8, 5e8, 1e9, 2e9, 5e9, 1e10, 2e10, 5e10, 1e11, 2e11, 5e11)

_lock = threading.RLock()  # register() calls collect() while histograms() holds it
_engines: weakref.WeakSet[Exported] = weakref.WeakSet()
_histograms: dict[str, Histogram] = {}
_http_ports: set[int] = set()


def histograms() -> dict[str, Histogram]:
    """The per-operation histograms, created once per process."""
    with _lock:
        if not _histograms:
            for op in ("lookup", "retrieve", "store"):
                _histograms[f"{op}_seconds"] = Histogram(
                    f"lmcache_triton_{op}_seconds", f"Time of one {op} call", _LABELS, buckets=_SECONDS)
            for op in ("retrieve", "store"):
                _histograms[f"{op}_bytes_per_second"] = Histogram(
                    f"lmcache_triton_{op}_bytes_per_second", f"KV bytes moved per second by one {op} call",
                    _LABELS, buckets=_BYTES_PER_SECOND)
            REGISTRY.register(_EngineCollector())
        return _histograms


def track(engine: Exported) -> None:
    """Exports `engine`'s counters at every scrape and its operations in the histograms."""
    hists = histograms()
    snap = engine.snapshot()
    labels = (snap.model, str(snap.rank))
    bound = {name: h.labels(*labels) for name, h in hists.items()}

    def observe(op: str, seconds: float, nbytes: int | None) -> None:
        bound[f"{op}_seconds"].observe(seconds)
        if nbytes and seconds > 0:
            bound[f"{op}_bytes_per_second"].observe(nbytes / seconds)

    engine.stats_monitor.observer = observe
    with _lock:
        _engines.add(engine)


def export(engine: Exported, port: int | None) -> None:
    """`track(engine)`, and serve /metrics on `port + rank` when `port` is set (config prometheus_port)."""
    track(engine)
    if port is not None:
        serve(port + engine.snapshot().rank)


def serve(port: int) -> None:
    """Starts the metrics HTTP server on `port` once per process; a busy port is logged, not raised."""
    with _lock:
        if port in _http_ports:
            return
        try:
            start_http_server(port)
        except OSError as e:
            logger.warning("lmcache_triton: cannot export metrics on port %d: %s", port, e)
            return
        _http_ports.add(port)
    logger.info("lmcache_triton metrics on http://0.0.0.0:%d/metrics", port)


# Names follow Prometheus' conventions: a counter's name ends in _total (CounterMetricFamily adds
# it), units are in the name (_seconds, _bytes, _tokens, _chunks, _per_token), a ratio ends in _ratio,
# a 0/1 state (tier_slow) has none (as Prometheus' own `up`). docs/metrics.md lists every one;
# tests/observability/test_prometheus.py checks the list against a scrape.
_COUNTERS = {  # stats field -> (metric name without _total, help)
    "lookup_requests": ("lookup_requests", "Lookups answered: one per request vLLM schedules (again if preempted)"),
    "lookup_misses": ("lookup_misses", "Lookups that found none of their tokens: requests that missed entirely"),
    "lookup_tokens": ("lookup_tokens", "Prompt tokens asked about by lookups"),
    "lookup_hit_tokens": ("lookup_hit_tokens", "Prompt tokens lookups found cached"),
    "retrieve_requests": ("retrieve_requests", "Retrieve (load) calls"),
    "requested_tokens": ("requested_tokens", "Tokens asked of retrieve (what lookups found and vLLM accepted)"),
    "hit_tokens": ("hit_tokens", "Tokens loaded by retrieve into vLLM's paged cache"),
    "retrieved_bytes": ("retrieved_bytes", "KV bytes loaded by retrieve"),
    "store_requests": ("store_requests", "Store calls"),
    "stored_tokens": ("stored_tokens", "Tokens stored (chunks already cached are not counted again)"),
    "stored_bytes": ("stored_bytes", "KV bytes stored"),
    "store_refusals": ("store_refused_chunks", "Chunks not stored because the CPU tier was full of held chunks"),
    "verify_checked": ("verify_checked", "Hit chunks compared with the KV the model recomputed (verify_hit_rate)"),
    "verify_mismatches": ("verify_mismatch", "Stored chunks that differed from the recomputed KV (removed)"),
}


_DISK_TIER = "LocalDiskBackend"  # the disk tier's name in StorageManager.usage()


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


class _EngineCollector:
    """Yields the counters and gauges of every live engine at scrape time."""

    def collect(self):
        counters = {f: CounterMetricFamily(f"lmcache_triton_{name}", doc, labels=_LABELS)
                    for f, (name, doc) in _COUNTERS.items()}
        tier = (*_LABELS, "tier")
        evictions = CounterMetricFamily("lmcache_triton_evictions", "Chunks evicted, per tier", labels=tier)
        remote_errors = CounterMetricFamily("lmcache_triton_remote_errors",
                                            "Failed calls to a remote tier (each a miss or an unstored chunk)",
                                            labels=tier)
        disk_errors = CounterMetricFamily("lmcache_triton_disk_errors",
                                          "Failed reads, writes, scans or deletes of the disk tier", labels=tier)
        checksum = CounterMetricFamily("lmcache_triton_checksum_failures",
                                       "Chunks that failed their checks on read (each a miss)", labels=tier)
        lookup_ratio = GaugeMetricFamily("lmcache_triton_lookup_hit_ratio",
                                         "lookup_hit_tokens / lookup_tokens since start: the share of prompt "
                                         "tokens found cached", labels=_LABELS)
        retrieve_ratio = GaugeMetricFamily("lmcache_triton_retrieve_hit_ratio",
                                           "hit_tokens / requested_tokens since start: the share of the tokens "
                                           "asked of retrieve that loaded (misses never reach retrieve)",
                                           labels=_LABELS)
        usage = GaugeMetricFamily("lmcache_triton_usage_bytes", "Bytes held per tier", labels=tier)
        capacity = GaugeMetricFamily("lmcache_triton_capacity_bytes", "Capacity per tier", labels=tier)
        held = GaugeMetricFamily("lmcache_triton_held_chunks", "Chunks held in the CPU tier", labels=_LABELS)
        misses = CounterMetricFamily("lmcache_triton_miss_tokens", "Tokens lookups did not find, by why",
                                     labels=(*_LABELS, "reason"))
        expired = CounterMetricFamily("lmcache_triton_expired_reservations",
                                      "Lookup holds released by their lease, not by a load (reservation_lease_secs)",
                                      labels=_LABELS)
        decisions = CounterMetricFamily("lmcache_triton_load_decision",
                                        "Load-or-recompute decisions of lookups, by decision and why (a lookup "
                                        "that loads part of its hit counts one of each)",
                                        labels=(*_LABELS, "decision", "reason"))
        decision_tokens = CounterMetricFamily("lmcache_triton_load_decision_tokens",
                                              "Found prompt tokens the decisions loaded or left to recompute",
                                              labels=(*_LABELS, "decision", "reason"))
        deadline_stops = CounterMetricFamily("lmcache_triton_load_deadline_stops",
                                             "Loads from a lower tier cut short at their deadline", labels=_LABELS)
        latency = GaugeMetricFamily("lmcache_triton_tier_latency_seconds",
                                    "Estimated latency of one call to a tier (moving average)", labels=tier)
        throughput = GaugeMetricFamily("lmcache_triton_tier_throughput_bytes_per_second",
                                       "Estimated bytes per second a tier moves (moving average)", labels=tier)
        slow = GaugeMetricFamily("lmcache_triton_tier_slow",
                                 "1 while a tier is skipped for loads (it kept missing its deadlines)", labels=tier)
        deadline_misses = CounterMetricFamily("lmcache_triton_tier_deadline_misses",
                                              "Loads from a tier that ran past their deadline", labels=tier)
        prefill = GaugeMetricFamily("lmcache_triton_prefill_seconds_per_token",
                                    "vLLM's estimated prefill time per token on this worker (what not loading "
                                    "costs)", labels=_LABELS)
        with _lock:
            engines = list(_engines)
        for engine in engines:
            snap = engine.snapshot()
            labels = [snap.model, str(snap.rank)]
            stats = snap.stats
            for reason, n in sorted(stats.miss_tokens.items()):
                misses.add_metric([*labels, reason], n)
            expired.add_metric(labels, snap.expired_reservations)
            for name, family in (("load_decisions", decisions), ("load_decision_tokens", decision_tokens)):
                for key, n in sorted(getattr(stats, name).items()):
                    family.add_metric([*labels, *key.split("/", 1)], n)  # "decision/reason"
            deadline_stops.add_metric(labels, stats.load_deadline_stops)
            if snap.prefill_seconds_per_token is not None:
                prefill.add_metric(labels, snap.prefill_seconds_per_token)
            for tier_name, cost in snap.costs.items():
                tl = [*labels, tier_name]
                if cost.latency_s is not None:
                    latency.add_metric(tl, cost.latency_s)
                if cost.bytes_per_s is not None:
                    throughput.add_metric(tl, cost.bytes_per_s)
                slow.add_metric(tl, int(cost.slow))
                deadline_misses.add_metric(tl, cost.deadline_misses)
            for f, family in counters.items():
                family.add_metric(labels, getattr(stats, f))
            lookup_ratio.add_metric(labels, _ratio(stats.lookup_hit_tokens, stats.lookup_tokens))
            retrieve_ratio.add_metric(labels, _ratio(stats.hit_tokens, stats.requested_tokens))
            for tier_name, t in snap.tiers.items():
                tl = [*labels, tier_name]
                if t.evictions is not None:  # None: a remote store evicts on its own, unseen
                    evictions.add_metric(tl, t.evictions)
                if t.used_bytes is not None:
                    usage.add_metric(tl, t.used_bytes)
                if t.capacity_bytes is not None:
                    capacity.add_metric(tl, t.capacity_bytes)
                if tier_name == "cpu":
                    held.add_metric(labels, t.held_chunks or 0)
                    continue
                checksum.add_metric(tl, t.corrupt)
                (disk_errors if tier_name == _DISK_TIER else remote_errors).add_metric(tl, t.errors)
        yield from counters.values()
        yield from (misses, evictions, remote_errors, disk_errors, checksum, expired, lookup_ratio, retrieve_ratio, usage,
                    capacity, held, decisions, decision_tokens, deadline_stops, latency, throughput, slow,
                    deadline_misses, prefill)


def scrape_engine_stats(url: str, timeout: float = 5.0) -> dict[str, dict]:
    """A worker's lmcache_triton_* metrics at `url` (its /metrics), per model and rank: counters
    and gauges by name, `miss_tokens` by reason, and a `load_or_recompute` section (`_load_or_recompute`).
    For `lmcache-triton stats http://...`."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as reply:
        text = reply.read().decode()
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("lmcache_triton_") or family.type == "histogram":
            continue
        name = family.name.removeprefix("lmcache_triton_")
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = dict(sample.labels)
            engine = out.setdefault(f"{labels.pop('model', '')} rank {labels.pop('rank', '')}", {})
            if "decision" in labels:
                engine.setdefault(name, {})[f"{labels['decision']}/{labels['reason']}"] = sample.value
            elif "reason" in labels:
                engine.setdefault(name, {})[labels["reason"]] = sample.value
            elif "tier" in labels:
                engine.setdefault(name, {})[labels["tier"]] = sample.value
            else:
                engine[name] = sample.value
    if not out:
        raise ValueError(f"{url} serves no lmcache_triton metrics")
    return {name: _load_or_recompute(engine) for name, engine in out.items()}


def _3g(x: float) -> float:
    return float(f"{x:.3g}")


def _load_or_recompute(engine: dict) -> dict:
    """`engine` with the load-or-recompute metrics gathered into one section, in the units one
    reads them in: per tier latency ms, throughput MB/s, slow, deadline misses; prefill µs per
    token (None: not measured yet); decisions by "decision/reason" with their lookups and tokens."""
    latency = engine.pop("tier_latency_seconds", {})
    throughput = engine.pop("tier_throughput_bytes_per_second", {})
    slow = engine.pop("tier_slow", {})
    misses = engine.pop("tier_deadline_misses", {})
    lookups = engine.pop("load_decision", {})
    tokens = engine.pop("load_decision_tokens", {})
    prefill = engine.pop("prefill_seconds_per_token", None)
    engine["load_or_recompute"] = {
        "prefill_us_per_token": None if prefill is None else _3g(prefill * 1e6),
        "tiers": {tier: {"latency_ms": _3g(latency[tier] * 1e3) if tier in latency else None,
                         "throughput_MB_per_s": _3g(throughput[tier] / 1e6) if tier in throughput else None,
                         "slow": bool(slow.get(tier, 0)), "deadline_misses": int(misses.get(tier, 0))}
                  for tier in slow},
        "decisions": {key: {"lookups": int(n), "tokens": int(tokens.get(key, 0))} for key, n in lookups.items()},
        "deadline_stops": int(engine.pop("load_deadline_stops", 0)),
    }
    return engine
