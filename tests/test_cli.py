import json
import os
import subprocess
import sys


def _cli(*args, env=None):
    env = dict(os.environ if env is None else env)
    env.pop("TRITON_INTERPRET", None)  # the child runs what a CPU host runs: the torch path
    return subprocess.run([sys.executable, "-m", "lmcache_triton.cli", *args], capture_output=True, text=True,
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
