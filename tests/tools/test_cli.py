import json
import os
import subprocess
import sys

import pytest


def _cli(*args, env=None):
    env = dict(os.environ if env is None else env)
    env.pop("TRITON_INTERPRET", None)  # the child runs what a CPU host runs: the torch path
    return subprocess.run([sys.executable, "-m", "lmcache_triton.tools.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_info_prints_versions_and_resolved_config():
    env = dict(os.environ, LMCACHE_CHUNK_SIZE="512", LMCACHE_REMOTE_AUTH_TOKEN="s3cret")
    r = _cli("info", env=env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["torch"] and info["config"]["chunk_size"] == 512
    assert "s3cret" not in r.stdout, "secrets are redacted"


def test_demo_round_trips_exact_bytes():
    r = _cli("demo", "--engine-only", "--tokens", "700", "--layers", "2", "--heads", "2", "--head-size", "64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bytes identical: True" in r.stdout and "512 of 700 tokens hit" in r.stdout


def test_bad_config_is_a_clear_error():
    r = _cli("info", env=dict(os.environ, LMCACHE_CHUNK_SIZE="300"))
    assert r.returncode != 0 and "chunk_size" in r.stderr


def test_demo_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys, tmp_path):
    """--plot checks for matplotlib before vLLM starts (vLLM is never reached here)."""
    from lmcache_triton.tools import vllm_demo

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(vllm_demo, "build_random_llama", lambda *a, **k: pytest.fail("got past the check"))
    assert vllm_demo.run_vllm_demo(plot=str(tmp_path / "x.png")) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_demo_plot_draws_cold_vs_warm(tmp_path):
    pytest.importorskip("matplotlib")
    from lmcache_triton.tools.vllm_demo import TTFTResult, plot_ttft

    r = TTFTResult(tokens=4096, cold_s=0.786, warm_s=0.028, loaded_tokens=4095, outputs_match=True)
    png = plot_ttft(tmp_path / "d" / "ttft.png", r, "/models/demo-llama")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
