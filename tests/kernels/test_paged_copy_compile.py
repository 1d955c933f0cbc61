"""Compile the paged copy kernels for a real GPU target (sm_90) without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepts programs the compiler may
reject; this runs the real compiler (down to ptxas) in a subprocess with TRITON_INTERPRET=0, and
checks that an aligned layout gets 16-byte vector loads and stores on both sides.
"""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import re, triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from lmcache_triton.kernels import paged_copy as pc

    # vllm_packed LBNHC, fp16 viewed as int16, 8 heads x 128, block 16: every offset 16-byte aligned
    bt, bd, nw = pc._tile(8 * 128)
    for kern in (pc._paged_gather_kernel, pc._paged_scatter_kernel):
        sig = dict(cache_ptr="*i16", layer_off_ptr="*i64", slot_ptr="*i64", chunk_ptr="*i16",
                   num_tokens="i32", kv_off="i32", stride_b="i64", stride_o="i32", stride_h="i32",
                   stride_d="constexpr", v_stride_b="i64", v_stride_o="i32", v_stride_h="i32",
                   v_stride_d="constexpr", c_stride_kv="i32", c_stride_l="i32", c_stride_t="i32",
                   c_stride_c="constexpr", BLOCK_SIZE="constexpr", HEAD_SIZE="constexpr",
                   HIDDEN="constexpr", NUM_KV="constexpr", VEC="constexpr", BLOCK_T="constexpr",
                   BLOCK_D="constexpr")
        consts = dict(stride_d=1, v_stride_d=1, c_stride_c=1, BLOCK_SIZE=16, HEAD_SIZE=128, HIDDEN=1024, NUM_KV=2,
                      VEC=8, BLOCK_T=bt, BLOCK_D=bd)
        aligned = ["cache_ptr", "layer_off_ptr", "slot_ptr", "chunk_ptr", "kv_off", "stride_b",
                   "stride_o", "stride_h", "v_stride_b", "v_stride_o", "v_stride_h", "c_stride_kv", "c_stride_l", "c_stride_t"]
        idx = kern.arg_names.index
        src = ASTSource(fn=kern, signature=sig, constexprs={(idx(k),): v for k, v in consts.items()},
                        attrs={(idx(k),): [["tt.divisibility", 16]] for k in aligned})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw}).asm["ptx"]
        ops = set(re.findall(r"(?:ld|st)\\.global\\.v4", ptx))
        assert ops == {"ld.global.v4", "st.global.v4"}, (kern.fn.__name__, ops)
    print("OK")
""")


def test_kernels_compile_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
               TRITON_DEFAULT_FP_FUSION="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]
