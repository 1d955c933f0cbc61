"""Our figures in vLLM's own metrics: what the worker side hands vLLM after each step
(`get_kv_connector_stats`), which vLLM sums over the ranks, prints in its periodic log line
("KV Transfer metrics: ...") and counts in its Prometheus registry, served on the API server's
/metrics with vLLM's labels (model_name, engine). The separate exporter (observability/
prometheus.py) stays for LMCache's names, per-rank figures, gauges, histograms and offline runs.

The payload crosses processes (pickled from a worker to the engine core, msgpack from there to
the API server), so it is a plain dict: a number per figure, or a dict of numbers by tier or by
reason; only what changed since the last call is in it, and nothing at all is None (vLLM sends
nothing). The classes vLLM asks for (`KVConnectorStats`, `KVConnectorPromMetrics`) are in
connector.py, the one module that imports vLLM at its top; they delegate to the functions here.

Ranks: every rank answers every lookup and loads and stores its own shard of the same tokens, so
the figures of requests and tokens come from rank 0 alone (summed over ranks they would count
each request once per rank); bytes, seconds and failed stores come from every rank (the KV every
rank moved, and the time each spent: bytes / seconds is a rank's average throughput).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache_triton.storage.manager import CPU_TIER

Figures = dict[str, Any]  # figure -> number, or -> {tier or reason: number}


@dataclass(frozen=True)
class Series:
    """One figure of the payload and the counter it feeds in vLLM's registry."""

    key: str
    doc: str
    label: str | None = None   # the label of a figure counted by tier or by reason
    per_request: bool = True   # rank 0's alone (above); False: every rank's

    @property
    def name(self) -> str:  # prometheus_client appends _total to a counter's name
        return f"vllm:lmcache_triton_{self.key}"


SERIES = (
    Series("lookups", "Lookups of the connector: one per request vLLM schedules (again if preempted)"),
    Series("lookup_hits", "Lookups that found at least one token cached"),
    Series("lookup_tokens", "Prompt tokens asked about by lookups"),
    Series("hit_tokens", "Prompt tokens lookups found cached"),
    Series("miss_tokens", "Prompt tokens lookups did not find, by why", "reason"),
    Series("loaded_tokens", "Tokens loaded into vLLM's paged KV cache"),
    Series("stored_tokens", "Tokens stored (chunks already cached are not stored again)"),
    Series("load_bytes", "Bytes loaded, by tier: cpu, the KV copied into vLLM's cache; a lower tier, "
           "what it read into the CPU tier (as it stores them)", "tier", per_request=False),
    Series("load_seconds", "Seconds those loads took, by tier", "tier", per_request=False),
    Series("store_bytes", "Bytes stored, by tier: cpu, the KV copied out of vLLM's cache; a lower "
           "tier, what it wrote (as it stores them)", "tier", per_request=False),
    Series("store_seconds", "Seconds those stores took, by tier", "tier", per_request=False),
    Series("store_failures", "Chunks a tier did not store: no room (the CPU tier full of held "
           "chunks) or a failed write", "tier", per_request=False),
)
_BY_KEY = {s.key: s for s in SERIES}


def cumulative(engine: Any, *, requests: bool) -> Figures:
    """The engine's figures since it started (`requests`: with those of requests and tokens)."""
    stats = engine.get_stats()
    tiers = engine.storage_manager.usage()
    lower = {name: t for name, t in tiers.items() if name != CPU_TIER}
    figures: Figures = {
        "load_bytes": {CPU_TIER: stats.retrieved_bytes, **{n: t.read_bytes for n, t in lower.items()}},
        "load_seconds": {CPU_TIER: stats.retrieve_time_s, **{n: t.read_seconds for n, t in lower.items()}},
        "store_bytes": {CPU_TIER: stats.stored_bytes, **{n: t.written_bytes for n, t in lower.items()}},
        "store_seconds": {CPU_TIER: stats.store_time_s, **{n: t.write_seconds for n, t in lower.items()}},
        "store_failures": {n: t.put_failures for n, t in tiers.items()},
    }
    if requests:
        figures.update(lookups=stats.lookup_requests, lookup_hits=stats.lookup_requests - stats.lookup_misses,
                       lookup_tokens=stats.lookup_tokens, hit_tokens=stats.lookup_hit_tokens,
                       miss_tokens=dict(stats.miss_tokens), loaded_tokens=stats.hit_tokens,
                       stored_tokens=stats.stored_tokens)
    return figures


def delta(now: Figures, before: Figures) -> Figures:
    """What grew from `before` to `now`, and only that (a figure that went back, a monitor reset,
    counts from zero)."""
    def grew(a: float, b: float) -> float:
        return a - b if a >= b else a

    out: Figures = {}
    for key, value in now.items():
        old = before.get(key)
        if isinstance(value, dict):
            old = old if isinstance(old, dict) else {}
            changed = {k: d for k, v in value.items() if (d := grew(v, old.get(k, 0)))}
            if changed:
                out[key] = changed
        elif d := grew(value, old or 0):
            out[key] = d
    return out


def add(into: Figures, other: Figures) -> Figures:
    """Sums `other` into `into` (in place), figure by figure and label by label."""
    for key, value in other.items():
        if isinstance(value, dict):
            mine = into.setdefault(key, {})
            for k, v in value.items():
                mine[k] = mine.get(k, 0) + v
        else:
            into[key] = into.get(key, 0) + value
    return into


def copy(figures: Figures) -> Figures:
    return {k: dict(v) if isinstance(v, dict) else v for k, v in figures.items()}


def summary(figures: Figures) -> dict[str, int | float]:
    """vLLM's log line ("KV Transfer metrics: k=v, ..."), numbers with their units in the key, as
    vLLM's own connectors write it: the lookups' hit rate first, then misses, tokens and traffic."""
    out: dict[str, int | float] = {}
    if "lookups" in figures or "lookup_tokens" in figures:
        asked, hit = figures.get("lookup_tokens", 0), figures.get("hit_tokens", 0)
        out.update({"Lookups": figures.get("lookups", 0), "Lookup hits": figures.get("lookup_hits", 0),
                    "Hit tokens": hit, "Lookup tokens": asked,
                    "Hit rate (%)": round(100 * hit / asked, 1) if asked else 0.0})
    for reason, n in sorted(figures.get("miss_tokens", {}).items()):
        out[f"Missed tokens ({reason})"] = n
    for key, label in (("loaded_tokens", "Loaded tokens"), ("stored_tokens", "Stored tokens")):
        if key in figures:
            out[label] = figures[key]
    for verb, noun in (("load", "Loaded"), ("store", "Stored")):
        seconds = figures.get(f"{verb}_seconds", {})
        for tier, nbytes in figures.get(f"{verb}_bytes", {}).items():
            out[f"{noun} {tier} (MiB)"] = round(nbytes / 2**20, 3)
            out[f"{noun} {tier} (s)"] = round(seconds.get(tier, 0.0), 4)
    for tier, n in figures.get("store_failures", {}).items():
        out[f"Store failures {tier}"] = n
    return out


class StatsTracker:
    """One worker's figures handed to vLLM: each call, what changed since the previous one."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._before: Figures = {}

    def take(self, engine: Any) -> Figures | None:
        now = cumulative(engine, requests=self.rank == 0)
        changed = delta(now, self._before)
        self._before = now
        return changed or None


class PromCounters:
    """The counters of SERIES in vLLM's registry, made with the counter class vLLM hands
    `build_prom_metrics` (prometheus_client's, or Ray's), labelled with vLLM's labels
    (model_name, engine) and the series' own (tier, reason)."""

    def __init__(self, counter_cls: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        self._labelvalues = per_engine_labelvalues
        self._counters = {s.key: counter_cls(name=s.name, documentation=s.doc,
                                             labelnames=[*labelnames, *([s.label] if s.label else [])])
                          for s in SERIES}
        self._bound: dict[tuple, Any] = {}

    def _child(self, engine_idx: int, key: str, label: str | None) -> Any:
        child = self._bound.get((engine_idx, key, label))
        if child is None:
            values = [*self._labelvalues[engine_idx], *([label] if label is not None else [])]
            child = self._bound[(engine_idx, key, label)] = self._counters[key].labels(*values)
        return child

    def observe(self, figures: Figures, engine_idx: int = 0) -> None:
        for key, value in figures.items():
            series = _BY_KEY.get(key)
            if series is None or isinstance(value, dict) != (series.label is not None):
                continue  # a figure this version does not count, or not in its shape
            for label, n in (value.items() if isinstance(value, dict) else ((None, value),)):
                if n > 0:  # a counter only grows
                    self._child(engine_idx, key, None if label is None else str(label)).inc(n)
