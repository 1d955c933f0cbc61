"""bench/kv_proxy.py without vLLM: the workload's order, the table and the plot from given rows
(the bench itself runs two vLLM instances: `lmcache-triton bench kv-proxy --quick`)."""

from __future__ import annotations

import argparse

import pytest

from bench.cli import COMMANDS
from bench.kv_proxy import plot, print_table, workload


def test_every_document_is_asked_as_often_as_told_in_one_seeded_order():
    args = argparse.Namespace(docs=16, asks=3, seed=0)
    pairs = workload(args)
    assert sorted(pairs) == [(d, a) for d in range(16) for a in range(3)]
    assert pairs == workload(args) and pairs != workload(argparse.Namespace(docs=16, asks=3, seed=1))
    assert COMMANDS["kv-proxy"].modules == ("bench.kv_proxy",) and COMMANDS["kv-proxy"].own_plot


def _row(mode: str, hit: float, p50: float) -> dict:
    return dict(mode=mode, hit_rate=hit, ttft_p50_ms=p50, ttft_p99_ms=3 * p50, repeat_ttft_p50_ms=p50 / 2,
                repeat_ttft_p99_ms=2 * p50, requests_per_s=1.0, per_backend=[24, 24],
                decisions={"kv_routed": 0, "round_robin": 48})


def test_the_table_and_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [_row("round-robin", 0.41, 2400.0), _row("kv-aware", 0.64, 280.0)]
    print_table(rows, 0.66)
    assert "kv-aware" in capsys.readouterr().out
    result = {"rows": rows, "best_hit_rate": 0.66, "device": "cpu", "args": {"docs": 16, "doc_len": 2048, "asks": 3,
                                                                             "concurrency": 2, "dtype": "float32"}}
    assert plot(tmp_path / "p.png", result).stat().st_size > 0
