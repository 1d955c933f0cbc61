"""CacheBlend kernels vs their references: kv_deviation (fp32, rtol 1e-5), select_recompute_tokens
(exact, ties and `always` included), selective_write (bit-exact, sentinel-prefilled destinations)."""

from __future__ import annotations

import math

import pytest
import torch

from lmcache_triton.kernels import (kv_deviation, kv_deviation_ref, num_recompute_tokens, select_recompute_tokens,
                                    select_recompute_tokens_ref, selective_write, selective_write_ref, top_deviation_rows,
                                    top_deviation_rows_ref, use_triton)

SENTINEL = 0x5A


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def rand_bits(shape, dtype, gen) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)  # random bit patterns, NaN payloads included


def sentinel(shape, dtype, device) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    return torch.full((*shape[:-1], shape[-1] * size), SENTINEL, dtype=torch.uint8).view(dtype).to(device)


# ------------------------------------------------------------------------------ kv_deviation

DEV_SHAPES = [
    pytest.param((37, 3, 16), id="T37-H3-hs16"),
    pytest.param((1, 8, 128), id="T1-H8-hs128"),
    pytest.param((29, 5, 24), id="T29-H5-hs24"),       # width 120: padded tile
    pytest.param((13, 2, 1100), id="T13-w2200"),       # width > BLOCK_D: the column loop runs 3 times
    pytest.param((11, 7), id="T11-2d"),
    pytest.param((0, 4, 8), id="T0-empty"),
]
FLOATS = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", DEV_SHAPES)
def test_kv_deviation_matches_reference(shape, dtype, device):
    gen = torch.Generator().manual_seed(sum(shape))
    a = torch.randn(shape, generator=gen).to(dtype).to(device)
    b = (a.float() + 0.1 * torch.randn(shape, generator=gen).to(device)).to(dtype)
    if shape[0] > 2:
        b[2] = a[2]  # a token with zero deviation
    got = kv_deviation(a, b)
    ref = kv_deviation_ref(a, b)
    assert got.dtype == torch.float32 and got.shape == (shape[0],)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    if shape[0] > 2:
        assert got[2].item() == 0.0


def test_kv_deviation_strided(device):
    """K as a non-contiguous view (K half of a [T, 2, H, hs] KV tensor)."""
    gen = torch.Generator().manual_seed(3)
    kv1 = torch.randn(21, 2, 3, 16, generator=gen).to(device)
    kv2 = torch.randn(21, 2, 3, 16, generator=gen).to(device)
    torch.testing.assert_close(kv_deviation(kv1[:, 0], kv2[:, 0]), kv_deviation_ref(kv1[:, 0], kv2[:, 0]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", [pytest.param(kv_deviation, id="triton"), pytest.param(kv_deviation_ref, id="ref")])
@pytest.mark.parametrize("a,b,name", [
    pytest.param(torch.zeros(4, 8), torch.zeros(4, 9), "k_cached", id="shape"),
    pytest.param(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float16), "k_cached", id="dtype-mismatch"),
    pytest.param(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32), "k_new", id="int"),
    pytest.param(torch.tensor(1.0), torch.tensor(1.0), "k_new", id="0d"),
])
def test_kv_deviation_bad_input(fn, a, b, name):
    with pytest.raises(ValueError, match=name):
        fn(a, b)


# ------------------------------------------------------------------------------ selection

def _ties(n: int) -> torch.Tensor:
    return torch.tensor([float(i % 3) for i in range(n)])  # values 0,1,2 repeated: many ties


SEL = [  # (deviation, ratio, always)
    pytest.param(torch.rand(37, generator=torch.Generator().manual_seed(1)), 0.15, None, id="rand-0.15"),
    pytest.param(torch.rand(37, generator=torch.Generator().manual_seed(2)), 0.5, torch.tensor([36]), id="rand-0.5-last"),
    pytest.param(_ties(31), 0.3, None, id="ties-0.3"),
    pytest.param(_ties(31), 0.1, torch.tensor([0, 30, 2]), id="ties-0.1-always"),
    pytest.param(torch.zeros(17), 0.25, None, id="all-equal"),
    pytest.param(torch.tensor([1.0, float("nan"), 3.0, 3.0, -0.0, 0.0]), 0.5, None, id="nan-and-zeros"),
    pytest.param(torch.rand(40, generator=torch.Generator().manual_seed(3)).half(), 0.3, None, id="fp16-dev"),
    pytest.param(torch.rand(23, generator=torch.Generator().manual_seed(4)), 0.0, torch.tensor([22]), id="ratio0-last"),
    pytest.param(torch.rand(23, generator=torch.Generator().manual_seed(5)), 0.0, None, id="ratio0"),
    pytest.param(torch.rand(23, generator=torch.Generator().manual_seed(6)), 1.0, torch.tensor([3]), id="ratio1"),
    pytest.param(torch.rand(1), 0.01, None, id="T1"),
    pytest.param(torch.empty(0), 0.5, None, id="T0"),
    pytest.param(torch.rand(100, generator=torch.Generator().manual_seed(7)), 0.15, torch.tensor([99]), id="T100-0.15"),
]


@pytest.mark.parametrize("deviation,ratio,always", SEL)
def test_select_matches_reference(deviation, ratio, always, device):
    deviation = deviation.to(device)
    always = None if always is None else always.to(device)
    got = select_recompute_tokens(deviation, ratio, always=always)
    ref = select_recompute_tokens_ref(deviation, ratio, always=always)
    assert got.dtype == torch.int64 and got.device == deviation.device
    assert torch.equal(got.cpu(), ref.cpu())
    assert torch.equal(got, torch.sort(got).values) and got.unique().numel() == got.numel()

    T = deviation.numel()
    k = num_recompute_tokens(ratio, T)
    assert k == (math.ceil(round(ratio * T, 9)) if T else 0)
    extras = set() if always is None else set(always.tolist())
    top = set(select_recompute_tokens(deviation, ratio).tolist())
    assert len(top) == k
    assert set(got.tolist()) == top | extras
    if ratio == 0:
        assert set(got.tolist()) == extras
    if ratio == 1:
        assert got.tolist() == list(range(T))


def test_select_ties_go_to_lower_index():
    dev = torch.tensor([5.0, 1.0, 5.0, 1.0, 5.0, 1.0, 0.5])
    assert select_recompute_tokens(dev, 2 / 7).tolist() == [0, 2]
    assert select_recompute_tokens(dev, 4 / 7).tolist() == [0, 1, 2, 4]
    assert select_recompute_tokens(dev, 4 / 7, always=torch.tensor([6])).tolist() == [0, 1, 2, 4, 6]
    assert select_recompute_tokens(dev, 4 / 7, always=torch.tensor([2])).tolist() == [0, 1, 2, 4]


def test_num_recompute_tokens_reads_ratio_as_written():
    assert num_recompute_tokens(0.15, 100) == 15     # float: 0.15 * 100 = 15.000000000000002
    assert num_recompute_tokens(0.1, 30) == 3
    assert num_recompute_tokens(0.151, 100) == 16
    assert num_recompute_tokens(1, 7) == 7 and num_recompute_tokens(0, 7) == 0


@pytest.mark.parametrize("fn", [pytest.param(select_recompute_tokens, id="torch"),
                                pytest.param(select_recompute_tokens_ref, id="ref")])
@pytest.mark.parametrize("deviation,ratio,always,name", [
    pytest.param(torch.rand(5), 1.5, None, "ratio", id="ratio>1"),
    pytest.param(torch.rand(5), -0.1, None, "ratio", id="ratio<0"),
    pytest.param(torch.rand(5), float("nan"), None, "ratio", id="ratio-nan"),
    pytest.param(torch.rand(5, 2), 0.5, None, "deviation", id="dev-2d"),
    pytest.param(torch.arange(5), 0.5, None, "deviation", id="dev-int"),
    pytest.param(torch.rand(5), 0.5, torch.tensor([5]), "always", id="always-range"),
    pytest.param(torch.rand(5), 0.5, torch.tensor([-1]), "always", id="always-neg"),
    pytest.param(torch.rand(5), 0.5, torch.tensor([1.0]), "always", id="always-float"),
])
def test_select_bad_input(fn, deviation, ratio, always, name):
    with pytest.raises(ValueError, match=name):
        fn(deviation, ratio, always=always)


# ------------------------------------------------------------------------------ selective_write

WRITE_DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16"),
                pytest.param(torch.float32, id="fp32"), pytest.param(torch.uint8, id="u8")]
WRITE_CASES = [  # (dst rows, row shape, number of indices)
    pytest.param(50, (3, 16), 37, id="N50-3x16-M37"),
    pytest.param(9, (1024,), 9, id="N9-1024-all"),
    pytest.param(33, (5, 24), 1, id="N33-5x24-M1"),
    pytest.param(40, (2, 2, 600), 13, id="N40-2x2x600-M13"),   # width 2400: 3 column tiles
    pytest.param(8, (), 5, id="N8-scalar-rows"),
    pytest.param(8, (3,), 0, id="M0"),
]


@pytest.mark.parametrize("idx_dtype", [pytest.param(torch.int64, id="i64"), pytest.param(torch.int32, id="i32")])
@pytest.mark.parametrize("dtype", WRITE_DTYPES)
@pytest.mark.parametrize("num_dst,row,num_idx", WRITE_CASES)
def test_selective_write_matches_reference(num_dst, row, num_idx, dtype, idx_dtype, device):
    gen = torch.Generator().manual_seed(num_dst * 7 + num_idx)
    shape = (num_idx, *row) if row else (num_idx, 1)
    src = rand_bits(shape, dtype, gen).reshape((num_idx, *row)).to(device)
    idx = torch.randperm(num_dst, generator=gen)[:num_idx]
    if num_idx > 3:
        idx[num_idx // 2] = -1
        idx[0] = -1
    idx = idx.to(idx_dtype).to(device)
    dshape = (num_dst, *row) if row else (num_dst, 1)
    got = sentinel(dshape, dtype, device).reshape((num_dst, *row))
    ref = sentinel(dshape, dtype, device).reshape((num_dst, *row))
    selective_write(got, src, idx)
    selective_write_ref(ref, src, idx)
    assert torch.equal(bits(got), bits(ref))
    untouched = torch.ones(num_dst, dtype=torch.bool)
    untouched[idx[idx >= 0].long().cpu()] = False
    assert (bits(got)[untouched.to(device)] == bits(sentinel(dshape, dtype, device).reshape((num_dst, *row)))[0]).all()
    for i, d in enumerate(idx.tolist()):
        if d >= 0:
            assert torch.equal(bits(got[d]), bits(src[i]))


def test_selective_write_strided_dst(device):
    """dst as the K half of a [N, 2, hidden] buffer (rows strided, flattenable without a copy)."""
    gen = torch.Generator().manual_seed(11)
    buf = sentinel((20, 2, 48), torch.bfloat16, device)
    src = rand_bits((7, 48), torch.bfloat16, gen).to(device)
    idx = torch.tensor([19, 0, -1, 5, 6, 3, 11], device=device)
    expect = buf.clone()
    selective_write_ref(expect[:, 0], src, idx)
    selective_write(buf[:, 0], src, idx)
    assert torch.equal(bits(buf), bits(expect))
    assert torch.equal(bits(buf[:, 1]), bits(sentinel((20, 48), torch.bfloat16, device)))


@pytest.mark.parametrize("fn", [pytest.param(selective_write, id="triton"), pytest.param(selective_write_ref, id="ref")])
@pytest.mark.parametrize("dst,src,idx,name", [
    pytest.param(torch.zeros(5, 4), torch.zeros(2, 3), torch.tensor([0, 1]), "src", id="row-shape"),
    pytest.param(torch.zeros(5, 4), torch.zeros(3, 4), torch.tensor([0, 1]), "src", id="count"),
    pytest.param(torch.zeros(5, 4), torch.zeros(2, 4).half(), torch.tensor([0, 1]), "src", id="dtype"),
    pytest.param(torch.zeros(5, 4), torch.zeros(2, 4), torch.tensor([0.0, 1.0]), "indices", id="idx-float"),
    pytest.param(torch.zeros(5, 4), torch.zeros(2, 4), torch.tensor([0, 5]), "indices", id="idx-range"),
    pytest.param(torch.zeros(5, 4), torch.zeros(2, 4), torch.tensor([0, -2]), "indices", id="idx-neg"),
])
def test_selective_write_bad_input(fn, dst, src, idx, name):
    with pytest.raises(ValueError, match=name):
        fn(dst, src, idx)


def test_triton_path_is_exercised():
    if torch.cuda.is_available():
        return
    assert use_triton(torch.device("cpu")), "TRITON_INTERPRET was not set before the kernels were imported"


def _mask(T, rows):
    m = torch.zeros(T, dtype=torch.bool)
    m[list(rows)] = True
    return m


TOP = [
    pytest.param(torch.tensor([5.0, 1.0, 5.0, 1.0, 5.0, 1.0, 0.5]), 3, None, id="ties-lower-index"),
    pytest.param(torch.tensor([5.0, 1.0, 5.0, 1.0, 5.0, 1.0, 0.5]), 3, [6], id="forced-low-deviation"),
    pytest.param(torch.tensor([5.0, 1.0, 5.0, 1.0, 5.0, 1.0, 0.5]), 3, [0, 2, 4], id="forced-are-the-top"),
    pytest.param(torch.tensor([1.0, float("nan"), float("inf"), 3.0, -float("inf"), 0.0]), 4, [5], id="nan-inf"),
    pytest.param(torch.tensor([float("nan")] * 5 + [0.0]), 2, [5], id="forced-beats-nan"),
    pytest.param(torch.rand(37, generator=torch.Generator().manual_seed(8)), 37, [3, 36], id="all"),
    pytest.param(torch.rand(37, generator=torch.Generator().manual_seed(9)), 2, [0, 1], id="only-forced"),
    pytest.param(torch.rand(37, generator=torch.Generator().manual_seed(10)).half(), 9, [36], id="fp16"),
    pytest.param(torch.rand(1), 1, [0], id="T1"),
    pytest.param(torch.empty(0), 0, None, id="T0"),
]


@pytest.mark.parametrize("deviation,n,forced", TOP)
def test_top_deviation_rows_matches_reference(deviation, n, forced, device):
    T = deviation.numel()
    first = None if forced is None else _mask(T, forced).to(device)
    deviation = deviation.to(device)
    got = top_deviation_rows(deviation, n, first=first)
    ref = top_deviation_rows_ref(deviation, n, first=first)
    assert got.dtype == torch.int64 and got.device == deviation.device
    assert torch.equal(got.cpu(), ref.cpu())
    assert got.numel() == n and torch.equal(got, torch.sort(got).values)
    assert set(forced or []) <= set(got.tolist())


def test_top_deviation_rows_is_the_selection_without_always():
    dev = torch.rand(100, generator=torch.Generator().manual_seed(11))
    for ratio in (0.0, 0.15, 0.5, 1.0):
        assert torch.equal(top_deviation_rows(dev, num_recompute_tokens(ratio, 100)),
                           select_recompute_tokens(dev, ratio))


@pytest.mark.parametrize("fn", [pytest.param(top_deviation_rows, id="torch"),
                                pytest.param(top_deviation_rows_ref, id="ref")])
@pytest.mark.parametrize("deviation,n,first,name", [
    pytest.param(torch.rand(5), 6, None, "n", id="n-too-big"),
    pytest.param(torch.rand(5), -1, None, "n", id="n-neg"),
    pytest.param(torch.rand(5), 2.0, None, "n", id="n-float"),
    pytest.param(torch.arange(5), 2, None, "deviation", id="dev-int"),
    pytest.param(torch.rand(5), 2, torch.tensor([0, 1]), "first", id="first-indices"),
    pytest.param(torch.rand(5), 2, torch.zeros(4, dtype=torch.bool), "first", id="first-shape"),
])
def test_top_deviation_rows_bad_input(fn, deviation, n, first, name):
    with pytest.raises(ValueError, match=name):
        fn(deviation, n, first=first)
