"""Slots past the cache (>= num_blocks * block_size): the Triton kernels mask them like padding, the
launchers reject them with ValueError where the check is free (a slot_mapping in host memory).

The caches here are views into the middle of larger buffers whose guard regions (before and after)
hold GUARD bytes: a kernel that reads or writes past the cache shows up as changed guards, as guard
bytes in a gathered row, or as bytes written into another layer. The bad slots are chosen so that an
unmasked kernel lands inside the guards (not in unmapped memory), except the "huge" set, which an
unmasked kernel would fault on.

The Triton code is reached through `paged_copy.gather_into` / `scatter_from` (the launchers' own entry
below their argument checks): with CPU tensors the public launchers now refuse these slots first.
On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, see conftest.py), on a CUDA
host natively.
"""

from __future__ import annotations

import math

import pytest
import torch

from lmcache_triton.kernels import (blend, paged_copy, paged_gather, paged_gather_layer, paged_gather_layer_ref,
                                    paged_gather_ref, paged_scatter, paged_scatter_layer,
                                    paged_scatter_layer_ref, paged_scatter_ref, selective_write,
                                    selective_write_ref, use_triton)
from lmcache_triton.kernels.common import prepare_layers
from lmcache_triton.kernels.reference import as_2ltd

from test_paged_copy import SENTINEL, Case, bits  # tests/kernels is on sys.path (no __init__.py)

GUARD = 0xA5  # byte pattern of the guard regions (neither the sentinel nor what the tests write)

CASES = [
    pytest.param(Case("vllm_packed", "LBNHC", num_tokens=21, num_layers=2), id="vllm_packed-LBNHC"),
    pytest.param(Case("vllm_packed", "BLNHC", num_tokens=21, num_layers=2), id="vllm_packed-BLNHC"),
    pytest.param(Case("vllm_cpu", heads=3, head_size=40, num_tokens=21, num_layers=2), id="vllm_cpu"),
    pytest.param(Case("flash_attn", num_tokens=21, num_layers=2), id="flash_attn"),
    pytest.param(Case("flashinfer", heads=1, head_size=64, num_tokens=21, num_layers=2), id="flashinfer"),
    pytest.param(Case("mla", heads=1, head_size=72, num_tokens=21, num_layers=2), id="mla-72"),
]
DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.uint8, id="u8"),
]
# "edge": the first slot past the cache, a few past it, and a far one (3x the cache) that an
# unmasked kernel maps into the guard after it. "huge": far beyond any allocation (int64 only).
BAD = ["edge", "huge"]


def bad_slots(kind: str, num_slots: int) -> list[int]:
    if kind == "edge":
        return [num_slots, num_slots + 5, 3 * num_slots + 7]
    return [num_slots, 2**40 + 3, 2**62]


class Guarded:
    """`fill` for `Case.caches`: every allocation is the middle of a larger uint8 buffer, with guard
    regions of 8x its size before and after. Contents: random (seeded, so two instances with one
    seed build identical caches) or the SENTINEL byte."""

    def __init__(self, dtype: torch.dtype, seed: int | None = None, device: str = "cpu") -> None:
        self.dtype, self.device = dtype, device
        self.gen = None if seed is None else torch.Generator().manual_seed(seed)
        self.buffers: list[torch.Tensor] = []
        self.spans: list[tuple[int, int]] = []

    def __call__(self, shape) -> torch.Tensor:
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        n = math.prod(shape) * itemsize
        guard = 8 * n + 64 - (8 * n) % 64  # a multiple of 64 bytes: the cache keeps its alignment
        buf = torch.full((guard + n + guard,), GUARD, dtype=torch.uint8, device=self.device)
        if self.gen is None:
            buf[guard:guard + n] = SENTINEL
        else:
            buf[guard:guard + n] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=self.gen).to(self.device)
        self.buffers.append(buf)
        self.spans.append((guard, guard + n))
        return buf[guard:guard + n].view(self.dtype).view(shape)

    def assert_guards_intact(self) -> None:
        for i, (buf, (lo, hi)) in enumerate(zip(self.buffers, self.spans)):
            assert torch.all(buf[:lo] == GUARD), f"allocation {i}: the guard before the cache was written"
            assert torch.all(buf[hi:] == GUARD), f"allocation {i}: the guard after the cache was written"


def mapping(case: Case, kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots with bad ones, the same with bad ones as -1, bool mask of the bad positions)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = case.num_blocks * case.block_size
    slots = torch.randperm(num_slots, generator=gen)[:case.num_tokens]
    slots[3] = -1
    bad = torch.zeros(case.num_tokens, dtype=torch.bool)
    positions = torch.randperm(case.num_tokens - 4, generator=gen)[:3] + 4  # never the -1 at 3
    slots[positions] = torch.tensor(bad_slots(kind, num_slots))
    bad[positions] = True
    return slots, torch.where(bad, -1, slots), bad


def sentinel_chunk(shape, dtype, device="cpu") -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return torch.full((*shape[:-1], shape[-1] * itemsize), SENTINEL, dtype=torch.uint8, device=device).view(dtype)


def random_chunk(shape, dtype, seed, device="cpu") -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=g)
    return raw.to(device).view(dtype)


@pytest.fixture
def triton_device(device) -> str:
    """The device fixture, where the Triton kernels run on it (CUDA, or CPU in the interpreter)."""
    if not use_triton(torch.device(device)):
        pytest.skip("the Triton kernels run on CPU tensors only in the interpreter")
    return device


# ---------------------------------------------------------------- kernels: masked like padding

@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_gather_out_of_range_slots_are_padding(case, dtype, kind, triton_device):
    dev = triton_device
    src = Guarded(dtype, seed=1, device=dev)
    caches = case.caches(dtype, dev, src)
    slots, clean, bad = (t.to(dev) for t in mapping(case, kind))
    expected = paged_gather_ref(caches, clean, case.layout, out=sentinel_chunk(case.chunk_shape(), dtype, dev))
    out = sentinel_chunk(case.chunk_shape(), dtype, dev)
    paged_copy.gather_into(prepare_layers(caches, case.layout), slots, out)
    assert torch.all(bits(out)[:, :, bad] == bits(sentinel_chunk((1,), dtype, dev))[0]), \
        "rows of out-of-range slots must keep the destination's sentinel"
    assert torch.equal(bits(out), bits(expected))
    src.assert_guards_intact()


@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_scatter_out_of_range_slots_are_padding(case, dtype, kind, triton_device):
    dev = triton_device
    got, want = Guarded(dtype, device=dev), Guarded(dtype, device=dev)
    caches, expected = case.caches(dtype, dev, got), case.caches(dtype, dev, want)
    slots, clean, _ = (t.to(dev) for t in mapping(case, kind))
    chunk = random_chunk(case.chunk_shape(), dtype, seed=2, device=dev)
    paged_scatter_ref(chunk, expected, clean, case.layout)
    paged_copy.scatter_from(prepare_layers(caches, case.layout), slots, chunk)
    got.assert_guards_intact()
    for i, (a, b) in enumerate(zip(got.buffers, want.buffers)):  # guards, every layer, every block
        assert torch.equal(a, b), f"allocation {i} differs from a scatter of the in-range slots only"


@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("case", CASES)
def test_single_layer_out_of_range_slots_are_padding(case, kind, triton_device):
    dev, dtype = triton_device, torch.bfloat16
    mla = case.layout == "mla"
    slots, clean, bad = (t.to(dev) for t in mapping(case, kind, seed=3))
    src = Guarded(dtype, seed=4, device=dev)
    caches = case.caches(dtype, dev, src)
    layer = prepare_layers([caches[1]], case.layout, name="kv_cache")
    out = sentinel_chunk(case.layer_shape(), dtype, dev)
    expected = paged_gather_layer_ref(caches[1], clean, case.layout,
                                      out=sentinel_chunk(case.layer_shape(), dtype, dev))
    paged_copy.gather_into(layer, slots, as_2ltd(out, True, mla))
    assert torch.all(bits(out)[bad] == bits(sentinel_chunk((1,), dtype, dev))[0])
    assert torch.equal(bits(out), bits(expected))
    src.assert_guards_intact()

    got, want = Guarded(dtype, device=dev), Guarded(dtype, device=dev)
    caches, ref = case.caches(dtype, dev, got), case.caches(dtype, dev, want)
    chunk = random_chunk(case.layer_shape(), dtype, seed=5, device=dev)
    paged_scatter_layer_ref(chunk, ref[1], clean, case.layout)
    paged_copy.scatter_from(prepare_layers([caches[1]], case.layout, name="kv_cache"), slots,
                        as_2ltd(chunk, True, mla))
    got.assert_guards_intact()
    for i, (a, b) in enumerate(zip(got.buffers, want.buffers)):
        assert torch.equal(a, b), f"allocation {i} differs from a scatter of the in-range slots only"


@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("dtype", DTYPES)
def test_selective_write_out_of_range_rows_are_skipped(dtype, kind, monkeypatch, triton_device):
    """The launcher checks indices on the host (one sync); the kernel's own bound holds without it."""
    dev = triton_device
    num_dst, width = 20, 72
    got, want = Guarded(dtype, device=dev), Guarded(dtype, device=dev)
    dst, ref = got([num_dst, width]), want([num_dst, width])
    idx = torch.tensor([3, -1, 0, 19] + bad_slots(kind, num_dst) + [7], device=dev)
    src = random_chunk((idx.numel(), width), dtype, seed=6, device=dev)
    selective_write_ref(ref, src, torch.where(idx >= num_dst, -1, idx))
    monkeypatch.setattr(blend, "_check_write", lambda *a: None)
    selective_write(dst, src, idx)
    got.assert_guards_intact()
    assert torch.equal(got.buffers[0], want.buffers[0])


# ---------------------------------------------------------------- launchers: ValueError

def _launch_all(case: Case, caches, slots):
    dtype = caches[0].dtype
    yield "paged_gather", lambda: paged_gather(caches, slots, case.layout)
    yield "paged_scatter", lambda: paged_scatter(sentinel_chunk(case.chunk_shape(), dtype), caches, slots,
                                                 case.layout)
    yield "paged_gather_layer", lambda: paged_gather_layer(caches[0], slots, case.layout)
    yield "paged_scatter_layer", lambda: paged_scatter_layer(sentinel_chunk(case.layer_shape(), dtype), caches[0],
                                                             slots, case.layout)
    yield "paged_gather_ref", lambda: paged_gather_ref(caches, slots, case.layout)
    yield "paged_scatter_ref", lambda: paged_scatter_ref(sentinel_chunk(case.chunk_shape(), dtype), caches, slots,
                                                         case.layout)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("case", CASES[:1] + CASES[2:])
def test_launchers_reject_cpu_slots_past_the_cache(case, slot_dtype, device):
    """A CPU slot_mapping is checked for free: ValueError naming slot_mapping, the slot and the size,
    for a CPU cache (vllm-cpu) and for a CUDA one alike; nothing is written anywhere."""
    dtype = torch.float16
    fill = Guarded(dtype, seed=7, device=device)
    caches = case.caches(dtype, device, fill)
    before = [c.clone() for c in caches]
    num_slots = case.num_blocks * case.block_size
    for bad in (num_slots, num_slots + 5):
        slots, _, _ = mapping(case, "edge")
        slots[slots >= num_slots] = -1
        slots[5] = bad
        slots = slots.to(slot_dtype)
        for name, call in _launch_all(case, caches, slots):
            with pytest.raises(ValueError, match=rf"slot_mapping.* {bad}\b.* {num_slots} slots") as e:
                call()
            assert f"[0, {num_slots})" in str(e.value), name
    for a, b in zip(caches, before):
        assert torch.equal(bits(a), bits(b))
    fill.assert_guards_intact()
    # the last slot of the cache is fine, and so is padding
    ok = torch.tensor([num_slots - 1, -1, 0], dtype=slot_dtype)
    assert paged_gather(caches, ok, case.layout).shape[2] == 3
