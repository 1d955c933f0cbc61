"""Every Triton kernel, compiled for a real GPU target (sm_90) without a GPU.

The CPU matrix runs the kernels in Triton's interpreter, which accepts programs the compiler may
reject; `compile_sm90.py` drives the public launchers with CPU tensors, records each launch and
specializes it with Triton's own binder and runs the real compiler (down to ptxas), in a subprocess
with TRITON_INTERPRET unset.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = {"_paged_gather_kernel", "_paged_scatter_kernel", "_rope_rerotate_kernel", "_kv_deviation_kernel",
           "_selective_write_kernel"}
# Cases whose every offset is a multiple of 16 bytes: the cache and the chunk side both get 16-byte
# vector accesses (the VEC hint plus Triton's own divisibility specialization).
VECTORIZED = ("packed-LBNHC-bf16-h8x128", "packed-BHLNC-fp16-h4x128", "packed-LHBNC-bf16-h1x128",
              "packed-BLNHC-fp8-h8x128", "flash_attn-fp32-h8x128", "flashinfer-fp16-h2x72", "mla-bf16-576",
              "mla-fp8-576", "selective_write-bfloat16-1024", "selective_write-uint8-576")
# Bytes per write into the paged cache (the scatter kernel's stores): 16 where everything is
# 16-byte aligned, 8 for rows of 72 bytes (fp16 head size 36, uint8 MLA C=72), 2 for the CPU
# layout's transposed K. Width-120 deviation rows and the rest only have to compile.
CACHE_WRITE_BYTES = {"packed-LBNHC-bf16-h8x128": 16, "packed-BLNHC-fp8-h8x128": 16, "mla-fp8-576": 16,
                     "packed-LBHNC-fp16-h3x36": 8, "mla-u8-72": 8, "cpu-bf16-h2x64": 2}


def test_every_kernel_compiles_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a real compile, never a cache hit
    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, str(here / "compile_sm90.py")], env=env, cwd=here.parent.parent,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {r["kernel"] for r in rows} == KERNELS
    cases = {r["case"] for r in rows}
    assert len(cases) >= 40, sorted(cases)
    for prefix in VECTORIZED:
        hits = [r for r in rows if r["case"].startswith(prefix)]
        assert hits, prefix
        for r in hits:
            assert r["vector_loads"] > 0 and r["vector_stores"] > 0, r
    for prefix, width in CACHE_WRITE_BYTES.items():
        hits = [r for r in rows if r["case"].startswith(prefix) and r["kernel"] == "_paged_scatter_kernel"]
        assert hits and all(r["widest_store"] == width for r in hits), (prefix, hits)
    # Request lengths vary every call (1, 16, 37, 256, 1000 tokens): Triton's own specialization
    # must give one key per kernel, i.e. one compile, not one per length.
    keys: dict[str, set[str]] = {}
    for r in rows:
        if r["case"].startswith("tokens-"):
            keys.setdefault(r["kernel"], set()).add(r["key"])
    assert set(keys) == KERNELS and all(len(v) == 1 for v in keys.values()), keys
    # RoPE reads and writes K rows contiguously in both styles (GPT-J: one row, split into pairs).
    for r in rows:
        if r["case"].startswith("rope-"):
            assert r["vector_loads"] > 0 and r["vector_stores"] > 0, r
