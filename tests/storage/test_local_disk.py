import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lmcache_triton.storage.memory import MemoryFormat, MemoryObj, TensorMemoryPool
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage.base import StorageBackend
from lmcache_triton.storage.local_disk import LocalDiskBackend
from lmcache_triton.storage.serde import read_header
from lmcache_triton.keys import CacheEngineKey

REPO = Path(__file__).resolve().parents[2]
F = MemoryFormat.KV_2LTD
MODEL = "org/Llama-3@main ü"
META = LMCacheEngineMetadata(MODEL, 1, 0, torch.bfloat16, (2, 2, 16, 2, 8))
SHAPE = (2, 2, 16, 16)  # one full chunk of META: 2048 bytes of payload
CHUNK_FILE_BYTES = 2048 + 512  # payload + a header of a few hundred bytes, bounded generously


def _key(i: int, model: str = MODEL, dtype: str = "bfloat16") -> CacheEngineKey:
    return CacheEngineKey(model, 1, 0, dtype, "KV_2LTD", f"{i:032x}")


def _tensor(i: int, shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def _obj(i: int, shape: tuple[int, ...] = SHAPE) -> MemoryObj:
    return MemoryObj(_tensor(i, shape), F)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture
def pool() -> TensorMemoryPool:
    return TensorMemoryPool(1 << 20, pin_memory=False)


def _backend(path: Path, max_bytes: int = 1 << 20, **kw) -> LocalDiskBackend:
    return LocalDiskBackend(path, max_bytes, META, **kw)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("compression", ["naive", "lz4"])
def test_put_get_exact_bytes(tmp_path, pool, compression):
    b = _backend(tmp_path, compression=compression, fsync=True)
    assert isinstance(b, StorageBackend)
    assert b.put(_key(1), _obj(1))
    assert b.contains(_key(1)) and not b.contains(_key(2))
    assert b.batched_contains([_key(1), _key(2)]) == [True, False]
    got = b.get(_key(1), pool.allocate)
    assert got is not None and got.fmt is F and _same(got.tensor, _tensor(1))
    assert got._pool is pool  # read into the caller's allocation
    assert b.get(_key(2), pool.allocate) is None
    (path,) = _files(tmp_path)
    assert path.suffix == ".safetensors" and path.parent.name == path.name[:2]
    assert read_header(path.read_bytes()).compression == compression
    s = b.stats()
    assert (s.puts, s.hits, s.misses, s.corrupt, s.errors, s.chunks) == (1, 1, 1, 0, 0, 1)
    assert s.used_bytes == path.stat().st_size and s.capacity_bytes == 1 << 20
    assert b.remove(_key(1)) and not b.remove(_key(1)) and _files(tmp_path) == []
    assert b.stats().used_bytes == 0
    b.close()
    b.close()  # idempotent
    assert not b.contains(_key(1)) and not b.put(_key(3), _obj(3))


def test_persists_across_backends(tmp_path, pool):
    b = _backend(tmp_path)
    for i in range(3):
        assert b.put(_key(i), _obj(i))
    b.close()
    b2 = _backend(tmp_path)
    assert set(b2.keys()) == {_key(i) for i in range(3)}
    assert b2.stats().used_bytes == sum(p.stat().st_size for p in _files(tmp_path))
    for i in range(3):
        got = b2.get(_key(i), pool.allocate)
        assert got is not None and _same(got.tensor, _tensor(i))


@pytest.mark.slow
def test_persists_across_processes(tmp_path, pool):
    script = f"""
import torch
from lmcache_triton.storage.memory import MemoryObj, MemoryFormat
from lmcache_triton.metadata import LMCacheEngineMetadata
from lmcache_triton.storage.local_disk import LocalDiskBackend
from lmcache_triton.keys import CacheEngineKey
meta = LMCacheEngineMetadata({MODEL!r}, 1, 0, torch.bfloat16, {(2, 2, 16, 2, 8)!r})
g = torch.Generator().manual_seed(7)
t = torch.randint(0, 256, ({2 * 2 * 16 * 16 * 2},), dtype=torch.uint8, generator=g).view(torch.bfloat16).view({SHAPE!r})
b = LocalDiskBackend({str(tmp_path)!r}, 1 << 20, meta, compression="lz4")
assert b.put(CacheEngineKey({MODEL!r}, 1, 0, "bfloat16", "KV_2LTD", {f"{7:032x}"!r}), MemoryObj(t, MemoryFormat.KV_2LTD))
b.close()
"""
    # Another hash seed than ours: keys and file names must not depend on Python's hash().
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "123"}
    env.pop("TRITON_INTERPRET", None)  # the child runs what a CPU host runs
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=REPO, timeout=120)
    b = _backend(tmp_path)
    got = b.get(_key(7), pool.allocate)
    assert got is not None and _same(got.tensor, _tensor(7))


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "append"])
def test_corrupt_file_is_a_counted_miss_and_deleted(tmp_path, pool, damage):
    b = _backend(tmp_path)
    b.put(_key(1), _obj(1))
    (path,) = _files(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[len(data) // 2 + 600] ^= 0x04
    elif damage == "flip_header":
        data[40] ^= 0x01
    elif damage == "truncate":
        data = data[:-100]
    else:
        data += b"\0" * 8
    path.write_bytes(bytes(data))
    used = pool.used_bytes
    assert b.get(_key(1), pool.allocate) is None
    assert pool.used_bytes == used, "an allocation for a corrupt chunk must be freed"
    s = b.stats()
    assert (s.corrupt, s.misses, s.hits, s.used_bytes) == (1, 1, 0, 0)
    assert not path.exists() and not b.contains(_key(1))


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate"])
def test_corrupt_file_found_at_start(tmp_path, pool, damage):
    b = _backend(tmp_path)
    b.put(_key(1), _obj(1))
    b.put(_key(2), _obj(2))
    b.close()
    path = b.path_for(_key(1))
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[-7] ^= 0x80  # only the checksum on get can catch this one
    elif damage == "flip_header":
        data[30] ^= 0x10
    else:
        data = data[:len(data) // 2]
    path.write_bytes(bytes(data))
    b2 = _backend(tmp_path)
    if damage == "flip_payload":
        assert b2.contains(_key(1))  # the scan reads headers only
    else:
        assert not b2.contains(_key(1)) and not path.exists() and b2.stats().corrupt == 1
    assert b2.get(_key(1), pool.allocate) is None
    assert b2.stats().corrupt == 1 and not path.exists()
    got = b2.get(_key(2), pool.allocate)
    assert got is not None and _same(got.tensor, _tensor(2))


def test_other_models_files_are_never_served_nor_deleted(tmp_path, pool):
    other_meta = LMCacheEngineMetadata("other-model", 1, 0, torch.bfloat16, (2, 2, 16, 2, 8))
    other = LocalDiskBackend(tmp_path, 1 << 20, other_meta)
    assert other.put(_key(1, model="other-model"), _obj(1))
    other_fp16 = LocalDiskBackend(tmp_path, 1 << 20, LMCacheEngineMetadata(MODEL, 1, 0, torch.float16, (2, 2, 16, 2, 8)))
    assert other_fp16.put(_key(2, dtype="float16"), MemoryObj(_tensor(2, dtype=torch.float16), F))
    other.close()
    other_fp16.close()
    before = _files(tmp_path)

    b = _backend(tmp_path)
    assert b.keys() == [] and b.found_at_start.foreign == 2 and b.stats().used_bytes == 0
    assert _files(tmp_path) == before

    # a file of another model planted under the name of one of our keys: a miss, never its bytes
    mine = b.path_for(_key(3))
    mine.parent.mkdir(exist_ok=True)
    mine.write_bytes(before[0].read_bytes())
    b.close()
    b2 = _backend(tmp_path)
    assert not b2.contains(_key(3)) and b2.get(_key(3), pool.allocate) is None
    # and if the planted file appears after the scan, the key check on get catches it
    b2.put(_key(4), _obj(4))
    b2.path_for(_key(4)).write_bytes(before[0].read_bytes())
    assert b2.get(_key(4), pool.allocate) is None and b2.stats().corrupt == 1
    assert pool.used_bytes == 0


def test_lru_by_bytes_never_exceeds_capacity(tmp_path, pool):
    probe = _backend(tmp_path / "probe")
    probe.put(_key(0), _obj(0))
    size = probe.stats().used_bytes
    cap = 3 * size + size // 2  # room for three chunks
    b = _backend(tmp_path / "lru", max_bytes=cap)
    for i in range(3):
        assert b.put(_key(i), _obj(i))
    assert b.get(_key(0), pool.allocate) is not None  # 0 becomes the most recent; 1 is now the LRU
    assert b.put(_key(3), _obj(3))
    assert set(b.keys()) == {_key(0), _key(2), _key(3)} and b.stats().evictions == 1
    assert b.put(_key(2), _obj(2))  # a put of a stored key touches it too
    assert b.put(_key(4), _obj(4))
    assert set(b.keys()) == {_key(2), _key(3), _key(4)}
    for i in range(5, 20):
        assert b.put(_key(i), _obj(i))
        assert b.stats().used_bytes <= cap
        assert sum(p.stat().st_size for p in _files(tmp_path / "lru")) <= cap
    assert b.stats().evictions == 17


def test_chunk_larger_than_capacity_is_refused(tmp_path):
    b = _backend(tmp_path, max_bytes=1000)
    assert not b.put(_key(1), _obj(1))
    s = b.stats()
    assert (s.puts, s.put_failures, s.used_bytes, s.evictions) == (1, 1, 0, 0)
    assert _files(tmp_path) == []


def test_lru_order_survives_restart_via_mtime(tmp_path, pool):
    b = _backend(tmp_path)
    for i in range(3):
        b.put(_key(i), _obj(i))
    now = time.time()
    for age, i in ((300, 1), (200, 2), (100, 0)):
        os.utime(b.path_for(_key(i)), (now - age, now - age))
    b.close()
    size = os.path.getsize(b.path_for(_key(0)))
    b2 = _backend(tmp_path, max_bytes=2 * size + 10)  # smaller than before: evicts the oldest
    assert b2.keys() == [_key(2), _key(0)] and b2.stats().evictions == 1
    assert not b.path_for(_key(1)).exists()


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped) on this host."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(proc.pid, 0)
    return proc.pid


# This host as the writer names it in temp files: `.tmp-<stem>-<host>-<pid>-<12 hex>`.
HOST = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "unknown"


def _tmp_name(stem: str, host: str, pid: int, rand: str = "0123456789ab") -> str:
    return f".tmp-{stem}-{host}-{pid}-{rand}"


def test_leftover_temp_files_are_cleaned_at_start(tmp_path):
    b = _backend(tmp_path)
    b.put(_key(1), _obj(1))
    b.close()
    path = b.path_for(_key(1))
    crashed = path.parent / _tmp_name(path.stem, HOST, _dead_pid())
    crashed.write_bytes(b"half a chunk")
    unrelated = tmp_path / "notes.txt"  # not in a shard directory: not ours, left alone
    unrelated.write_text("keep me")
    b2 = _backend(tmp_path)
    assert b2.found_at_start.temp_cleaned == 1 and b2.keys() == [_key(1)]
    assert not crashed.exists() and unrelated.exists()


def test_temp_file_names_carry_host_and_pid(tmp_path, monkeypatch):
    b = _backend(tmp_path)
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append(Path(src).name)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    assert b.put(_key(1), _obj(1))
    (name,) = seen
    stem = b.path_for(_key(1)).stem
    assert re.fullmatch(rf"\.tmp-{stem}-{re.escape(HOST)}-{os.getpid()}-[0-9a-f]{{12}}", name), name


def test_start_keeps_other_writers_temp_files(tmp_path):
    """Engines sharing a directory: a start deletes only temp files of dead writers on this host and
    stale ones, never another engine's write in flight."""
    b = _backend(tmp_path)
    b.put(_key(1), _obj(1))
    b.close()
    path = b.path_for(_key(1))
    shard, stem, host = path.parent, path.stem, HOST
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        dead = _dead_pid()
        keep = {
            "mine": shard / _tmp_name(stem, host, os.getpid(), "aaaaaaaaaaaa"),       # live pid, this host
            "live": shard / _tmp_name(stem, host, live.pid, "bbbbbbbbbbbb"),          # another live process
            "other_host": shard / _tmp_name(stem, "other-host.example", dead, "cccccccccccc"),  # recent
            "legacy": shard / f".tmp-{stem}-dddddddddddd",                            # no host/pid, recent
        }
        old = time.time() - 30 * 24 * 3600  # far beyond the staleness bound (10 minutes)
        remove = {
            "dead": shard / _tmp_name(stem, host, dead, "eeeeeeeeeeee"),
            "old": shard / _tmp_name(stem, "other-host.example", 4242, "ffffffffffff"),
            "old_legacy": shard / ".tmp-deadbeef-123",
        }
        for p in (*keep.values(), *remove.values()):
            p.write_bytes(b"part of a chunk")
        for name in ("old", "old_legacy"):
            os.utime(remove[name], (old, old))
        b2 = _backend(tmp_path)
        assert live.poll() is None, "the live writer must still run during the scan"
    finally:
        live.kill()
        live.wait()
    assert {n for n, p in keep.items() if not p.exists()} == set(), "another writer's temp file was deleted"
    assert {n for n, p in remove.items() if p.exists()} == set(), "an abandoned temp file was kept"
    assert b2.found_at_start.temp_cleaned == len(remove) and b2.keys() == [_key(1)]


def test_write_failure_is_a_counted_false(tmp_path, monkeypatch):
    b = _backend(tmp_path)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    assert not b.put(_key(1), _obj(1))
    assert not b.put(_key(2), _obj(2))
    monkeypatch.undo()
    s = b.stats()
    assert (s.put_failures, s.errors, s.used_bytes, s.held_chunks) == (2, 2, 0, 0)
    assert _files(tmp_path) == [], "the temp file of a failed write must not stay"
    assert b.put(_key(1), _obj(1))


def test_failed_allocation_is_a_miss(tmp_path):
    b = _backend(tmp_path)
    b.put(_key(1), _obj(1))
    assert b.get(_key(1), lambda shape, dtype, fmt: None) is None
    s = b.stats()
    assert (s.misses, s.errors, s.corrupt) == (1, 0, 0) and b.contains(_key(1))


def test_concurrent_puts_and_gets(tmp_path):
    pool = TensorMemoryPool(8 << 20, pin_memory=False)
    size = CHUNK_FILE_BYTES
    cap = 12 * size
    b = _backend(tmp_path, max_bytes=cap)
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        try:
            for j in range(25):
                i = (tid * 7 + j) % 40
                b.put(_key(i), _obj(i))
                got = b.get(_key((i + 3) % 40), pool.allocate)
                if got is not None:
                    assert _same(got.tensor, _tensor((i + 3) % 40))
                    got.free()
                assert b.stats().used_bytes <= cap  # writes in flight count as they start
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    s = b.stats()
    assert s.corrupt == 0 and s.held_chunks == 0 and s.used_bytes <= cap
    files = _files(tmp_path)
    assert all(not p.name.startswith(".tmp-") for p in files)
    assert sum(p.stat().st_size for p in files) == s.used_bytes and len(files) == len(b.keys()) == s.chunks
    assert pool.used_bytes == 0
    b.close()
    b2 = _backend(tmp_path, max_bytes=cap)
    assert set(b2.keys()) == set(b.keys())


def test_a_write_in_flight_is_counted_and_never_evicted(tmp_path, pool, monkeypatch):
    """A write holds its room from its start: other puts evict stored files around it, and one that
    could only fit by evicting it is refused, evicting nothing."""
    probe = _backend(tmp_path / "probe")
    probe.put(_key(0), _obj(0))
    size = probe.stats().used_bytes
    b = _backend(tmp_path / "b", max_bytes=2 * size + size // 2)  # two chunks fit
    assert b.put(_key(1), _obj(1))
    started, release = threading.Event(), threading.Event()
    real_replace = os.replace

    def slow_replace(src, dst):
        if Path(dst) == b.path_for(_key(2)):
            started.set()
            assert release.wait(10)
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", slow_replace)
    writer = threading.Thread(target=lambda: b.put(_key(2), _obj(2)))
    writer.start()
    assert started.wait(10)
    s = b.stats()
    assert (s.chunks, s.held_chunks, s.used_bytes) == (1, 1, 2 * size) and not b.contains(_key(2))
    assert b.get(_key(2), pool.allocate) is None and not b.remove(_key(2))
    big = MemoryObj(_tensor(7, (2, 2, 16, 32)), F)  # ~1.9 chunks: fits only if the write in flight went
    assert not b.put(_key(7), big)
    assert b.keys() == [_key(1)] and (b.stats().evictions, b.stats().put_failures) == (0, 1)
    assert b.put(_key(3), _obj(3))  # evicts 1, the stored one, never 2
    assert b.keys() == [_key(3)] and b.stats().evictions == 1
    release.set()
    writer.join(10)
    assert b.keys() == [_key(3), _key(2)] and b.stats().held_chunks == 0
    got = b.get(_key(2), pool.allocate)
    assert got is not None and _same(got.tensor, _tensor(2))
