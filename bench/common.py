"""What every bench result row carries: device, commit, time; and where rows are written."""

from __future__ import annotations

import json
from collections.abc import Callable
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

# One matplotlib import for the benches and the demo (the package cannot import bench/).
from lmcache_triton.tools.vllm_demo import PlotUnavailable as MatplotlibMissing  # noqa: F401
from lmcache_triton.tools.vllm_demo import pyplot

RESULTS = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads)"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def context() -> dict[str, str]:
    return {"device": device_name(), "commit": commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `repeats` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def make_timer(cuda: bool, repeats: int) -> Callable[[Callable[[], object]], float]:
    """A function giving the median seconds of fn(): triton's do_bench on CUDA, wall clock on CPU."""
    if cuda:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=5, rep=max(20, repeats * 5),
                                                  return_mode="median") / 1e3
    return lambda fn: median_seconds(fn, repeats)


def graph_seconds(fn: Callable[[], object], samples: int = 20, replays: int = 1, warmup: int = 3) -> float:
    """Median seconds per call of fn on the device alone (CUDA): fn is captured once in a CUDA graph
    and replayed `replays` times between two events, `samples` times. The warm-up calls run first on
    a side stream, so Triton compiles and caches fill outside the capture. Raises what the capture
    raises (a host sync, `.item()`, an allocation the capture refuses): see graph_or_eager."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / replays)
    return median(times)


def call_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of one whole call of fn (CUDA), host and device: an event is recorded on the
    idle GPU, fn runs (its Python, then its launches), a second event follows its last kernel. Unlike
    do_bench (calls queued behind an L2 flush, which hides the host's time), the host's time counts."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return median(times)


def graph_or_eager(fn: Callable[[], object], graph_timer: Callable[[Callable[[], object]], float],
                   eager_timer: Callable[[Callable[[], object]], float]) -> tuple[float, str, str]:
    """(seconds, "graph", "") from graph_timer(fn); where it raises (fn cannot be captured), the
    stream's state is restored and it is (eager_timer(fn), "eager", why the capture failed)."""
    try:
        return graph_timer(fn), "graph", ""
    except Exception as e:  # noqa: BLE001 - any capture failure means: time it the plain way
        if torch.cuda.is_available():
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - the failed capture's error, already reported below
                pass
        why = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        return eager_timer(fn), "eager", why


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def progress(iterable, *, total: int | None = None, desc: str = ""):
    """A tqdm bar over `iterable` when tqdm is importable (it comes with vLLM), else one plain line
    per item: long runs must show they are alive without making tqdm a dependency."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
        return
    total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
    for i, item in enumerate(iterable, 1):
        print(f"  {desc} {i}/{total if total is not None else '?'}", flush=True)
        yield item


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): no numpy needed, and p99 of a few samples is the max."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, -(-len(s) * q // 100) - 1))
    return s[int(k)]




def plot_bars(path: Path, title: str, groups: dict[str, dict[str, float]], ylabel: str, log: bool = False) -> Path:
    """Grouped bars: groups = {x label: {series name: value}} (series absent from a group are skipped);
    `log`: a logarithmic y axis (values that differ by orders of magnitude)."""
    plt = pyplot()
    series = list(dict.fromkeys(s for g in groups.values() for s in g))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.4 * len(groups) * max(1, len(series)))), 4.5))
    for i, s in enumerate(series):
        xs = [j + i * width for j, g in enumerate(groups.values()) if s in g]
        ys = [g[s] for g in groups.values() if s in g]
        ax.bar(xs, ys, width, label=s)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))], list(groups), fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.set_title(f"{title}\n{context()['device']}", fontsize=9)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
