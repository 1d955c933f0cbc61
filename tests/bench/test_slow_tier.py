"""bench/slow_tier.py without vLLM: its flags, and the rows, table and plot it makes from its
children's results (fake ones here; the real run is the bench's, never the suite's)."""

from __future__ import annotations

import argparse

import pytest

from bench.cli import COMMANDS
from bench.slow_tier import LinkSetting, combine, connector_config, parse_args, parse_link, plot, print_table


def test_link_settings_parse():
    assert parse_link("20ms:4MiB") == LinkSetting(20.0, 4 << 20)
    assert parse_link("0.5ms:3MB") == LinkSetting(0.5, 3e6)
    assert parse_link("5ms:1024") == LinkSetting(5.0, 1024.0)
    assert parse_link("0ms:inf") == parse_link("loopback") == LinkSetting(0.0, None)
    assert parse_link("0ms:inf").label == "loopback" and parse_link("20ms:4MiB").label == "20 ms, 4 MiB/s"
    for bad in ("20:4MiB", "20ms", "20ms:4 MiB", "20ms:0", "fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_link(bad)


def test_defaults_quick_and_flags():
    a = parse_args([])
    assert [s.label for s in a.links] == ["loopback", "5 ms, 64 MiB/s", "20 ms, 4 MiB/s"]
    assert a.tokens == [1024, 2048, 4096, 8192] and a.repeats == 3 and a.policies == ["always", "cost"]
    q = parse_args(["--quick"])
    assert (q.links, q.tokens, q.repeats) == ([LinkSetting(20.0, 4 << 20)], [2048], 1)
    q = parse_args(["--quick", "--links", "5ms:64MiB", "--policies", "unset"])
    assert q.links == [LinkSetting(5.0, 64 << 20)] and q.policies == ["unset"]
    assert COMMANDS["slow-tier"].modules == ("bench.slow_tier",) and COMMANDS["slow-tier"].own_plot


def test_connector_config_is_remote_only_and_unset_leaves_the_policy_out():
    c = connector_config("cost", 4242, {"lmcache.load_deadline_ms": 500})
    assert c["lmcache.local_cpu"] is False and c["lmcache.remote_url"] == "lm://127.0.0.1:4242"
    assert c["lmcache.load_policy"] == "cost" and c["lmcache.load_deadline_ms"] == 500
    assert "lmcache.load_policy" not in connector_config("unset", 4242, {})


def _fake_runs(links: list[LinkSetting], tokens: list[int]) -> dict:
    def child(policy: str, ms: float) -> dict:
        return {"rows": [{"link": {"rtt_ms": s.rtt_ms, "bytes_per_s": s.bytes_per_s}, "tokens": n,
                          "cold_ms": 900.0, "saved_chunks": n // 256, "ttft_ms": [ms * (i + 1), ms, 3 * ms],
                          "cached_tokens": [n - 1, n - 1, n - 1], "mib": [1.0, 2.0, 3.0],
                          "output": [7] * 8 if policy == "always" else [8] * 8}
                         for i, s in enumerate(links) for n in tokens]}

    none = {"rows": [{"tokens": n, "ttft_ms": [1000.0, 1100.0, 900.0], "cached_tokens": [0] * 3, "mib": [0.0] * 3,
                      "output": [7] * 8} for n in tokens], "omp_threads_bind": "nobind"}
    return {"none": none, "always": child("always", 50.0), "cost": child("cost", 60.0)}


_LINKS, _TOKENS = [LinkSetting(0.0, None), LinkSetting(20.0, 4 << 20)], [1024, 2048]


def test_rows_and_table_from_fake_children(capsys):
    rows = combine(_fake_runs(_LINKS, _TOKENS), _LINKS, _TOKENS)
    assert [(r["link"], r["tokens"]) for r in rows] == [("loopback", 1024), ("loopback", 2048),
                                                        ("20 ms, 4 MiB/s", 1024), ("20 ms, 4 MiB/s", 2048)]
    r = rows[2]
    assert r["ttft_ms"] == {"none": 1000.0, "always": 100.0, "cost": 120.0}  # p50 over the repeats
    assert r["outputs_match"] == {"always": True, "cost": False}
    assert r["cached_tokens"] == {"always": 1023, "cost": 1023} and r["mib_per_request"]["cost"] == 2.0
    print_table(rows, ["always", "cost"])
    assert "20 ms, 4 MiB/s" in capsys.readouterr().out


def test_plot_from_fake_children(tmp_path):
    pytest.importorskip("matplotlib")
    rows = combine(_fake_runs(_LINKS, _TOKENS), _LINKS, _TOKENS)
    png = plot(tmp_path / "slow_tier.png", {"rows": rows, "policies": ["always", "cost"], "dtype": "float32",
                                            "device": "test"})
    assert png.stat().st_size > 0
