"""rope_rerotate (Triton) vs rope_rerotate_ref (torch), and against a real RoPE computed from scratch.

Tolerances: fp32 atol 1e-5 (rtol 1e-5) kernel vs reference (values O(1), only FMA contraction and
summation order differ). fp16/bf16: both sides compute in fp32 and round once to the output dtype,
so they can differ by at most one ulp of the output where the fp32 results straddle a rounding
boundary: fp16 atol/rtol 1e-3 (ulp at 1 = 2^-10), bf16 atol/rtol 1e-2 (ulp at 1 = 2^-7).
Pass-through dims (>= rotary_dim) must be bit-equal to the input.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_triton.kernels import common, rope_rerotate, rope_rerotate_ref, use_triton

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}
SENTINEL = -7.0


def vllm_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0,
                       dtype=torch.float32, device="cpu") -> torch.Tensor:
    """As vLLM's RotaryEmbedding._compute_cos_sin_cache: [max_position, rotary_dim], cos then sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype).to(device)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, is_neox: bool,
               rotary_dim: int) -> torch.Tensor:
    """Plain RoPE at absolute positions (vLLM's forward_native), independent of the code under test."""
    half = rotary_dim // 2
    cs = cache[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
        r = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        r = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([r, rest], dim=-1)


def make_positions(num_tokens: int, max_position: int, kind: str, gen) -> tuple[torch.Tensor, torch.Tensor]:
    old = torch.randint(0, max_position // 2, (num_tokens,), generator=gen)
    if kind == "pos":
        new = old + torch.randint(1, max_position // 2, (num_tokens,), generator=gen)
    elif kind == "neg":
        new = torch.clamp(old - torch.randint(1, max_position // 2, (num_tokens,), generator=gen), min=0)
        old = new + torch.randint(1, max_position // 2, (num_tokens,), generator=gen)
    elif kind == "zero":
        new = old.clone()
    else:  # mixed: negative, zero and positive deltas, plus the extremes |delta| = max_position - 1
        new = torch.randint(0, max_position, (num_tokens,), generator=gen)
        old = torch.randint(0, max_position, (num_tokens,), generator=gen)
        new[: num_tokens // 5] = old[: num_tokens // 5]
        if num_tokens >= 2:
            old[0], new[0] = 0, max_position - 1
            old[1], new[1] = max_position - 1, 0
    return old, new


CASES = [  # (num_tokens, num_heads, head_size, rotary_dim, deltas)
    pytest.param(37, 3, 16, None, "mixed", id="T37-H3-hs16-full-mixed"),
    pytest.param(1, 1, 8, None, "pos", id="T1-H1-hs8-pos"),
    pytest.param(19, 5, 24, 16, "neg", id="T19-H5-hs24-rot16-neg"),
    pytest.param(23, 2, 20, 12, "zero", id="T23-H2-hs20-rot12-zero"),   # rot/2 = 6: padded pairs
    pytest.param(64, 2, 32, 8, "mixed", id="T64-H2-hs32-rot8-mixed"),
    pytest.param(0, 3, 16, None, "pos", id="T0-empty"),
]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
STYLES = [pytest.param(True, id="neox"), pytest.param(False, id="gptj")]


@pytest.mark.parametrize("is_neox", STYLES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_heads,head_size,rotary_dim,deltas", CASES)
def test_matches_reference(num_tokens, num_heads, head_size, rotary_dim, deltas, dtype, is_neox, device):
    gen = torch.Generator().manual_seed(num_tokens * 131 + head_size)
    max_position = 97
    rot = rotary_dim or head_size
    cache = vllm_cos_sin_cache(max_position, rot, dtype=dtype if dtype != torch.float16 else torch.float32,
                               device=device)
    k = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype).to(device)
    old, new = make_positions(num_tokens, max_position, deltas, gen)
    old, new = old.to(device), new.to(device)
    k_before = k.clone()

    ref = rope_rerotate_ref(k, old, new, cache, is_neox=is_neox, rotary_dim=rotary_dim)
    out = torch.full_like(k, SENTINEL)
    got = rope_rerotate(k, old, new, cache, is_neox=is_neox, rotary_dim=rotary_dim, out=out)
    assert got is out
    assert torch.equal(k, k_before), "k must not be modified when out is given"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)
    assert torch.equal(got[..., rot:], k[..., rot:]), "pass-through dims must be bit-equal"
    if deltas == "zero":
        torch.testing.assert_close(got.float(), k.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("is_neox", STYLES)
@pytest.mark.parametrize("rotary_dim", [pytest.param(None, id="full"), pytest.param(16, id="rot16")])
def test_in_place(is_neox, rotary_dim, device):
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(29, 3, 32, generator=gen).to(device)
    old, new = make_positions(29, 64, "mixed", gen)
    cache = vllm_cos_sin_cache(64, rotary_dim or 32, device=device)
    ref = rope_rerotate_ref(k, old.to(device), new.to(device), cache, is_neox=is_neox, rotary_dim=rotary_dim)
    got = rope_rerotate(k, old.to(device), new.to(device), cache, is_neox=is_neox, rotary_dim=rotary_dim, out=k)
    assert got is k
    torch.testing.assert_close(k, ref, atol=1e-5, rtol=1e-5)


def test_strided_k_and_int32_positions(device):
    """k as a view of a packed qkv tensor (non-contiguous), positions int32, bf16 cache."""
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(21, 4 + 2 + 2, 16, generator=gen).to(device)
    k = qkv[:, 4:6]
    old, new = make_positions(21, 50, "mixed", gen)
    old, new = old.to(torch.int32).to(device), new.to(torch.int32).to(device)
    cache = vllm_cos_sin_cache(50, 16, dtype=torch.bfloat16, device=device)
    ref = rope_rerotate_ref(k, old, new, cache, is_neox=True)
    got = rope_rerotate(k, old, new, cache, is_neox=True)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_neox", STYLES)
@pytest.mark.parametrize("rotary_dim", [pytest.param(None, id="full"), pytest.param(24, id="rot24")])
@pytest.mark.parametrize("fn", [pytest.param(rope_rerotate, id="triton"), pytest.param(rope_rerotate_ref, id="ref")])
def test_semantics_real_rope(fn, is_neox, rotary_dim, device):
    """rope_rerotate(RoPE(x, p1), p1, p2) == RoPE(x, p2) for a real (vLLM-style) cos/sin cache."""
    gen = torch.Generator().manual_seed(17)
    head_size, max_position = 32, 4096
    rot = rotary_dim or head_size
    cache = vllm_cos_sin_cache(max_position, rot, device=device)
    x = torch.randn(33, 3, head_size, generator=gen).to(device)
    p1 = torch.randint(0, max_position, (33,), generator=gen).to(device)
    p2 = torch.randint(0, max_position, (33,), generator=gen).to(device)
    p2[:4] = p1[:4]
    k_at_p1 = apply_rope(x, p1, cache, is_neox, rot)
    k_at_p2 = apply_rope(x, p2, cache, is_neox, rot)
    got = fn(k_at_p1, p1, p2, cache, is_neox=is_neox, rotary_dim=rotary_dim)
    torch.testing.assert_close(got, k_at_p2, atol=1e-5, rtol=1e-5)
    # and the other style is not the same thing (the test would catch a swapped layout)
    wrong = fn(k_at_p1, p1, p2, cache, is_neox=not is_neox, rotary_dim=rotary_dim)
    assert not torch.allclose(wrong, k_at_p2, atol=1e-3)


def _args(device, **over):
    k = torch.randn(6, 2, 16, device=device)
    a = dict(k=k, old_positions=torch.arange(6, device=device), new_positions=torch.arange(6, device=device) + 3,
             cos_sin_cache=vllm_cos_sin_cache(16, 16, device=device), is_neox=True)
    a.update(over)
    return a


OUT_OF_TABLE = [
    pytest.param(dict(new_positions=torch.arange(6) + 16), id="delta-too-large"),
    pytest.param(dict(old_positions=torch.arange(6) + 19), id="neg-delta-too-large"),
]


@pytest.mark.parametrize("fn", [pytest.param(rope_rerotate, id="triton"), pytest.param(rope_rerotate_ref, id="ref")])
@pytest.mark.parametrize("over", OUT_OF_TABLE)
def test_host_positions_past_the_table_raise(fn, over):
    a = _args("cpu", **over)
    with pytest.raises(ValueError, match="cos_sin_cache"):
        fn(a.pop("k"), a.pop("old_positions"), a.pop("new_positions"), a.pop("cos_sin_cache"), **a)


@pytest.mark.parametrize("over", OUT_OF_TABLE)
@pytest.mark.parametrize("in_place", [pytest.param(False, id="out"), pytest.param(True, id="in-place")])
def test_device_positions_past_the_table_leave_rows_unwritten(over, in_place, device, monkeypatch):
    """GPU positions are not checked on the host (a sync per layer in the blender): the kernel
    leaves a row whose |delta| is past the table unwritten and never reads past the table."""
    monkeypatch.setattr(common, "in_host_memory", lambda t: False)  # the GPU branch, also on a CPU
    over = {key: v.to(device) for key, v in over.items()}
    a = _args(device, **over)
    k, old, new, table = a.pop("k"), a.pop("old_positions"), a.pop("new_positions"), a.pop("cos_sin_cache")
    old, new = old.clone(), new.clone()
    old[:2], new[:2] = 1, 4  # two rows inside the table
    out = k.clone() if in_place else torch.full_like(k, 7.0)
    before = out.clone()
    rope_rerotate(out if in_place else k, old, new, table, out=out, **a)
    want = rope_rerotate_ref(k[:2], old[:2], new[:2], table, **a)
    torch.testing.assert_close(out[:2], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2:], before[2:])


BAD = [
    pytest.param(dict(old_positions=torch.arange(5)), "old_positions", id="old-len"),
    pytest.param(dict(new_positions=torch.arange(6).float()), "new_positions", id="new-dtype"),
    pytest.param(dict(k=torch.randn(6, 32)), "k", id="k-2d"),
    pytest.param(dict(k=torch.randint(0, 9, (6, 2, 16))), "k", id="k-int"),
    pytest.param(dict(cos_sin_cache=torch.randn(16, 8)), "cos_sin_cache", id="cache-width"),
    pytest.param(dict(cos_sin_cache=torch.randn(16, 16).double()), "cos_sin_cache", id="cache-dtype"),
    pytest.param(dict(rotary_dim=7), "rotary_dim", id="rot-odd"),
    pytest.param(dict(rotary_dim=32), "rotary_dim", id="rot-too-big"),
    pytest.param(dict(out=torch.empty(6, 2, 16, dtype=torch.float16)), "out", id="out-dtype"),
    pytest.param(dict(out=torch.empty(6, 2, 8)), "out", id="out-shape"),
]


@pytest.mark.parametrize("fn", [pytest.param(rope_rerotate, id="triton"), pytest.param(rope_rerotate_ref, id="ref")])
@pytest.mark.parametrize("over,name", BAD)
def test_bad_input_raises(fn, over, name, device):
    over = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in over.items()}
    a = _args(device, **over)
    with pytest.raises(ValueError, match=name):
        fn(a.pop("k"), a.pop("old_positions"), a.pop("new_positions"), a.pop("cos_sin_cache"), **a)


def test_triton_path_is_exercised():
    if torch.cuda.is_available():
        return
    assert use_triton(torch.device("cpu")), "TRITON_INTERPRET was not set before the kernels were imported"
