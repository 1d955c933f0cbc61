"""The first run on a GPU host, in one command: `python -m bench.gpu_check [--quick]`.

Each section runs on its own (one that fails or does not apply does not hide the rest), and each
target gets one verdict line: PASS, FAIL, or SKIP with why. On a host without CUDA the sections
that need one skip, and the rest (our host cost per launch, the sm_90 compile check, the
interpreter's kernel matrix) run. Everything goes to one JSON under bench/results/.

Sections:
- topology: the GPU, its PCIe link (nvidia-smi), torch/triton versions;
- host_cost: our Python per launcher call before Triton's launch (< 20 us, issue #16);
- compile_sm90: every kernel compiles for sm_90 from its launchers' real arguments;
- interpreter: the kernel tests under TRITON_INTERPRET=1 on one small case (CPU hosts only);
- pytest_gpu: `pytest -m gpu` (the kernels and connectors on the device);
- layouts: issue #27's layouts on a GPU host (packed layer- and block-outermost, flash_attn,
  flashinfer, separate per-layer tensors, MLA), 2048 tokens on random blocks, gather and scatter
  bit-exact and vs a device copy of the same bytes (>= 80%);
- device_copy: all-layers gather/scatter of a device chunk (256 tokens x 32 layers, Llama-8B KV),
  block 16 and 128, bit-exact against the torch reference, vs a device copy of the same bytes,
  both timed through CUDA graphs (>= 80% of the copy, >= 2x the torch reference);
- pinned: a pinned host chunk, zero-copy (the kernel over PCIe) vs staged (kernel into a device
  buffer + one DMA) vs a plain pinned copy, both ways (>= 90% of the pinned copy);
- compute_slowdown: a GEMM alone vs with saves running beside it, zero-copy and staged;
- layerwise_overlap: per-layer GEMMs with layerwise stores and loads interleaved, overlapped or not;
- compiled_variants: kernel variants Triton compiled across request lengths 1..8192 (no growth
  with the length: the tile keys on constexpr sizes only);
- memcheck: `compute-sanitizer --tool memcheck` on a small gather/scatter, when it is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.common import context, write_json

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
SECTIONS: dict[str, object] = {}


class Skip(Exception):
    """A section that does not apply here; its message says why."""


def section(fn):
    SECTIONS[fn.__name__] = fn
    return fn


def _need_cuda() -> None:
    if not CUDA:
        raise Skip("needs a CUDA device; this host has none")


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def _summary(r: subprocess.CompletedProcess) -> str:
    """pytest's last line (its counts), or the error's."""
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit {r.returncode}"


def _verdict(name: str, ok: bool, value: str) -> dict:
    return {"target": name, "verdict": "PASS" if ok else "FAIL", "value": value}


# ---- sections ---------------------------------------------------------------------------------------
@section
def topology(quick: bool) -> dict:
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__, "cuda": CUDA}
    _need_cuda()
    out["device"] = torch.cuda.get_device_name()
    out["capability"] = list(torch.cuda.get_device_capability())
    if shutil.which("nvidia-smi"):
        q = _run(["nvidia-smi", "--query-gpu=pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,"
                  "pcie.link.width.max", "--format=csv,noheader"], 30)
        out["pcie"] = q.stdout.strip()
    return out


@section
def host_cost(quick: bool) -> dict:
    from bench.kernels import HOST_COST_TARGET_US, host_cost as measure

    cost = measure(repeats=500 if quick else 2000)
    worst = max(cost["engine_gather_all_layers"], cost["engine_scatter_all_layers"])
    return {"us": cost, "verdicts": [_verdict(f"host cost per all-layers call < {HOST_COST_TARGET_US:g} us",
                                              worst < HOST_COST_TARGET_US, f"{worst:.1f} us")]}


@section
def compile_sm90(quick: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/kernels/test_compile_sm90.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900, env=env)
    return {"verdicts": [_verdict("every kernel compiles for sm_90", r.returncode == 0, _summary(r))]}


@section
def interpreter(quick: bool) -> dict:
    if CUDA:
        raise Skip("the native matrix runs on this host (pytest_gpu); the interpreter is for CPU hosts")
    pick = ["-k", "test_gather or test_shapes"] if quick else []  # quick: every layout and dtype, one way
    r = _run([sys.executable, "-m", "pytest", "-q", "-m", "not gpu", "tests/kernels/test_paged_copy.py", *pick],
             1500, env={"TRITON_INTERPRET": "1"})
    return {"verdicts": [_verdict("paged copy kernels under the interpreter", r.returncode == 0, _summary(r))]}


@section
def pytest_gpu(quick: bool) -> dict:
    _need_cuda()
    # Spread over the host's cores: each test compiles its own Triton variants (mostly host time).
    workers = ["-n", str(min(12, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") else []
    r = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", *workers, "tests"], 1800)
    return {"verdicts": [_verdict("pytest -m gpu", r.returncode == 0, _summary(r))]}


def _graph_ms(fn) -> float:
    """Median ms per call of `fn` on the device, through a CUDA graph (no host launch cost in the
    figure). What cannot be captured (the torch reference reads slots back to the host) is timed
    eager, host included: that is its real cost."""
    from bench.common import call_seconds, graph_or_eager, graph_seconds

    seconds, _, _ = graph_or_eager(fn, graph_seconds, lambda f: call_seconds(f, 20))
    return seconds * 1e3


def _llama8b(block_size: int, num_tokens: int = 256):
    from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping

    caches = make_kv_caches("vllm_packed", num_layers=32, num_blocks=4 * num_tokens // block_size + 8,
                            block_size=block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                            device="cuda", order="LBNHC")
    slots = random_slot_mapping(num_tokens, num_blocks=4 * num_tokens // block_size + 8, block_size=block_size,
                                generator=torch.Generator().manual_seed(0)).cuda()
    return caches, slots


@section
def device_copy(quick: bool) -> dict:
    _need_cuda()
    from lmcache_triton.kernels import paged_gather, paged_gather_ref, paged_scatter, paged_scatter_ref

    rows, verdicts = [], []
    for bs in (16, 128):
        caches, slots = _llama8b(bs)
        out = torch.empty(2, 32, 256, 1024, dtype=torch.bfloat16, device="cuda")
        paged_gather(caches, slots, "vllm_packed", out=out)
        exact = torch.equal(out.view(torch.int16), paged_gather_ref(caches, slots, "vllm_packed").view(torch.int16))
        src = out.clone()
        copy_ms = _graph_ms(lambda: out.copy_(src))
        gather_ms = _graph_ms(lambda: paged_gather(caches, slots, "vllm_packed", out=out))
        ref_ms = _graph_ms(lambda: paged_gather_ref(caches, slots, "vllm_packed"))
        scatter_ms = _graph_ms(lambda: paged_scatter(src, caches, slots, "vllm_packed"))
        sref_ms = _graph_ms(lambda: paged_scatter_ref(src, caches, slots, "vllm_packed"))
        rows.append(dict(block_size=bs, exact=exact, copy_ms=copy_ms, gather_ms=gather_ms, scatter_ms=scatter_ms,
                         gather_ref_ms=ref_ms, scatter_ref_ms=sref_ms))
        verdicts += [_verdict(f"bs={bs} gather bit-exact", exact, str(exact)),
                     _verdict(f"bs={bs} gather >= 80% of a device copy", copy_ms / gather_ms >= 0.8,
                              f"{copy_ms / gather_ms:.2f}"),
                     _verdict(f"bs={bs} scatter >= 80% of a device copy", copy_ms / scatter_ms >= 0.8,
                              f"{copy_ms / scatter_ms:.2f}"),
                     _verdict(f"bs={bs} gather >= 2x the torch reference", ref_ms / gather_ms >= 2,
                              f"{ref_ms / gather_ms:.2f}x"),
                     _verdict(f"bs={bs} scatter >= 2x the torch reference", sref_ms / scatter_ms >= 2,
                              f"{sref_ms / scatter_ms:.2f}x")]
    return {"rows": rows, "verdicts": verdicts}


def _layout_caches(case: str, tokens: int):
    """Caches as vLLM allocates them on a GPU host (issue #27), Llama-8B KV (MLA: DeepSeek-V3's),
    with 4x the blocks the prompt needs, and the prompt's slots on random whole blocks."""
    from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping

    layout, order = {"packed-layer-outer": ("vllm_packed", "LBNHC"), "packed-block-outer": ("vllm_packed", "BLNHC"),
                     "flash_attn": ("flash_attn", "LBNHC"), "flashinfer": ("flashinfer", "LBNHC"),
                     "separate-layers": ("flash_attn", "LBNHC"), "mla": ("mla", "LBNHC")}[case]
    layers, heads, head_size = (61, 1, 576) if layout == "mla" else (32, 8, 128)
    bs = 16
    nb = 4 * tokens // bs
    caches = make_kv_caches(layout, num_layers=layers, num_blocks=nb, block_size=bs, num_kv_heads=heads,
                            head_size=head_size, dtype=torch.bfloat16, device="cuda", order=order)
    if case == "separate-layers":  # older vLLM and other engines: one allocation per layer
        caches = [c.clone() for c in caches]
    slots = random_slot_mapping(tokens, num_blocks=nb, block_size=bs,
                                generator=torch.Generator().manual_seed(1)).cuda()
    return layout, caches, slots


@section
def layouts(quick: bool) -> dict:
    """Issue #27 on a GPU host: gather and scatter of a 2048-token prompt on random blocks, every
    layout vLLM allocates, bit-exact, the kernel vs a device copy of the same bytes (graph-timed)."""
    _need_cuda()
    from lmcache_triton.kernels import paged_gather, paged_gather_ref, paged_scatter, paged_scatter_ref

    rows, verdicts = [], []
    for case in ("packed-layer-outer", "packed-block-outer", "flash_attn", "flashinfer", "separate-layers", "mla"):
        layout, caches, slots = _layout_caches(case, 2048)
        out = paged_gather(caches, slots, layout)
        exact_g = torch.equal(out.view(torch.int16), paged_gather_ref(caches, slots, layout).view(torch.int16))
        src = torch.randn_like(out.float()).to(out.dtype)
        paged_scatter(src, caches, slots, layout)
        exact_s = torch.equal(paged_gather_ref(caches, slots, layout).view(torch.int16), src.view(torch.int16))
        copy_dst = torch.empty_like(src)
        copy_ms = _graph_ms(lambda: copy_dst.copy_(src))
        gather_ms = _graph_ms(lambda: paged_gather(caches, slots, layout, out=out))
        scatter_ms = _graph_ms(lambda: paged_scatter(src, caches, slots, layout))
        gbps = out.numel() * out.element_size() / 1e6
        rows.append(dict(case=case, layout=layout, bytes=out.numel() * out.element_size(), copy_ms=copy_ms,
                         gather_ms=gather_ms, scatter_ms=scatter_ms, copy_gbps=gbps / copy_ms,
                         gather_gbps=gbps / gather_ms, scatter_gbps=gbps / scatter_ms))
        verdicts += [_verdict(f"{case} gather and scatter bit-exact", exact_g and exact_s, f"{exact_g}/{exact_s}"),
                     _verdict(f"{case} gather >= 80% of a device copy", copy_ms / gather_ms >= 0.8,
                              f"{copy_ms / gather_ms:.2f} ({gbps / gather_ms:.0f} GB/s)"),
                     _verdict(f"{case} scatter >= 80% of a device copy", copy_ms / scatter_ms >= 0.8,
                              f"{copy_ms / scatter_ms:.2f} ({gbps / scatter_ms:.0f} GB/s)")]
        del caches, out, src, copy_dst
        torch.cuda.empty_cache()
    return {"rows": rows, "verdicts": verdicts}


@section
def pinned(quick: bool) -> dict:
    _need_cuda()
    from lmcache_triton.kernels import paged_gather, paged_scatter

    caches, slots = _llama8b(16)
    host = torch.empty(2, 32, 256, 1024, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    rows = {
        "pinned_copy_d2h": _graph_ms(lambda: host.copy_(dev, non_blocking=True)),
        "pinned_copy_h2d": _graph_ms(lambda: dev.copy_(host, non_blocking=True)),
        "zero_copy_gather": _graph_ms(lambda: paged_gather(caches, slots, "vllm_packed", out=host)),
        "zero_copy_scatter": _graph_ms(lambda: paged_scatter(host, caches, slots, "vllm_packed")),
        "staged_gather": _graph_ms(lambda: (paged_gather(caches, slots, "vllm_packed", out=dev),
                                            host.copy_(dev, non_blocking=True))),
        "staged_scatter": _graph_ms(lambda: (dev.copy_(host, non_blocking=True),
                                             paged_scatter(dev, caches, slots, "vllm_packed"))),
    }
    best_g = min(rows["zero_copy_gather"], rows["staged_gather"])
    best_s = min(rows["zero_copy_scatter"], rows["staged_scatter"])
    return {"ms": rows, "verdicts": [
        _verdict("gather to pinned >= 90% of a pinned copy", rows["pinned_copy_d2h"] / best_g >= 0.9,
                 f"{rows['pinned_copy_d2h'] / best_g:.2f}"),
        _verdict("scatter from pinned >= 90% of a pinned copy", rows["pinned_copy_h2d"] / best_s >= 0.9,
                 f"{rows['pinned_copy_h2d'] / best_s:.2f}")]}


def _gemm_ms(a: torch.Tensor, b: torch.Tensor, reps: int, beside=None) -> float:
    side = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if beside is not None:
        with torch.cuda.stream(side):
            for _ in range(reps):
                beside()
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@section
def compute_slowdown(quick: bool) -> dict:
    _need_cuda()
    from lmcache_triton.kernels import paged_gather

    caches, slots = _llama8b(16)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    host = torch.empty(2, 32, 256, 1024, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    reps = 20
    sides = {"alone": None,
             "zero_copy_saves": lambda: paged_gather(caches, slots, "vllm_packed", out=host),
             "staged_saves": lambda: (paged_gather(caches, slots, "vllm_packed", out=dev),
                                      host.copy_(dev, non_blocking=True))}
    # Warm first (compiles, and the clocks: an idle H200 sits at 345 MHz), then the three
    # interleaved, 3 rounds, median each: the first GEMMs timed alone ran 4x slower than later ones.
    for beside in sides.values():
        _gemm_ms(a, a, 5, beside)
    samples = {k: [] for k in sides}
    for _ in range(3):
        for k, beside in sides.items():
            samples[k].append(_gemm_ms(a, a, reps, beside))
    ms = {k: sorted(v)[1] for k, v in samples.items()}
    alone, zero, staged = ms["alone"], ms["zero_copy_saves"], ms["staged_saves"]
    return {"gemm_ms": ms,
            "verdicts": [_verdict("GEMM slowdown with staged saves <= 10%", staged / alone <= 1.1,
                                  f"{staged / alone:.2f}x (zero-copy {zero / alone:.2f}x)")]}


@section
def layerwise_overlap(quick: bool) -> dict:
    _need_cuda()
    from lmcache_triton.engine.gpu_connector import KVTarget, VLLMPagedMemLayerwiseGPUConnector
    from lmcache_triton.storage.memory import MemoryFormat, TensorMemoryPool

    caches, slots = _llama8b(16)
    conn = VLLMPagedMemLayerwiseGPUConnector(hidden_dim_size=1024, num_layers=32, chunk_size=256,
                                             dtype=torch.bfloat16, layout="vllm_packed", device="cuda")
    pool = TensorMemoryPool(64 << 20)
    objs = [[pool.allocate(conn.get_shape(256), torch.bfloat16, MemoryFormat.KV_T2D)] for _ in range(32)]
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    target = KVTarget(caches, slots, 0, True)

    def forward(with_store: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = conn.batched_from_gpu(objs, [0], [256], target) if with_store else None
        for _ in range(32):
            a @ a
            if steps is not None:
                next(steps)
        if steps is not None:
            steps.close()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def steps_alone() -> float:
        """The stores' host time per layer with no GEMM to hide it behind."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = conn.batched_from_gpu(objs, [0], [256], target)
        for _ in range(32):
            next(steps)
        steps.close()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / 32

    for _ in range(2):
        forward(True)
    alone = min(forward(False) for _ in range(5))
    stored = min(forward(True) for _ in range(5))
    per_layer = min(steps_alone() for _ in range(5))
    for row in objs:
        for obj in row:
            obj.free()
    return {"ms": {"gemms": alone, "gemms_with_layerwise_stores": stored, "gemm_per_layer": alone / 32,
                   "store_step_per_layer_no_gemm": per_layer},
            "verdicts": [_verdict("layerwise stores overlap the forward (<= 10% added)", stored / alone <= 1.1,
                                  f"{stored / alone:.2f}x; a layer's GEMM {alone / 32:.3f} ms, its store step "
                                  f"alone {per_layer:.3f} ms")]}


@section
def compiled_variants(quick: bool) -> dict:
    _need_cuda()
    from lmcache_triton.kernels import paged_copy, paged_gather

    def variants() -> int:
        kernel = paged_copy._paged_gather_kernel
        caches_by_device = getattr(kernel, "device_caches", None) or getattr(kernel, "cache", {})
        return sum(len(c[0]) if isinstance(c, tuple) else len(c) for c in caches_by_device.values())

    caches, _ = _llama8b(16, 8192)
    before = variants()  # the sections before this one compiled theirs (other block sizes, layouts, LOOP)
    for n in (1, 7, 64, 255, 256, 1000, 4096, 8192):
        slots = torch.arange(n, device="cuda")
        paged_gather(caches, slots, "vllm_packed")
    torch.cuda.synchronize()
    count = variants() - before
    return {"variants": count, "verdicts": [_verdict("gather variants across 8 request lengths <= 2", count <= 2,
                                                     str(count))]}


@section
def memcheck(quick: bool) -> dict:
    _need_cuda()
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        raise Skip("compute-sanitizer is not installed")
    code = ("import torch; from lmcache_triton.kernels import paged_gather, paged_scatter; "
            "from lmcache_triton.tools.testing import make_kv_caches; "
            "c = make_kv_caches('vllm_packed', num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, "
            "head_size=64, dtype=torch.bfloat16, device='cuda', order='LBNHC'); "
            "s = torch.tensor([3, -1, 17, 100], device='cuda'); o = paged_gather(c, s, 'vllm_packed'); "
            "paged_scatter(o, c, s, 'vllm_packed'); torch.cuda.synchronize()")
    r = _run([tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-c", code], 600)
    return {"verdicts": [_verdict("memcheck clean on a small gather/scatter", r.returncode == 0,
                                  (r.stdout + r.stderr).strip()[-300:])]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, in this order")
    args = p.parse_args(argv)
    results, failed = {}, 0
    for name in args.sections.split(","):
        fn = SECTIONS[name]
        t0 = time.perf_counter()
        try:
            out = fn(args.quick)
            status = "ran"
        except Skip as e:
            out, status = {"why": str(e)}, "skipped"
        except Exception as e:  # noqa: BLE001 - one section's failure is its result, not the run's end
            out, status = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}, "error"
            failed += 1
        out["status"], out["seconds"] = status, round(time.perf_counter() - t0, 2)
        results[name] = out
        if status == "skipped":
            print(f"SKIP  {name}: {out['why']}", flush=True)
        elif status == "error":
            print(f"FAIL  {name}: {out['error']}", flush=True)
        for v in out.get("verdicts", []):
            print(f"{v['verdict']}  {name}: {v['target']} ({v['value']})", flush=True)
            failed += v["verdict"] == "FAIL"
        if status == "ran" and not out.get("verdicts"):
            print(f"INFO  {name}: {json.dumps({k: v for k, v in out.items() if k not in ('status', 'seconds')})}",
                  flush=True)
    path = write_json("gpu_check", {**context(), "sections": results})
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
