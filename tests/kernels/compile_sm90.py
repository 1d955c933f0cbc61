"""Compile every Triton kernel of lmcache_triton.kernels for sm_90 (Hopper), down to ptxas, from the
arguments its public launcher really passes, on a host without a GPU.

Run with TRITON_INTERPRET unset (tests/kernels/test_compile_sm90.py does, in a subprocess): the
launchers are driven with CPU tensors, `use_triton` is forced on and each `kernel[grid](...)` is
recorded instead of launched; each recorded call is then specialized by Triton's own binder for an
sm_90 target and compiled. Prints one JSON line per launch:
{"case", "kernel", "vector_loads", "vector_stores"} (how many `ld/st.global.v4` in the PTX) and
"widest_store" (bytes: for the scatter kernel, the width of its writes into the paged cache), and
"key", which changes exactly when a real launch would compile anew.

The interpreter accepts programs the compiler rejects (and vice versa for some masks); this is the
check that the code the CPU matrix runs is also code a GPU can build.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from lmcache_triton.kernels import (blend, kv_deviation, paged_copy, paged_gather, paged_gather_layer,
                                    paged_scatter, paged_scatter_layer, rope, rope_rerotate, selective_write)
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping

TARGET = GPUTarget("cuda", 90, 32)
KERNELS = {
    paged_copy: ("_paged_gather_kernel", "_paged_scatter_kernel"),
    rope: ("_rope_rerotate_kernel",),
    blend: ("_kv_deviation_kernel", "_selective_write_kernel"),
}


class Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _widths(ptx: str, op: str) -> list[int]:
    """Bytes per global access of `op` (ld/st): `st.global.v2.b32` -> 8."""
    return [int(n or 1) * int(bits) // 8
            for n, bits in re.findall(op + r"\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[bsuf](\d+)\s", ptx)]


@functools.cache
def _binder(fn):
    backend = make_backend(TARGET)
    return backend, create_function_from_signature(fn.signature, fn.params, backend)


def specialize(fn, args: tuple, kwargs: dict):
    """Triton's own launch-time specialization for sm_90 (the binder `JITFunction.run` uses: pointer
    alignment, ints divisible by 16 or equal to 1, do_not_specialize), without a device.
    Returns the compile inputs and the key that decides whether a launch compiles anew."""
    backend, binder = _binder(fn)
    bound, specialization, options = binder(*args, **kwargs)
    key = repr((fn.__name__, specialization, sorted(options.items())))
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return ASTSource(fn, signature, constexprs, attrs), options.__dict__, key


def paged_cases():
    """(name, launcher thunk) for the paged copy family: layouts, dtypes, odd shapes, MLA."""
    specs = [
        ("packed-LBNHC-bf16-h8x128-bs16", "vllm_packed", "LBNHC", torch.bfloat16, 16, 8, 128),
        ("packed-BHLNC-fp16-h4x128-bs64", "vllm_packed", "BHLNC", torch.float16, 64, 4, 128),
        ("packed-LHBNC-bf16-h1x128-bs128", "vllm_packed", "LHBNC", torch.bfloat16, 128, 1, 128),
        ("packed-BLNHC-fp8-h8x128-bs16", "vllm_packed", "BLNHC", torch.float8_e4m3fn, 16, 8, 128),
        ("packed-LBHNC-fp16-h3x36-bs48", "vllm_packed", "LBHNC", torch.float16, 48, 3, 36),
        ("cpu-bf16-h2x64-bs16", "vllm_cpu", "LBNHC", torch.bfloat16, 16, 2, 64),
        ("flash_attn-fp32-h8x128-bs16", "flash_attn", "LBNHC", torch.float32, 16, 8, 128),
        ("flashinfer-fp16-h2x72-bs16", "flashinfer", "LBNHC", torch.float16, 16, 2, 72),
        ("mla-bf16-576-bs64", "mla", "LBNHC", torch.bfloat16, 64, 1, 576),
        ("mla-fp8-576-bs16", "mla", "LBNHC", torch.float8_e4m3fn, 16, 1, 576),
        ("mla-u8-72-bs16", "mla", "LBNHC", torch.uint8, 16, 1, 72),
    ]
    for name, layout, order, dtype, bs, heads, head in specs:
        caches = make_kv_caches(layout, num_layers=2, num_blocks=4, block_size=bs, num_kv_heads=heads,
                                head_size=head, dtype=dtype, order=order, fill=0)
        slots = random_slot_mapping(37, num_blocks=4, block_size=bs)
        yield name + "-all-layers", lambda c=caches, s=slots, lay=layout: paged_scatter(
            paged_gather(c, s, lay), c, s, lay)
        yield name + "-one-layer", lambda c=caches, s=slots, lay=layout: paged_scatter_layer(
            paged_gather_layer(c[0], s, lay), c[0], s, lay)
        yield name + "-capped-grid", lambda c=caches, s=slots, lay=layout: _capped(
            lambda: paged_scatter(paged_gather(c, s, lay), c, s, lay))


def _capped(run):
    """The zero-copy launches' variant: a capped grid whose programs loop over tiles."""
    paged_copy._FORCE_MAX_PROGRAMS = 3
    try:
        return run()
    finally:
        paged_copy._FORCE_MAX_PROGRAMS = None


def token_count_cases():
    """The same cache and layout at request lengths that differ per call: one compile, not one per length."""
    caches = make_kv_caches("vllm_packed", num_layers=2, num_blocks=80, block_size=16, num_kv_heads=8, head_size=128,
                            fill=0)
    for n in (1, 16, 37, 256, 1000):
        slots = random_slot_mapping(n, num_blocks=80, block_size=16)
        yield f"tokens-{n}", lambda s=slots: paged_scatter(paged_gather(caches, s, "vllm_packed"), caches, s,
                                                           "vllm_packed")
        k = torch.zeros(n, 8, 128, dtype=torch.bfloat16)
        yield f"tokens-{n}-blend", lambda k=k, n=n: (
            rope_rerotate(k, torch.arange(n), torch.arange(n) + 5, torch.zeros(64, 128, dtype=torch.bfloat16),
                          is_neox=True),
            kv_deviation(k, k), selective_write(k, k[: n // 2 + 1], torch.arange(n // 2 + 1)))


def blend_cases():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tag = str(dtype).removeprefix("torch.")
        for neox in (True, False):
            for head, rot in ((128, None), (64, 32), (80, None)):
                k = torch.zeros(9, 4, head, dtype=dtype)
                pos = torch.arange(9)
                cache = torch.zeros(64, rot or head, dtype=dtype)
                style = "neox" if neox else "gptj"
                yield f"rope-{tag}-{style}-h{head}-rot{rot or head}", lambda k=k, p=pos, c=cache, n=neox, r=rot: (
                    rope_rerotate(k, p, p + 3, c, is_neox=n, rotary_dim=r),
                    rope_rerotate(k, p, p + 3, c, is_neox=n, rotary_dim=r, out=k))
        yield f"deviation-{tag}-8x128", lambda d=dtype: kv_deviation(torch.zeros(33, 8, 128, dtype=d),
                                                                     torch.zeros(33, 8, 128, dtype=d))
        yield f"deviation-{tag}-3x40", lambda d=dtype: kv_deviation(torch.zeros(33, 3, 40, dtype=d),
                                                                    torch.zeros(33, 3, 40, dtype=d))
    for dtype, width in ((torch.bfloat16, 1024), (torch.uint8, 576), (torch.float32, 72)):
        tag = str(dtype).removeprefix("torch.")
        yield f"selective_write-{tag}-{width}", lambda d=dtype, w=width: selective_write(
            torch.zeros(20, w, dtype=d), torch.zeros(5, w, dtype=d), torch.tensor([3, -1, 0, 19, 7]))


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run with TRITON_INTERPRET unset: this compiles, it does not interpret", file=sys.stderr)
        return 2
    recorders: dict[str, Recorder] = {}
    for module, names in KERNELS.items():
        module.use_triton = lambda device: True
        for name in names:
            recorders[name] = Recorder(getattr(module, name))
            setattr(module, name, recorders[name])
    seen: dict[str, dict] = {}
    for case, run in [*paged_cases(), *blend_cases(), *token_count_cases()]:
        for rec in recorders.values():
            rec.calls.clear()
        run()
        for kernel, rec in recorders.items():
            for args, kwargs in rec.calls:
                src, options, key = specialize(rec.fn, args, kwargs)
                if key not in seen:
                    ptx = triton.compile(src, target=TARGET, options=options).asm["ptx"]
                    seen[key] = dict(vector_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
                                     vector_stores=len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx)),
                                     widest_store=max(_widths(ptx, "st"), default=0))
                print(json.dumps(dict(case=case, kernel=kernel, key=key, **seen[key])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
