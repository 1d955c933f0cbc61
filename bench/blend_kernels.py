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
"""

from __future__ import annotations

import argparse

import torch

from bench.common import context, make_timer, write_json
from lmcache_triton.kernels import (kv_deviation, kv_deviation_ref, num_recompute_tokens, paged_copy,
                                    rope_rerotate, rope_rerotate_ref, select_recompute_tokens,
                                    select_recompute_tokens_ref, selective_write, selective_write_ref)

NUM_KV_HEADS, HEAD_SIZE, MAX_POSITION, DTYPE = 8, 128, 8192, torch.bfloat16


def _cos_sin_cache(device: str) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_SIZE, 2, dtype=torch.float32) / HEAD_SIZE))
    freqs = torch.outer(torch.arange(MAX_POSITION, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


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
    path = "triton" if paged_copy._use_triton(torch.device(device)) else "torch"
    rows = []
    for name, nbytes, fn, ref in cases:
        ref_s = timer(ref)
        s = timer(fn) if (path == "triton" or name == "select_recompute_tokens") else ref_s
        row = dict(op=name, tokens=num_tokens, kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype="bf16",
                   path=path if name != "select_recompute_tokens" else "torch", bytes=nbytes,
                   us=s * 1e6, ref_us=ref_s * 1e6,
                   gbps=nbytes / s / 1e9 if nbytes else None, ref_gbps=nbytes / ref_s / 1e9 if nbytes else None,
                   vs_ref=ref_s / s)
        rows.append(row)
        gb = f"{row['gbps']:8.1f} GB/s  ref {row['ref_gbps']:8.1f} GB/s" if nbytes else " " * 34
        print(f"  {name:24s} {path:6s} {row['us']:10.1f} us  ref {row['ref_us']:10.1f} us  {gb}  x{row['vs_ref']:.2f}")
    return rows


def main(argv: list[str] | None = None) -> dict:
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
    elif paged_copy._INTERPRETED:
        print(f"{ctx['device']}: TRITON_INTERPRET=1 is set: the launcher column times Triton's interpreter, "
              f"not a production path; perf_counter medians of {repeats}")
    else:
        print(f"{ctx['device']}: no CUDA, so the launchers take the torch reference path (what a CPU host "
              f"runs): this times the references; perf_counter medians of {repeats}")
    print(f"  llama3-8b layer: T={args.tokens}, {NUM_KV_HEADS} KV heads x {HEAD_SIZE}, bf16, ratio {args.ratio}")
    rows = run(args.tokens, args.ratio, repeats, device)
    result = {**ctx, "cuda": cuda, "interpreted": paged_copy._INTERPRETED, "rows": rows}
    print(f"  wrote {write_json('blend_kernels', result)}")
    return result


if __name__ == "__main__":
    main()
