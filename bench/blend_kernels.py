"""CacheBlend kernels (rope_rerotate, kv_deviation, selective_write) against their torch references,
at a Llama-3-8B layer shape (T=2048, 8 KV heads, head 128, bf16), all measured in the same run.

    python -m bench.blend_kernels [--tokens 2048] [--ratio 0.15] [--repeats N]

On CUDA: the Triton launchers vs the *_ref functions, `triton.testing.do_bench` medians. On a CPU
host the launchers take the torch path (there is no Triton CPU backend), so both columns time torch
code, perf_counter medians; the run says so. (Under TRITON_INTERPRET=1 the launcher column times
Triton's interpreter, which is not a production path.)

GB/s counts the bytes each op must move:
  rope_rerotate    K read + K written (in place: out=k) + the cos/sin rows read (fp32 cache)
  kv_deviation     both K tensors read + the float32 [T] result written
  selective_write  the recomputed rows (ceil(ratio*T) of [2, hidden]: K and V) read + written
select_recompute_tokens (a sort over T floats) is reported in microseconds only.

Before an op is timed, its launcher's output on the same inputs is checked against its reference
(the ``*_ref`` functions, written in plain torch; select_recompute_tokens_ref is a Python sort):
selective_write (a copy) and the selection must be bit-exact, rope_rerotate within bf16 rounding
(atol/rtol 1e-2: both compute in fp32, FMA contraction may round one bf16 ulp apart),
kv_deviation (fp32 sums in another order) within rtol 1e-5. A difference is a FAIL row and the
command exits 1. (On a CPU host both sides are the same torch code, so the check is trivial there.)
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.common import context, make_timer, write_json
from lmcache_triton.kernels import (kv_deviation, kv_deviation_ref, num_recompute_tokens, rope_rerotate,
                                    rope_rerotate_ref, select_recompute_tokens, select_recompute_tokens_ref,
                                    selective_write, selective_write_ref, use_triton)
from lmcache_triton.kernels.common import INTERPRETED

NUM_KV_HEADS, HEAD_SIZE, MAX_POSITION, DTYPE = 8, 128, 8192, torch.bfloat16


def _cos_sin_cache(device: str) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_SIZE, 2, dtype=torch.float32) / HEAD_SIZE))
    freqs = torch.outer(torch.arange(MAX_POSITION, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def _mismatch(got: torch.Tensor, want: torch.Tensor, atol: float = 0.0, rtol: float = 0.0) -> str:
    """"" if equal (bit-exact when atol = rtol = 0), else what differs."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {tuple(got.shape)} {got.dtype}, the reference {tuple(want.shape)} {want.dtype}"
    if atol == rtol == 0.0:
        bad = got.view(torch.uint8) != want.view(torch.uint8) if got.is_floating_point() else got != want
    else:
        g, w = got.float(), want.float()
        bad = (g - w).abs() > atol + rtol * w.abs()
    return f"{int(bad.sum())} of {bad.numel()} differ from the reference" if bool(bad.any()) else ""


def _checks(k, k2, old, new, cache, buf, src, idx, dev, ratio) -> dict[str, str]:
    """Each launcher once, on the bench's inputs (never in place on them), against its reference."""
    def rope_in_place():  # the timed call rotates k in place: check that form on a copy
        kk = k.clone()
        return rope_rerotate(kk, old, new, cache, is_neox=True, out=kk)

    def written(fn):
        dst = torch.full_like(buf, 7.0)  # a sentinel: rows not selected must keep it
        fn(dst, src, idx)
        return dst

    want_rope = rope_rerotate_ref(k, old, new, cache, is_neox=True)
    return {
        "rope_rerotate": _mismatch(rope_rerotate(k, old, new, cache, is_neox=True), want_rope, 1e-2, 1e-2)
        or _mismatch(rope_in_place(), want_rope, 1e-2, 1e-2),
        "kv_deviation": _mismatch(kv_deviation(k, k2), kv_deviation_ref(k, k2), 1e-6, 1e-5),
        "selective_write": _mismatch(written(selective_write), written(selective_write_ref)),
        "select_recompute_tokens": _mismatch(select_recompute_tokens(dev, ratio, always=idx[-1:]),
                                             select_recompute_tokens_ref(dev, ratio, always=idx[-1:])),
    }


def run(num_tokens: int, ratio: float, repeats: int, device: str) -> list[dict]:
    cuda = device == "cuda"
    timer = make_timer(cuda, repeats)
    g = torch.Generator().manual_seed(0)
    hidden = NUM_KV_HEADS * HEAD_SIZE
    elem = torch.empty(0, dtype=DTYPE).element_size()
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_SIZE, generator=g).to(DTYPE).to(device)
    k2 = (k.float() + 0.05 * torch.randn(k.shape, generator=g).to(device)).to(DTYPE)
    old = torch.randint(0, MAX_POSITION // 2, (num_tokens,), generator=g).to(device)
    new = torch.randint(0, MAX_POSITION // 2, (num_tokens,), generator=g).to(device)
    cache = _cos_sin_cache(device)
    num_sel = num_recompute_tokens(ratio, num_tokens)
    idx = torch.randperm(num_tokens, generator=g)[:num_sel].sort().values.to(device)
    buf = torch.zeros(num_tokens, 2, hidden, dtype=DTYPE, device=device)
    src = torch.randn(num_sel, 2, hidden, generator=g).to(DTYPE).to(device)
    dev = kv_deviation_ref(k, k2)

    kbytes = num_tokens * hidden * elem
    cases = [
        ("rope_rerotate", 2 * kbytes + num_tokens * HEAD_SIZE * 4,
         lambda: rope_rerotate(k, old, new, cache, is_neox=True, out=k),
         lambda: rope_rerotate_ref(k, old, new, cache, is_neox=True, out=k)),
        ("kv_deviation", 2 * kbytes + num_tokens * 4,
         lambda: kv_deviation(k, k2), lambda: kv_deviation_ref(k, k2)),
        ("selective_write", 2 * num_sel * 2 * hidden * elem,
         lambda: selective_write(buf, src, idx), lambda: selective_write_ref(buf, src, idx)),
        ("select_recompute_tokens", 0,
         lambda: select_recompute_tokens(dev, ratio, always=idx[-1:]),
         lambda: select_recompute_tokens_ref(dev, ratio, always=idx[-1:])),
    ]
    path = "triton" if use_triton(torch.device(device)) else "torch"
    checks = _checks(k, k2, old, new, cache, buf, src, idx, dev, ratio)  # before anything is timed
    rows = []
    for name, nbytes, fn, ref in cases:
        ref_s = timer(ref)
        s = timer(fn) if (path == "triton" or name == "select_recompute_tokens") else ref_s
        row = dict(op=name, tokens=num_tokens, kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype="bf16",
                   path=path if name != "select_recompute_tokens" else "torch", bytes=nbytes,
                   us=s * 1e6, ref_us=ref_s * 1e6,
                   gbps=nbytes / s / 1e9 if nbytes else None, ref_gbps=nbytes / ref_s / 1e9 if nbytes else None,
                   vs_ref=ref_s / s, check=f"FAIL: {checks[name]}" if checks[name] else "ok")
        rows.append(row)
        gb = f"{row['gbps']:8.1f} GB/s  ref {row['ref_gbps']:8.1f} GB/s" if nbytes else " " * 34
        check = "check ok" if row["check"] == "ok" else row["check"]
        print(f"  {name:24s} {row['path']:6s} {row['us']:10.1f} us  ref {row['ref_us']:10.1f} us  {gb}  "
              f"x{row['vs_ref']:.2f}  {check}")
    return rows


def main(argv: list[str] | None = None) -> int:
    """Runs the bench; 1 when a launcher's output differed from its reference, else 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--ratio", type=float, default=0.15, help="recompute ratio (selective_write rows)")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    repeats = args.repeats or (10 if cuda else 15)
    ctx = context()
    if cuda:
        print(f"{ctx['device']}: Triton launchers vs torch references (do_bench medians)")
    elif INTERPRETED:
        print(f"{ctx['device']}: TRITON_INTERPRET=1 is set: the launcher column times Triton's interpreter, "
              f"not a production path; perf_counter medians of {repeats}")
    else:
        print(f"{ctx['device']}: no CUDA, so the launchers take the torch reference path (what a CPU host "
              f"runs): this times the references; perf_counter medians of {repeats}")
    print(f"  llama3-8b layer: T={args.tokens}, {NUM_KV_HEADS} KV heads x {HEAD_SIZE}, bf16, ratio {args.ratio}")
    rows = run(args.tokens, args.ratio, repeats, device)
    failed = [r["op"] for r in rows if r["check"] != "ok"]
    print(f"  check against the references: {'FAIL: ' + ', '.join(failed) if failed else 'all ok'}")
    result = {**ctx, "cuda": cuda, "interpreted": INTERPRETED, "rows": rows}
    print(f"  wrote {write_json('blend_kernels', result)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
