"""Trust under faults, at the engine: lookup holds never leak, the step never waits on a remote,
no race frees memory still in use, a stored chunk that lies is caught, misses say why, and a
cache salt never shows. Real tiers (CPU pool, disk folder, a hung ZMQ peer on loopback)."""

from __future__ import annotations

import random
import sys
import threading
import time
import uuid

import pytest
import torch
import zmq

from lmcache_triton import LMCacheEngineConfig, LMCacheEngineMetadata, create_gpu_connector
from lmcache_triton.engine.engine import LMCacheEngine
from lmcache_triton.integration.vllm.lookup.client import LookupClient
from lmcache_triton.integration.vllm.lookup.server import LMCacheLookupServer
from lmcache_triton.storage.memory import MemoryFormat, MemoryObj, TensorMemoryPool
from lmcache_triton.storage.manager import StorageManager
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping

CHUNK = 16
LAYERS, HEADS, HEAD = 2, 2, 16
BLOCK, BLOCKS = 16, 32
CHUNK_BYTES = 2 * LAYERS * CHUNK * HEADS * HEAD * 2  # bf16: 8 KiB


class HungPeer:
    """A loopback TCP peer that completes the ZMQ handshake, reads every request and never answers:
    a cache server stuck in a GC pause, a deadlock, a full disk."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.received = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                self._sock.recv_multipart()
                self.received += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)
        self._ctx.term()


@pytest.fixture
def hung(closing) -> HungPeer:
    peer = HungPeer()
    closing.append(peer)
    return peer


def _engine(closing, *, max_chunks: float = 64, layout: str = "vllm_cpu", layerwise: bool = False,
            **config) -> LMCacheEngine:
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=max_chunks * (CHUNK_BYTES + 512) / 2**30,
                                               use_layerwise=layerwise, **config)
    metadata = LMCacheEngineMetadata(model_name="test/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD))
    engine = LMCacheEngine(config, metadata, create_gpu_connector(config, metadata, layout))
    closing.append(engine)
    return engine


def _caches(seed: int = 0, layout: str = "vllm_cpu"):
    return make_kv_caches(layout, num_layers=LAYERS, num_blocks=BLOCKS, block_size=BLOCK, num_kv_heads=HEADS,
                          head_size=HEAD, generator=torch.Generator().manual_seed(seed))


def _slots(n: int, seed: int = 1) -> torch.Tensor:
    return random_slot_mapping(n, num_blocks=BLOCKS, block_size=BLOCK, generator=torch.Generator().manual_seed(seed))


def _prompt(n_chunks: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 30000, (n_chunks * CHUNK,), generator=torch.Generator().manual_seed(seed))


# ---- 1. lookup holds ---------------------------------------------------------------------------
def test_release_before_a_slow_lookup_finishes_leaks_no_pin(closing, hung):
    """The scheduler's lookup times out while the worker waits on a hung remote; the step's
    release arrives before the lookup has finished holding. Every hold must still go."""
    engine = _engine(closing, remote_url=f"lm://127.0.0.1:{hung.port}", blocking_timeout_secs=1.5)
    prompt = _prompt(3, seed=1)
    caches, slots = _caches(), _slots(len(prompt))
    engine.store(prompt[:CHUNK], kvcaches=caches, slot_mapping=slots[:CHUNK])  # chunk 0 in CPU, the rest nowhere
    time.sleep(0.3)  # past any back-off: the lookup below does ask the remote
    eid = f"trust-{uuid.uuid4().hex[:8]}"
    closing.append(LMCacheLookupServer(engine, eid, 0))
    client = LookupClient(eid, 1, timeout_ms=200)
    closing.append(client)
    t0 = time.monotonic()
    assert client.lookup(prompt.tolist(), "req-1") == 0, "a timed-out lookup is a miss"
    assert time.monotonic() - t0 < 1.0
    engine.release_reservation("req-1")  # what wait_for_save does at the end of that step
    deadline = time.monotonic() + 5
    while engine.stats_monitor.get_stats().lookup_requests < 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # the worker's lookup finishes once the remote call times out
    time.sleep(0.1)
    assert engine.storage_manager.cpu.num_held == 0, "holds taken by a lookup released before it ended"
    assert engine.reservations.num_held == 0


def test_lease_bounds_a_pin_nobody_releases(closing):
    engine = _engine(closing, max_chunks=2, reservation_lease_secs=0.3)
    caches = _caches()
    a, b, c = _prompt(1, 1), _prompt(1, 2), _prompt(1, 3)
    for p in (a, b):
        engine.store(p, kvcaches=caches, slot_mapping=_slots(CHUNK))
    assert engine.lookup(a, reserve=True, lookup_id="aborted-1") == CHUNK
    assert engine.lookup(b, reserve=True, lookup_id="aborted-2") == CHUNK
    assert engine.store(c, kvcaches=caches, slot_mapping=_slots(CHUNK)) == 0, "a tier full of holds refuses"
    time.sleep(0.35)
    assert engine.store(c, kvcaches=caches, slot_mapping=_slots(CHUNK)) == CHUNK, "expired leases free the tier"
    assert engine.reservations.expired_leases == 2 and engine.storage_manager.cpu.num_held == 0


def test_release_before_the_lookup_begins_pins_nothing(closing):
    engine = _engine(closing)
    prompt = _prompt(2, 1)
    engine.store(prompt, kvcaches=_caches(), slot_mapping=_slots(len(prompt)))
    engine.release_reservation("late")  # the step ended before the lookup server even read the request
    assert engine.lookup(prompt, reserve=True, lookup_id="late") == len(prompt)
    assert engine.storage_manager.cpu.num_held == 0
    assert engine.lookup(prompt, reserve=True, lookup_id="late") == len(prompt), "the tombstone is used once"
    assert engine.storage_manager.cpu.num_held == 2
    engine.release_reservation("late")
    assert engine.storage_manager.cpu.num_held == 0


def test_hundred_timed_out_lookups_leave_the_tier_storing(closing, hung):
    engine = _engine(closing, max_chunks=8, remote_url=f"lm://127.0.0.1:{hung.port}", blocking_timeout_secs=5,
                     reservation_lease_secs=60)
    caches = _caches()
    cached = _prompt(1, 99)
    engine.store(cached, kvcaches=caches, slot_mapping=_slots(CHUNK))
    eid = f"trust-{uuid.uuid4().hex[:8]}"
    closing.append(LMCacheLookupServer(engine, eid, 0))
    client = LookupClient(eid, 1, timeout_ms=20)
    closing.append(client)
    for i in range(100):
        # each prompt starts with the cached chunk (held), then asks the hung remote for more
        prompt = torch.cat([cached, _prompt(2, 1000 + i)])
        # 0: the lookup timed out on the hung remote; CHUNK: the remote, marked slow by its missed
        # deadlines, is skipped and the cached part alone answers (which of them depends on the load)
        assert client.lookup(prompt.tolist(), f"r{i}") in (0, CHUNK)
        engine.release_reservation(f"r{i}")
    t0 = time.monotonic()
    for i in range(8):
        assert engine.store(_prompt(1, 5000 + i), kvcaches=caches, slot_mapping=_slots(CHUNK)) == CHUNK
    assert time.monotonic() - t0 < 3.0, "stores never wait on the hung remote (its timeout is 5 s)"


# ---- 2. the step never waits on the network ---------------------------------------------------
@pytest.mark.parametrize("layerwise", [pytest.param(False, id="all-layers"), pytest.param(True, id="layerwise")])
def test_store_does_not_ask_a_hung_remote(closing, hung, layerwise):
    engine = _engine(closing, remote_url=f"lm://127.0.0.1:{hung.port}", blocking_timeout_secs=5, layerwise=layerwise)
    caches = _caches()
    for i in range(4):
        prompt = _prompt(3, 10 + i)
        t0 = time.monotonic()
        assert engine.store(prompt, kvcaches=caches, slot_mapping=_slots(len(prompt))) == len(prompt)
        assert time.monotonic() - t0 < 2.0, f"store {i} waited on the remote (its timeout is 5 s)"
        t0 = time.monotonic()
        engine.store(prompt, kvcaches=caches, slot_mapping=_slots(len(prompt)))  # all present: nothing to do
        assert time.monotonic() - t0 < 2.0


# ---- 8. races ---------------------------------------------------------------------------------
def test_memory_obj_free_is_atomic():
    """Two last releases racing must return the range once. The interleaving is forced: thread A
    is held right after it decided the object is still allocated, while thread B frees it."""
    pool = TensorMemoryPool(1 << 20, pin_memory=False)
    obj = pool.allocate((1024,), torch.uint8, MemoryFormat.KV_2LTD)
    a_paused, b_done = threading.Event(), threading.Event()

    def hold_a_inside_free(frame, event, arg):
        if frame.f_code.co_name == "free" and event == "line":
            import linecache

            if "self._pool = self._pool, None" in linecache.getline(frame.f_code.co_filename, frame.f_lineno):
                a_paused.set()
                b_done.wait(0.5)  # with a lock there, B blocks until A is done; without, B frees now
        return hold_a_inside_free

    errors = []

    def a() -> None:
        sys.settrace(hold_a_inside_free)
        try:
            obj.free()
        except Exception as e:  # noqa: BLE001 - a crash in a releasing thread is the failure
            errors.append(repr(e))
        finally:
            sys.settrace(None)

    def b() -> None:
        a_paused.wait(2)
        try:
            obj.free()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))
        b_done.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert not errors, errors
    assert pool.used_bytes == 0 and pool.free_bytes == pool.capacity
    whole = pool.allocate((pool.capacity,), torch.uint8, MemoryFormat.KV_2LTD)
    assert whole is not None, "the free range is no longer one piece"
    assert pool.allocate((1,), torch.uint8, MemoryFormat.KV_2LTD) is None, "the range went back to the pool twice"


def test_write_through_object_cannot_be_evicted_between_insert_and_hold(tmp_path):
    """Another thread's eviction right after `put` inserted the chunk into the CPU tier must not
    free the memory the disk writer is about to read."""
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=3 * 8704 / 2**30,
                                               local_disk=str(tmp_path), max_local_disk_size=0.01)
    metadata = LMCacheEngineMetadata(model_name="test/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD))
    m = StorageManager(config, metadata, pin_memory=False)
    try:
        original_put = m.cpu.put
        intruders = []

        def put_then_evict(key, obj, *a, **kw):
            ok = original_put(key, obj, *a, **kw)
            # another thread fills the tier now: evicts whatever is not held, reuses its memory
            while (o := m.cpu.allocate((2, LAYERS, CHUNK, HEADS * HEAD), torch.bfloat16,
                                       MemoryFormat.KV_2LTD)) is not None:
                o.tensor.fill_(-1)
                intruders.append(o)
            return ok

        m.cpu.put = put_then_evict
        from lmcache_triton.engine.token_database import ChunkedTokenDatabase

        db = ChunkedTokenDatabase(CHUNK, metadata)
        (_, _, key), = db.process_tokens(_prompt(1, 3))
        obj = m.allocate((2, LAYERS, CHUNK, HEADS * HEAD), torch.bfloat16, MemoryFormat.KV_2LTD)
        obj.tensor.copy_(torch.arange(obj.tensor.numel()).view(obj.tensor.shape).to(torch.bfloat16))
        expected = obj.tensor.clone()
        m.put(key, obj)
        m.flush(10)
        for o in intruders:
            o.free()
        m.cpu.put = original_put
        m.cpu.remove(key)
        back = m.get(key)  # from the disk, as the writer wrote it
        assert back is not None and torch.equal(back.tensor, expected), "the writer read freed memory"
        m.release(key, back)
    finally:
        m.close()


def test_threaded_stress_zero_wrong_bytes(tmp_path):
    """Store, reserving lookup, retrieve, eviction and write-through to disk from several threads for
    a bounded time: every chunk read back holds exactly the bytes stored under its key."""
    config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, max_local_cpu_size=12 * 8704 / 2**30,
                                               local_disk=str(tmp_path), max_local_disk_size=0.0005)
    metadata = LMCacheEngineMetadata(model_name="test/model", world_size=1, worker_id=0, kv_dtype=torch.bfloat16,
                                     kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD))
    from lmcache_triton.engine.token_database import ChunkedTokenDatabase

    m = StorageManager(config, metadata, pin_memory=False)
    db = ChunkedTokenDatabase(CHUNK, metadata)
    keys = [next(iter(db.process_tokens(_prompt(1, s))))[2] for s in range(40)]
    shape = (2, LAYERS, CHUNK, HEADS * HEAD)

    def content(i: int) -> torch.Tensor:
        return torch.full(shape, float(i + 1), dtype=torch.bfloat16)

    wrong, reads, errors = [], [0], []
    stop = time.monotonic() + 3.0

    def writer(seed: int) -> None:
        rnd = random.Random(seed)
        while time.monotonic() < stop:
            i = rnd.randrange(len(keys))
            obj = m.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            if obj is None:
                continue
            obj.tensor.copy_(content(i))
            m.put(keys[i], obj)

    def reader(seed: int) -> None:
        rnd = random.Random(seed)
        while time.monotonic() < stop:
            i = rnd.randrange(len(keys))
            if rnd.random() < 0.5:
                held: list = []
                m.contains([keys[i]], io=True, prefix=True, hold_into=held)
                got = held
            else:
                obj = m.get(keys[i])
                got = [] if obj is None else [(keys[i], obj)]
            for k, obj in got:
                if not torch.equal(obj.tensor, content(keys.index(k))):
                    wrong.append(k)
                reads[0] += 1
                m.release(k, obj)

    def guarded(fn, seed):
        try:
            fn(seed)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=guarded, args=(fn, s)) for s, fn in enumerate([writer, writer, reader, reader])]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        m.flush(10)
        assert not errors, errors
        assert reads[0] > 50 and not wrong, f"{len(wrong)} wrong chunks in {reads[0]} reads"
        assert m.cpu.num_held == 0
        probe = m.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
        nbytes, used = probe.nbytes, m.cpu.used_bytes - probe.nbytes
        probe.free()
        assert used == len(m.cpu) * nbytes, "the pool's books match what the tier holds"
    finally:
        m.close()


# ---- verified hits ----------------------------------------------------------------------------
@pytest.mark.parametrize("layerwise", [pytest.param(False, id="all-layers"), pytest.param(True, id="layerwise")])
def test_verify_removes_a_chunk_that_differs_from_the_computed_kv(closing, layerwise):
    engine = _engine(closing, layerwise=layerwise)
    prompt = _prompt(2, 7)
    slots = _slots(len(prompt))
    caches = _caches(seed=3)
    engine.store(prompt, kvcaches=caches, slot_mapping=slots)
    assert engine.verify(prompt, kvcaches=caches, slot_mapping=slots) == (2, 0), "same KV: no mismatch"
    # the model now computes other KV for chunk 1's tokens (a stale or foreign chunk was stored)
    lying = [c.clone() for c in caches]
    for c in lying:
        c.view(-1)[:] = c.view(-1).flip(0)
    assert engine.verify(prompt, kvcaches=lying, slot_mapping=slots) == (2, 2)
    assert engine.lookup(prompt) == 0, "mismatching chunks are gone from every tier"
    assert engine.get_stats().verify_mismatches == 2
    assert engine.storage_manager.cpu.num_held == 0


# ---- why a miss -------------------------------------------------------------------------------
def test_misses_are_counted_by_reason(closing, tmp_path):
    engine = _engine(closing, max_chunks=2, local_disk=str(tmp_path), max_local_disk_size=0.01)
    caches = _caches()
    never = _prompt(2, 1)
    engine.lookup(torch.cat([never, never[:5]]))
    misses = engine.get_stats().miss_tokens
    assert misses == {"never_stored": 2 * CHUNK, "partial_chunk": 5}
    # evicted: three chunks through a two-chunk tier; disk off for this one
    small = _engine(closing, max_chunks=2)
    evicted = _prompt(1, 2)
    small.store(evicted, kvcaches=caches, slot_mapping=_slots(CHUNK))
    for s in (3, 4):
        small.store(_prompt(1, s), kvcaches=caches, slot_mapping=_slots(CHUNK))
    small.lookup(evicted)
    assert small.get_stats().miss_tokens == {"evicted": CHUNK}
    # refused: a tier full of held chunks
    small.lookup(_prompt(1, 3), reserve=True, lookup_id="x")
    small.lookup(_prompt(1, 4), reserve=True, lookup_id="y")
    refused = _prompt(1, 5)
    assert small.store(refused, kvcaches=caches, slot_mapping=_slots(CHUNK)) == 0
    small.lookup(refused)
    assert small.get_stats().miss_tokens["pinned_tier_refusal"] == CHUNK
    # corrupt: a disk chunk that fails its checksum
    stored = _prompt(1, 6)
    engine.store(stored, kvcaches=caches, slot_mapping=_slots(CHUNK))
    engine.storage_manager.flush(10)
    engine.storage_manager.cpu.clear()
    for f in tmp_path.rglob("*.safetensors"):
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    # the lookup server's reserving lookup reads (and checks) what it promotes
    assert engine.lookup(stored, reserve=True, lookup_id="c") == 0
    engine.release_reservation("c")
    assert engine.get_stats().miss_tokens["checksum_or_format"] == CHUNK


def test_unreachable_remote_is_its_own_miss_reason(closing, hung):
    engine = _engine(closing, remote_url=f"lm://127.0.0.1:{hung.port}", blocking_timeout_secs=0.3)
    engine.lookup(_prompt(1, 1))
    assert engine.get_stats().miss_tokens == {"remote_error": CHUNK}


# ---- the salt is a secret -------------------------------------------------------------------
def test_cache_salt_never_appears_in_keys_files_logs_or_metrics(closing, tmp_path, cache_server, caplog):
    from prometheus_client import generate_latest

    from lmcache_triton.storage.remote import CacheServerClient

    salt = "tenant-secret-Zq81"
    port = int(cache_server.url.rsplit(":", 1)[1])
    engine = _engine(closing, local_disk=str(tmp_path), max_local_disk_size=0.01, remote_url=cache_server.url,
                     prometheus_port=None)
    caches = _caches()
    prompt = _prompt(2, 1)
    with caplog.at_level("DEBUG", logger="lmcache_triton"):
        engine.store(prompt, kvcaches=caches, slot_mapping=_slots(len(prompt)), namespace=salt)
        engine.storage_manager.flush(10)
        assert engine.lookup(prompt, namespace=salt) == len(prompt)
        assert engine.lookup(prompt, namespace="other") == 0
        for f in tmp_path.rglob("*"):  # corrupt them: the warnings name files and keys
            if f.is_file():
                f.write_bytes(f.read_bytes()[:-1])
        engine.storage_manager.cpu.clear()
        engine.lookup(prompt, namespace=salt)
    client = CacheServerClient("127.0.0.1", port, timeout_s=5)
    closing.append(client)
    listed, _ = client.list()
    assert listed, "the chunks reached the server"
    seen = [k.decode() for k in listed] + [p.name for p in tmp_path.rglob("*")]
    seen += [r.getMessage() for r in caplog.records] + [generate_latest().decode()]
    seen += [str(k) for k in engine.storage_manager.cpu.keys()]
    assert not [s for s in seen if "Zq81" in s or salt in s]
