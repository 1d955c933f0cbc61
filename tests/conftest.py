"""Shared fixtures: free loopback ports, a cache server subprocess, a redis-server subprocess; and
the leak check: the run fails when the project's code leaves a thread or ZMQ socket open
(leak_check.py says how they are told from vLLM's, torch's and pytest's own).

The servers are real processes on 127.0.0.1, started per test and killed after it. The factories
(`start_cache_server`, `start_redis_server`) let a test kill and restart a server on the same port.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from leak_check import LeakTracker, report  # tests/ is on sys.path (no __init__.py)

REPO = Path(__file__).resolve().parents[1]
_START_TIMEOUT_S = 10.0
_leaks = LeakTracker()
_leak_report = pytest.StashKey[str]()


def pytest_configure(config):
    _leaks.install()  # historic: called for this conftest even when pytest loads it after the start
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        # Each xdist worker its own temp folder: the lookup and offload servers' IPC endpoints are
        # named by vLLM engine id and rank in it (integration/vllm/common.py: ipc_path), and the
        # glue's tests use a fixed engine id. Subprocesses inherit it through TMPDIR.
        os.environ["TMPDIR"] = tempfile.tempdir = tempfile.mkdtemp(prefix=f"lmct-{worker}-")


# The slowest files first (make test: --durations=40 shows them), so that make test's two workers,
# which take whole files in collection order (--dist loadfile --no-loadscope-reorder), end together:
# a nine-minute file handed out last is the run's tail.
_SLOWEST_FIRST = ("tests/e2e/test_vllm_e2e.py", "tests/e2e/test_faults_e2e.py", "tests/e2e/",
                  "tests/kernels/test_compile_sm90.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        return next((i for i, p in enumerate(_SLOWEST_FIRST) if path.startswith(p)), len(_SLOWEST_FIRST))

    items.sort(key=rank)  # stable: each file's tests stay together and in order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    """What the test opens (its fixtures' setup and teardown included) is reported under its name."""
    _leaks.current_test = item.nodeid
    yield
    _leaks.current_test = "(after the tests: a fixture's teardown)"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """The leak check's verdict: the run fails (exit status 1) when a thread or ZMQ socket the
    project opened is still open once every fixture is torn down. Here and not in a session
    fixture's teardown: that runs inside the last test's teardown, while pytest still holds that
    test's log records, whose tracebacks keep alive the objects (and threads) of the test's frames,
    so the verdict would depend on which test ran last."""
    leaks = _leaks.leaks()
    _leaks.uninstall()
    text = (report(leaks) if leaks else "") + session.config.stash.get(_leak_report, "")
    if text:
        session.config.stash[_leak_report] = text
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if hasattr(session.config, "workeroutput"):  # an xdist worker: its controller decides the run's status
            session.config.workeroutput["leaks"] = text
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(tempfile.gettempdir(), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller, as each worker ends: its leaks fail the run (a worker's exit status does not)."""
    text = getattr(node, "workeroutput", {}).get("leaks")
    if text:
        node.config.stash[_leak_report] = node.config.stash.get(_leak_report, "") + text


def pytest_terminal_summary(terminalreporter, config):
    if (text := config.stash.get(_leak_report, None)) is not None:
        terminalreporter.section("leaked threads and ZMQ sockets", sep="=", red=True, bold=True)
        terminalreporter.line(text, red=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def clean_lmcache_env(monkeypatch):
    """No LMCACHE_* variable of the calling shell leaks into a config test; warnings warn anew."""
    from lmcache_triton import lmcache_compat

    for var in list(os.environ):
        if var.startswith("LMCACHE_"):
            monkeypatch.delenv(var)
    monkeypatch.setattr(lmcache_compat, "_warned_env", set())


@pytest.fixture
def closing():
    """Closes every server, client and engine a test registers, in reverse order, even on failure."""
    things = []
    yield things
    for thing in reversed(things):
        thing.close()


@pytest.fixture(scope="session")  # a plain function: module-scoped fixtures use it too
def free_port() -> Callable[[], int]:
    """Call it for a loopback TCP port that nothing listens on (as of now)."""
    return _free_port


@dataclass
class ServerProcess:
    """A server subprocess on 127.0.0.1:port; `restart()` brings it back on the same port."""

    argv: list[str]
    port: int
    url: str
    wait_ready: Callable[[ServerProcess], None]
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)
    _log: Any = field(default=None, repr=False)

    def start(self) -> ServerProcess:
        # stderr to a file, not a pipe: a pipe nobody reads would block a chatty server
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL,
                                     stderr=self._log)
        self.wait_ready(self)
        return self

    def kill(self) -> None:
        """SIGKILL: what a crash looks like to clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> ServerProcess:
        self.kill()
        return self.start()

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def check_alive(self) -> None:
        assert self.proc is not None and self.proc.poll() is None, (
            f"server exited with {self.proc.returncode}: {self.log()}")


def _wait(server: ServerProcess, ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {server.proc.returncode} at start: "
                               f"{server.log()}")
        if ready():
            return
        time.sleep(0.05)
    server.kill()
    raise RuntimeError(f"{what} did not become ready on port {server.port} within {_START_TIMEOUT_S} s")


def _cache_server_ready(server: ServerProcess) -> None:
    from lmcache_triton.storage.remote import CacheServerClient

    client = CacheServerClient("127.0.0.1", server.port, timeout_s=0.5)
    try:
        _wait(server, lambda: client.health(0.2), "cache server")
    finally:
        client.close()


@pytest.fixture
def start_cache_server(free_port) -> Iterator[Callable[..., ServerProcess]]:
    """start_cache_server(*extra_args, port=None, env=None) -> a running ServerProcess (HEALTH answered)."""
    started: list[ServerProcess] = []

    def start(*extra: str, port: int | None = None, env: dict[str, str] | None = None) -> ServerProcess:
        port = port or free_port()
        argv = [sys.executable, "-m", "lmcache_triton.server.cache_server", "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "WARNING", *extra]
        # the developer's own token must not leak into tests that expect an open server
        full_env = {k: v for k, v in os.environ.items() if k != "LMCACHE_REMOTE_AUTH_TOKEN"}
        full_env.update(env or {})
        server = ServerProcess(argv, port, f"lm://127.0.0.1:{port}", _cache_server_ready, full_env)
        started.append(server)
        return server.start()

    yield start
    for s in started:
        s.kill()


@pytest.fixture
def cache_server(start_cache_server) -> ServerProcess:
    """A cache server with default options; `.url` is its lm:// url."""
    return start_cache_server()


def _redis_ready(server: ServerProcess) -> None:
    import redis

    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # redis-py's default retries with back-off take ~3.5 s per failed PING
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=0.5, socket_connect_timeout=0.5,
                         retry=Retry(NoBackoff(), 0))

    def ping() -> bool:
        try:
            return bool(client.ping())
        except redis.AuthenticationError:
            return True  # started with --requirepass: up, and refusing us as it should
        except redis.ResponseError as e:
            return "NOAUTH" in str(e)
        except redis.RedisError:
            return False

    try:
        _wait(server, ping, "redis-server")
    finally:
        client.close()


@pytest.fixture
def start_redis_server(free_port) -> Iterator[Callable[..., ServerProcess]]:
    """start_redis_server(*extra_args, port=None) -> a running redis-server without persistence."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed: apt-get install -y redis-server (or brew install redis) "
                    "to run the Redis backend tests")
    pytest.importorskip("redis", reason="the redis package is missing: pip install 'lmcache-triton[redis]'")
    started: list[ServerProcess] = []

    def start(*extra: str, port: int | None = None) -> ServerProcess:
        port = port or free_port()
        argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--protected-mode", "no", *extra]
        server = ServerProcess(argv, port, f"redis://127.0.0.1:{port}/0", _redis_ready)
        started.append(server)
        return server.start()

    yield start
    for s in started:
        s.kill()


@pytest.fixture
def redis_server(start_redis_server) -> ServerProcess:
    """A redis-server on a free loopback port; `.url` is its redis:// url."""
    return start_redis_server()


@pytest.fixture
def make_chunk():
    """make_chunk(pool, seed, tokens=16) -> a KV_2LTD bfloat16 MemoryObj [2, 4, tokens, 64] filled from `seed`,
    and its key; the same seed gives the same chunk in every process (tests of two "hosts")."""
    import torch

    from lmcache_triton.storage.memory import MemoryFormat
    from lmcache_triton.keys import CacheEngineKey

    def make(pool, seed: int, tokens: int = 16):
        obj = pool.allocate((2, 4, tokens, 64), torch.bfloat16, MemoryFormat.KV_2LTD)
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(seed)))
        key = CacheEngineKey("test/model", 1, 0, "bfloat16", "KV_2LTD", f"{seed:032x}")
        return obj, key

    return make


@pytest.fixture
def kv_metadata():
    """Engine metadata that the chunks of `make_chunk` fit: 4 layers, chunk_size 16, hidden 64, bfloat16."""
    import torch

    from lmcache_triton.metadata import LMCacheEngineMetadata

    return LMCacheEngineMetadata("test/model", 1, 0, torch.bfloat16, (4, 2, 16, 2, 32))


@pytest.fixture
def pool():
    """A 64 MiB unpinned TensorMemoryPool: the CPU tier that remote hits land in."""
    from lmcache_triton.storage.memory import TensorMemoryPool

    return TensorMemoryPool(64 << 20, pin_memory=False)


_OTHER_HOST = """
import sys, torch
from lmcache_triton.storage.memory import MemoryFormat, TensorMemoryPool
from lmcache_triton.storage.remote import create_remote_backend
from lmcache_triton.keys import CacheEngineKey
def chunk(pool, seed):
    obj = pool.allocate((2, 4, 16, 64), torch.bfloat16, MemoryFormat.KV_2LTD)
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=torch.Generator().manual_seed(seed)))
    return obj, CacheEngineKey("test/model", 1, 0, "bfloat16", "KV_2LTD", f"{seed:032x}")
pool = TensorMemoryPool(16 << 20, pin_memory=False)
b = create_remote_backend(sys.argv[1], None, compression="naive", timeout_s=5.0, auth_token=None)
theirs, theirs_key = chunk(pool, 10)
got = b.get(theirs_key, pool.allocate)
assert got is not None and torch.equal(got.tensor, theirs.tensor), "chunk from the first host missing or wrong"
mine, mine_key = chunk(pool, 11)
assert b.put(mine_key, mine)
print("ok")
"""


@pytest.fixture
def two_hosts(pool, make_chunk):
    """two_hosts(url, backend): this process puts chunk 10, a second process finds it and puts chunk 11,
    which this process then finds: the same remote seen from two "hosts"."""
    import torch

    def run(url: str, backend) -> None:
        obj, key = make_chunk(pool, seed=10)
        assert backend.put(key, obj)
        out = subprocess.run([sys.executable, "-c", _OTHER_HOST, url], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
        expected, key11 = make_chunk(pool, seed=11)
        got = backend.get(key11, pool.allocate)
        assert got is not None and torch.equal(got.tensor, expected.tensor)

    return run
