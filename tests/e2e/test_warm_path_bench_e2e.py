"""`lmcache-triton bench warm-path` on a real vLLM: a warm request's connector calls, timed in vLLM's process."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_warm_path_times_the_connectors_calls_of_requests_that_load():
    # the bench's own model (bench ttft's); the child runs what a CPU host runs (no Triton interpreter)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_") and k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "bench", "warm-path", "--tokens", "1000", "--requests", "2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # the whole chunks (3 x 256); the partial tail is not saved by default (save_unfull_chunk)
    assert re.search(r"1000 tokens \(float32, 768 loaded\), 2 warm requests", r.stdout), r.stdout
    path = Path(re.search(r"wrote (\S+\.json)", r.stdout).group(1))
    try:
        data = json.loads(path.read_text())
        calls = data["calls_ms_per_request"]
        assert data["loaded"] == 768 and data["copy_ms"] > 0 and data["warm_ms"] > 0
        assert calls["get_num_new_matched_tokens"] > 0 and calls["start_load_kv"] > 0, calls
        assert re.search(r"start_load_kv +\d+\.\d{3} ms per request", r.stdout)
    finally:
        path.unlink(missing_ok=True)
